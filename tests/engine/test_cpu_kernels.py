"""The bf16 CPU path: oneDNN-packed linears compute what F.linear computes, only untied bf16 CPU
layers are packed, and sibling linears (q/k/v, gate/up) fused into one product give each caller
what its own linear gives, in any call order."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from worker.engine.cpu_linear import (
    PackedLinear, SiblingLinear, fuse_sibling_linears, pack_cpu_linears, packing_available)
from tests.engine.tiny_models import MODEL_FACTORIES

needs_packing = pytest.mark.skipif(not packing_available(), reason="oneDNN packs bf16 only on CPUs with native bf16 "
                                   "(AVX512-BF16, AMX) and in torch builds with oneDNN")


@needs_packing
@pytest.mark.parametrize("rows", [1, 7, 64])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_equals_f_linear(rows, bias):
    torch.manual_seed(rows)
    linear = torch.nn.Linear(96, 160, bias=bias).to(torch.bfloat16)
    x = torch.randn(1, rows, 96, dtype=torch.bfloat16)
    expected = F.linear(x, linear.weight, linear.bias).float()
    got = PackedLinear(linear)(x)
    assert got.shape == (1, rows, 160) and got.dtype == torch.bfloat16
    # oneDNN computes the same products; allow one bf16 rounding step of the output's scale
    assert (got.float() - expected).abs().max().item() <= 2 ** -7 * expected.abs().max().item()


@needs_packing
def test_only_untied_bf16_layers_are_packed():
    torch.manual_seed(0)
    model = MODEL_FACTORIES["llama"]()
    model.config.tie_word_embeddings = True
    model.tie_weights()
    assert pack_cpu_linears(copy.deepcopy(model)) == 0  # float32: left as it is
    half = copy.deepcopy(model).to(torch.bfloat16)
    layers = half.config.num_hidden_layers
    assert pack_cpu_linears(half) == 7 * layers  # q k v o gate up down; not the tied LM head
    assert type(half.lm_head) is torch.nn.Linear
    assert half.lm_head.weight.data_ptr() == half.model.embed_tokens.weight.data_ptr()
    assert all(p.dtype == torch.bfloat16 for p in half.parameters())
    # a packed model still deep-copies (the engine and the benchmarks copy models)
    twin = copy.deepcopy(half)
    x = torch.randint(3, 500, (1, 9))
    assert torch.equal(twin(x).logits, half(x).logits)


def close_to(got: torch.Tensor, expected: torch.Tensor) -> bool:
    """Within one bf16 rounding step of the output's scale (a product of another shape may round
    differently in oneDNN)."""
    return (got.float() - expected.float()).abs().max().item() <= 2 ** -7 * expected.abs().max().item()


class _Block(torch.nn.Module):
    def __init__(self, bias: bool):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = (torch.nn.Linear(96, n, bias=bias) for n in (96, 32, 32))


@needs_packing
@pytest.mark.parametrize("bias", [False, True])
def test_sibling_linears_give_each_caller_its_own_linears_output(bias):
    torch.manual_seed(3)
    block = _Block(bias).to(torch.bfloat16)
    expected_block = copy.deepcopy(block)
    assert fuse_sibling_linears(block) == 1
    assert all(type(getattr(block, n)) is SiblingLinear for n in ("q_proj", "k_proj", "v_proj"))
    x, y = (torch.randn(1, 5, 96, dtype=torch.bfloat16) for _ in range(2))
    expected = {n: {k: F.linear(t, getattr(expected_block, n).weight, getattr(expected_block, n).bias)
                    for k, t in (("x", x), ("y", y))} for n in ("q_proj", "k_proj", "v_proj")}
    # in order, out of order, one skipped, one asked twice, inputs interleaved
    calls = [("q_proj", "x"), ("k_proj", "x"), ("v_proj", "x"),
             ("v_proj", "y"), ("q_proj", "y"), ("q_proj", "y"), ("k_proj", "x"), ("k_proj", "y")]
    for name, which in calls:
        got = getattr(block, name)(x if which == "x" else y)
        assert got.shape == expected[name][which].shape
        assert close_to(got, expected[name][which]), (name, which)


@needs_packing
def test_a_fused_model_computes_what_the_packed_one_does_and_still_copies():
    torch.manual_seed(0)
    model = MODEL_FACTORIES["llama"]().to(torch.bfloat16).eval()
    packed = copy.deepcopy(model)
    pack_cpu_linears(packed)
    layers = model.config.num_hidden_layers
    assert fuse_sibling_linears(model) == 2 * layers  # q/k/v and gate/up of every layer
    # what is left: o_proj and down_proj of every layer, and this model's untied LM head
    assert pack_cpu_linears(model) == 2 * layers + 1
    x = torch.randint(3, 500, (1, 9))
    with torch.inference_mode():
        fused_logits, packed_logits = model(x).logits, packed(x).logits
        assert close_to(fused_logits, packed_logits)
        twin = copy.deepcopy(model)
        assert torch.equal(twin(x).logits, model(x).logits)
