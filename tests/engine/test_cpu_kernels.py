"""The CPU linears: oneDNN-packed linears compute what F.linear computes (float32 everywhere, bf16
where the CPU has native bf16), a tied LM head is packed only when asked, and sibling linears
(q/k/v, gate/up) fused into one product give each caller what its own linear gives, in any call
order."""

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
# float32 packs on every CPU with oneDNN; bf16 only with native bf16
PACKED_DTYPES = [torch.float32, pytest.param(torch.bfloat16, marks=needs_packing)]
# relative to the output's scale: one bf16 rounding step; float32 sums taken in another order
TOLERANCE = {torch.bfloat16: 2 ** -7, torch.float32: 1e-5}


@pytest.mark.parametrize("dtype", PACKED_DTYPES)
@pytest.mark.parametrize("rows", [1, 7, 64])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_equals_f_linear(rows, bias, dtype):
    torch.manual_seed(rows)
    linear = torch.nn.Linear(96, 160, bias=bias).to(dtype)
    x = torch.randn(1, rows, 96, dtype=dtype)
    expected = F.linear(x, linear.weight, linear.bias).float()
    got = PackedLinear(linear)(x)
    assert got.shape == (1, rows, 160) and got.dtype == dtype
    assert (got.float() - expected).abs().max().item() <= TOLERANCE[dtype] * expected.abs().max().item()


@pytest.mark.parametrize("dtype", PACKED_DTYPES)
def test_a_tied_lm_head_is_packed_only_when_asked(dtype):
    torch.manual_seed(0)
    model = MODEL_FACTORIES["llama"]().to(dtype).eval()
    model.config.tie_word_embeddings = True
    model.tie_weights()
    layers = model.config.num_hidden_layers
    untied = copy.deepcopy(model)
    assert pack_cpu_linears(untied) == 7 * layers  # q k v o gate up down; not the tied LM head
    assert type(untied.lm_head) is torch.nn.Linear
    assert untied.lm_head.weight.data_ptr() == untied.model.embed_tokens.weight.data_ptr()
    assert all(p.dtype == dtype for p in untied.parameters())
    both = copy.deepcopy(model)
    assert pack_cpu_linears(both, shared=True) == 7 * layers + 1
    assert type(both.lm_head) is PackedLinear and type(both.model.embed_tokens) is torch.nn.Embedding
    x = torch.randint(3, 500, (1, 9))
    with torch.inference_mode():
        expected = model(x).logits.float()
        for packed in (untied, both):
            got = packed(x).logits.float()
            assert (got - expected).abs().max().item() <= 8 * TOLERANCE[dtype] * expected.abs().max().item()
        # a packed model still deep-copies (the engine and the benchmarks copy models)
        twin = copy.deepcopy(both)
        assert torch.equal(twin(x).logits, both(x).logits)


@pytest.mark.skipif(packing_available(torch.bfloat16), reason="this CPU has native bf16")
def test_bf16_is_left_unpacked_without_native_bf16():
    """oneDNN's reorder refuses bf16 on an AVX2-only CPU: nothing is packed, F.linear stays."""
    model = MODEL_FACTORIES["llama"]().to(torch.bfloat16)
    assert pack_cpu_linears(model, shared=True) == 0 and fuse_sibling_linears(model) == 0
    assert all(type(m) is not PackedLinear for m in model.modules())


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
