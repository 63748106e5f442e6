"""The bf16 CPU path: oneDNN-packed linears compute what F.linear computes, and only untied bf16
CPU layers are packed."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from worker.engine.cpu_linear import PackedLinear, pack_cpu_linears, packing_available
from tests.engine.tiny_models import MODEL_FACTORIES

needs_packing = pytest.mark.skipif(not packing_available(), reason="torch built without oneDNN")


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
