"""The CPU linears: oneDNN-packed linears compute what F.linear computes (float32 everywhere, bf16
where the CPU has native bf16), so does kvfleet's own bf16 product (AVX512-BF16 CPUs), a tied LM
head is packed only when asked, and sibling linears (q/k/v, gate/up) fused into one product give
each caller what its own linear gives, in any call order."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from shared.cpu_features import cpu_features
from tests.engine.tiny_models import MODEL_FACTORIES
from worker.engine import cpu_linear
from worker.engine.cpu_attention import load_kernel, unavailable_reason
from worker.engine.cpu_linear import (
    Bf16Linear, PackedLinear, SiblingLinear, fuse_sibling_linears, own_bf16_product,
    pack_cpu_linears, packing_available)

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
    assert type(both.lm_head) in (PackedLinear, Bf16Linear)
    assert type(both.model.embed_tokens) is torch.nn.Embedding
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
    assert all(type(m) not in (PackedLinear, Bf16Linear) for m in model.modules())


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


# ---- kvfleet's bf16 product (cpu_matmul.cpp) -------------------------------------------------------

_BF16_BUILD = unavailable_reason() is None and bool(load_kernel().kvfleet_bf16_linear_supported())
needs_bf16_product = pytest.mark.skipif(not _BF16_BUILD, reason="kvfleet's bf16 product needs a "
                                        "CPU with AVX512-BF16 (and a C++ compiler)")


def fp32_reference(linear: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    out = x.float() @ linear.weight.float().T
    return out if linear.bias is None else out + linear.bias.float()


@needs_bf16_product
@pytest.mark.parametrize("out_features, in_features, bias", [
    (160, 96, False),    # whole blocks of 16 outputs, even columns
    (37, 11, True),      # a partial last block and an odd column count (the last pair half empty)
    (49, 576, True),
    (3072, 576, False),  # the default model's gate/up
    (576, 1537, True),
])
def test_bf16_product_follows_the_fp32_product(out_features, in_features, bias):
    """Every tile path (up to 4 rows against 4 blocks; 8 rows against 3; the rows and blocks left
    over) within one bf16 rounding step of the fp32 product, bias included."""
    torch.manual_seed(out_features + in_features)
    linear = torch.nn.Linear(in_features, out_features, bias=bias).to(torch.bfloat16)
    product = Bf16Linear(linear)
    for rows in (1, 3, 4, 5, 8, 9, 17, 70):
        x = torch.randn(rows, in_features, dtype=torch.bfloat16)
        expected = fp32_reference(linear, x)
        got = product(x)
        assert got.shape == (rows, out_features) and got.dtype == torch.bfloat16
        assert (got.float() - expected).abs().max().item() <= 2 ** -7 * expected.abs().max().item()
        # as close as F.linear's own bf16 product, within a rounding step of each output
        f_linear = F.linear(x, linear.weight, linear.bias).float()
        step = expected.abs() * 2 ** -8 + 1e-6
        assert ((got.float() - expected).abs() <= (f_linear - expected).abs() + step).all()


@needs_bf16_product
def test_bf16_product_of_a_row_does_not_depend_on_the_batch_or_the_threads():
    """Each output is summed in one order: a row's result is bit-identical alone, in any batch and
    with 1 or 2 threads (sampling with a seed stays independent of batch composition)."""
    torch.manual_seed(5)
    linear = torch.nn.Linear(576, 960, bias=True).to(torch.bfloat16)
    product = Bf16Linear(linear)
    x = torch.randn(23, 576, dtype=torch.bfloat16)
    batch = product(x)
    for i in range(x.shape[0]):
        assert torch.equal(product(x[i:i + 1]), batch[i:i + 1])
    assert torch.equal(product(x[7:12]), batch[7:12])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(product(x), batch)
    finally:
        torch.set_num_threads(threads)


@needs_bf16_product
def test_bf16_product_takes_strided_and_batched_input_and_still_copies():
    torch.manual_seed(6)
    linear = torch.nn.Linear(96, 160).to(torch.bfloat16)
    product = Bf16Linear(linear)
    wide = torch.randn(6, 200, dtype=torch.bfloat16)
    assert torch.equal(product(wide[:, :96]), product(wide[:, :96].contiguous()))
    x = torch.randn(2, 5, 96, dtype=torch.bfloat16)
    assert torch.equal(product(x), product(x.reshape(10, 96)).view(2, 5, 160))
    assert product(x[:, :0]).shape == (2, 0, 160)
    twin = copy.deepcopy(product)
    assert twin.packed_weight is product.packed_weight and torch.equal(twin(x), product(x))
    with pytest.raises(TypeError, match="bf16"):
        product(x.float())


@pytest.fixture
def products_env(monkeypatch):
    """Set KVFLEET_CPU_PRODUCTS for one test; the cached choice is made again before and after."""
    def choose(value: str | None):
        if value is None:
            monkeypatch.delenv(cpu_linear.PRODUCTS_ENV, raising=False)
        else:
            monkeypatch.setenv(cpu_linear.PRODUCTS_ENV, value)
        own_bf16_product.cache_clear()
        return own_bf16_product
    yield choose
    own_bf16_product.cache_clear()


def test_bf16_linears_take_kvfleets_product_on_avx512_bf16_cpus_without_amx(products_env):
    """auto: the own product where the kernel builds with AVX512-BF16 and the CPU has no AMX
    (oneDNN's AMX tiles win at prefill sizes); onednn turns it off; kvfleet forces it where it
    builds and is refused where it does not; anything else is refused by name."""
    expected = _BF16_BUILD and cpu_features().isa != "AMX"
    assert products_env(None)() is expected
    model = MODEL_FACTORIES["llama"]().to(torch.bfloat16)
    pack_cpu_linears(model, shared=True)
    assert (type(model.lm_head) is Bf16Linear) is expected
    assert ("kvfleet's bf16 product" in cpu_linear.products_report(torch.bfloat16)) is expected
    assert products_env("onednn")() is False
    if _BF16_BUILD:
        assert products_env("kvfleet")() is True
    else:
        with pytest.raises(ValueError, match="KVFLEET_CPU_PRODUCTS=kvfleet"):
            products_env("kvfleet")()
    with pytest.raises(ValueError, match="expected one of auto, onednn, kvfleet"):
        products_env("fastest")()
