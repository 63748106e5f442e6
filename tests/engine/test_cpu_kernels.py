"""The CPU linears: oneDNN-packed linears compute what F.linear computes (float32 everywhere, bf16
where the CPU has native bf16), so does kvfleet's own product (float32 on AVX-512 CPUs, bf16 with
AVX512-BF16), a tied LM head is packed only when asked, and sibling linears (q/k/v, gate/up) fused into one product give
each caller what its own linear gives, in any call order."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from kvfleet.shared.cpu_features import CpuFeatures, cpu_features
from tests.engine.tiny_models import MODEL_FACTORIES
from kvfleet.worker.engine.kernels import cpu_kernels, cpu_linear
from kvfleet.worker.engine.model import cpu_layers
from kvfleet.worker.engine.kernels.cpu_linear import (
    KernelLinear, PackedLinear, SiblingLinear, fuse_sibling_linears, own_product,
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
    assert type(both.lm_head) in (PackedLinear, KernelLinear)
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
    assert all(type(m) not in (PackedLinear, KernelLinear) for m in model.modules())


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


# ---- kvfleet's product (cpu_matmul.cpp) ------------------------------------------------------------

_SUPPORT = {dtype: 0 if cpu_kernels.unavailable_reason("matmul") is not None
            else int(cpu_kernels.kernel("matmul").kvfleet_linear_supported(code))
            for dtype, code in ((torch.float32, 0), (torch.bfloat16, 1))}
_BUILDS = {dtype: support != 0 for dtype, support in _SUPPORT.items()}  # either form
_FAST = {dtype: support == cpu_linear.FAST for dtype, support in _SUPPORT.items()}  # AVX-512's
OWN_DTYPES = [pytest.param(dtype, marks=pytest.mark.skipif(
    not _BUILDS[dtype], reason="kvfleet's product needs a C++ compiler"))
    for dtype in (torch.float32, torch.bfloat16)]
# relative to the output's scale: a bf16 rounding step; float32 sums taken in another order
OWN_TOLERANCE = {torch.bfloat16: 2 ** -7, torch.float32: 1e-5}


def float64_reference(linear: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    out = x.double() @ linear.weight.double().T
    return out if linear.bias is None else out + linear.bias.double()


@pytest.mark.parametrize("dtype", OWN_DTYPES)
@pytest.mark.parametrize("out_features, in_features, bias", [
    (160, 96, False),    # whole blocks of 16 outputs, even columns
    (37, 11, True),      # a partial last block and an odd column count (bf16: the last pair half empty)
    (49, 576, True),
    (3072, 576, False),  # the default model's gate/up
    (576, 1537, True),
])
def test_own_product_follows_the_exact_product(out_features, in_features, bias, dtype):
    """Every tile path (up to 4 rows against 4 blocks; 8 rows against 3; the rows and blocks left
    over) within one rounding step of the exact product, bias included, and as close to it as
    F.linear."""
    torch.manual_seed(out_features + in_features)
    linear = torch.nn.Linear(in_features, out_features, bias=bias).to(dtype)
    product = KernelLinear(linear)
    for rows in (1, 3, 4, 5, 8, 9, 17, 70):
        x = torch.randn(rows, in_features, dtype=dtype)
        expected = float64_reference(linear, x)
        got = product(x)
        assert got.shape == (rows, out_features) and got.dtype == dtype
        scale = expected.abs().max().item()
        assert (got.double() - expected).abs().max().item() <= OWN_TOLERANCE[dtype] * scale
        f_linear = F.linear(x, linear.weight, linear.bias).double()
        step = expected.abs() * OWN_TOLERANCE[dtype] / 2 + 1e-6 * scale
        assert ((got.double() - expected).abs() <= (f_linear - expected).abs() + step).all()


def on_one_thread(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """module(x) computed with torch's threads set to 1 (then set back)."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        return module(x)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", OWN_DTYPES)
def test_own_product_of_a_row_does_not_depend_on_the_batch_or_the_threads(dtype):
    """Each output is summed in one order: a row's result is bit-identical alone, in any batch and
    with 1 or 2 threads (sampling with a seed stays independent of batch composition)."""
    torch.manual_seed(5)
    linear = torch.nn.Linear(576, 960, bias=True).to(dtype)
    product = KernelLinear(linear)
    x = torch.randn(23, 576, dtype=dtype)
    batch = product(x)
    for i in range(x.shape[0]):
        assert torch.equal(product(x[i:i + 1]), batch[i:i + 1])
    assert torch.equal(product(x[7:12]), batch[7:12])
    assert torch.equal(on_one_thread(product, x), batch)


# the forms kvfleet's AVX-512 product computes: float32, bf16 with vdpbf16ps, bf16 with FMAs
FUSING_FORMS = [pytest.param(dtype, form, marks=pytest.mark.skipif(
    not _FAST[dtype], reason="kvfleet's product with AVX-512 (bf16: AVX512-BF16)"))
    for dtype, form in ((torch.float32, None), (torch.bfloat16, "dot"), (torch.bfloat16, "fma"))]


@pytest.mark.parametrize("dtype, form", FUSING_FORMS)
def test_silu_in_the_products_epilogue_is_the_product_then_the_silu_pass(dtype, form):
    """A SiLU MLP's [gate; up] with silu(gate) * up in the AVX-512 product's epilogue: bit for
    bit the plain product followed by the layer ops' SiLU pass, through every tile (up to 4 rows
    against 4 blocks; 6 rows, or 8 with FMAs, against whole gate/up pairs; the rows and the pair
    left over), with a bias or none, an odd k; a row alone, in a batch, on 1 or 2 threads alike;
    without SiLU, the plain [gate | up] output; outputs not whole pairs of blocks refused."""
    torch.manual_seed(21)
    for inter, k, bias in ((96, 64, True), (1536, 576, False), (32, 33, True)):
        linear = torch.nn.Linear(k, 2 * inter, bias=bias).to(dtype)
        plain = KernelLinear(linear, form=form)
        fused = KernelLinear(linear, form=form, silu_pairs=True)
        assert fused.silu_pairs and cpu_linear.fuses_silu(dtype, form)
        x = (2 * torch.randn(40, k)).to(dtype)
        for rows in (1, 3, 4, 5, 6, 7, 13, 40):
            product = plain(x[:rows])
            assert torch.equal(fused(x[:rows]), cpu_layers.silu_mul(product)), (inter, rows)
        batch = fused(x)
        exact = float64_reference(linear, x)
        silu = F.silu(exact[:, :inter]) * exact[:, inter:]
        assert (batch.double() - silu).abs().max() <= 4 * OWN_TOLERANCE[dtype] * silu.abs().max()
        for i in (0, 17, 39):
            assert torch.equal(fused(x[i:i + 1]), batch[i:i + 1])
        assert torch.equal(on_one_thread(fused, x), batch)
        assert torch.equal(fused(x, silu=False), plain(x))
    with pytest.raises(ValueError, match="silu_pairs"):
        KernelLinear(torch.nn.Linear(64, 80).to(dtype), form=form, silu_pairs=True)


@pytest.mark.parametrize("dtype", OWN_DTYPES)
def test_own_product_takes_strided_and_batched_input_and_still_copies(dtype):
    torch.manual_seed(6)
    linear = torch.nn.Linear(96, 160).to(dtype)
    product = KernelLinear(linear)
    wide = torch.randn(6, 200, dtype=dtype)
    assert torch.equal(product(wide[:, :96]), product(wide[:, :96].contiguous()))
    x = torch.randn(2, 5, 96, dtype=dtype)
    assert torch.equal(product(x), product(x.reshape(10, 96)).view(2, 5, 160))
    assert product(x[:, :0]).shape == (2, 0, 160)
    twin = copy.deepcopy(product)
    assert twin.packed_weight is product.packed_weight and torch.equal(twin(x), product(x))
    other = torch.float64 if dtype == torch.float32 else torch.float32
    with pytest.raises(TypeError, match=str(dtype)):
        product(x.to(other))


@pytest.fixture
def products_env(monkeypatch):
    """Set KVFLEET_CPU_PRODUCTS for one test; the cached choices are made again before and after."""
    def choose(value: str | None):
        if value is None:
            monkeypatch.delenv(cpu_linear.PRODUCTS_ENV, raising=False)
        else:
            monkeypatch.setenv(cpu_linear.PRODUCTS_ENV, value)
        own_product.cache_clear()
        return own_product
    yield choose
    own_product.cache_clear()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linears_take_kvfleets_product_on_avx512_cpus_without_amx(products_env, dtype):
    """auto: the own product where the kernel builds it (float32: AVX-512; bf16: AVX512-BF16) and
    the CPU has no AMX (oneDNN's AMX tiles win at prefill sizes); onednn turns it off; kvfleet
    forces it where it builds and is refused where it does not; anything else is refused by
    name."""
    expected = _FAST[dtype] and cpu_features().isa != "AMX"
    assert products_env(None)(dtype) is expected
    # batch-invariant linears (--deterministic) take it wherever it builds, AMX or not, its
    # portable form where the CPU lacks the AVX-512 instructions
    assert own_product(dtype, True) is _BUILDS[dtype]
    model = MODEL_FACTORIES["llama"]().to(dtype)
    pack_cpu_linears(model, shared=True)
    assert (type(model.lm_head) is KernelLinear) is expected
    assert ("kvfleet's product" in cpu_linear.products_report(dtype)) is expected
    assert products_env("onednn")(dtype) is False
    assert type(cpu_linear.product(torch.nn.Linear(8, 8, dtype=dtype))) is not KernelLinear
    if _BUILDS[dtype]:
        assert products_env("kvfleet")(dtype) is True
    else:
        with pytest.raises(ValueError, match="KVFLEET_CPU_PRODUCTS=kvfleet"):
            products_env("kvfleet")(dtype)
    assert products_env("kvfleet")(torch.float16) is False  # no such product: F.linear stays
    with pytest.raises(ValueError, match="expected one of auto, onednn, kvfleet"):
        products_env("fastest")(dtype)


@pytest.fixture
def bf16_form_env(monkeypatch):
    """Set KVFLEET_CPU_BF16_PRODUCT for one test; the cached form is chosen again around it."""
    def choose(value: str):
        monkeypatch.setenv("KVFLEET_CPU_BF16_PRODUCT", value)
        cpu_linear.bf16_form.cache_clear()
        return cpu_linear.bf16_form
    yield choose
    monkeypatch.delenv("KVFLEET_CPU_BF16_PRODUCT", raising=False)
    cpu_linear.bf16_form.cache_clear()


@pytest.mark.skipif(not _FAST[torch.bfloat16], reason="kvfleet's bf16 product needs AVX512-BF16")
def test_the_bf16_product_form_is_ruled_or_named(bf16_form_env):
    """auto takes the CPU's rule (never a timing); dot and fma (and amx where the CPU has AMX
    tiles) are taken as named, the linear computing in that form (answers within a bf16
    rounding of each other); another value is refused by the variable's name. The report is the batch-invariant engine's (the default),
    which takes kvfleet's product on every CPU with AVX512-BF16, AMX CPUs included."""
    assert bf16_form_env("auto")() == cpu_linear.bf16_form_rule(cpu_features())
    torch.manual_seed(11)
    linear = torch.nn.Linear(256, 96).to(torch.bfloat16)
    x = torch.randn(9, 256, dtype=torch.bfloat16)
    outputs = {}
    for form, code in cpu_linear.BF16_FORM_CODES.items():
        if form == "amx" and cpu_linear.amx_tiles() is not None:
            continue  # refused where there are no tiles (test_cpu_amx.py)
        assert bf16_form_env(form)() == form
        product = KernelLinear(linear)
        assert product._code == code
        outputs[form] = product(x).double()
        assert ({"dot": "vdpbf16ps", "fma": "fp32 FMAs", "amx": "AMX tiles"}[form]
                in cpu_linear.products_report(torch.bfloat16, invariant=True))
    scale = outputs["dot"].abs().max().item()
    for form in outputs:
        assert (outputs["dot"] - outputs[form]).abs().max().item() <= 2 ** -7 * scale
    with pytest.raises(ValueError, match="KVFLEET_CPU_BF16_PRODUCT='wide'"):
        bf16_form_env("wide")()


def test_the_bf16_form_rule_follows_the_cpu_vendor_alone():
    """Without AMX-BF16 tiles (test_cpu_amx.py has the rule with them): fp32 FMAs on Intel
    (vdpbf16ps at half the FMA rate), vdpbf16ps elsewhere; the model name and the load play no
    part, so every process of one machine kind sums alike."""
    flags = frozenset({"avx512f", "avx512_bf16"})
    intel = CpuFeatures("Intel(R) Xeon(R) Platinum 8581C", flags | {"amx_tile"}, "GenuineIntel")
    assert cpu_linear.bf16_form_rule(intel) == "fma"
    assert cpu_linear.bf16_form_rule(CpuFeatures("another Xeon", flags, "GenuineIntel")) == "fma"
    assert cpu_linear.bf16_form_rule(CpuFeatures("AMD EPYC 9R14", flags, "AuthenticAMD")) == "dot"
    assert cpu_linear.bf16_form_rule(CpuFeatures("unknown", flags)) == "dot"

