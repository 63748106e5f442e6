"""kvfleet's bf16 product on AMX tiles (worker/engine/kernels/cpu_amx.cpp), on any x86 CPU through its
emulation build: the tile instructions replaced by their scalar model (KVFLEET_AMX_EMULATE), the
kernel's layout, loops over tiles and sum order checked against a numpy model of the same
instructions (tests/engine/amx_model.py). On a CPU with AMX-BF16 the real tiles are compared
with the emulation bit for bit (the one test skipped elsewhere, for want of the CPU feature).

Two models of TDPBF16PS: the SDM's (even and odd columns summed apart per 32-column tile), which
the emulation takes, and the intrinsics guide's (every column added in order), built as a second
emulation (KVFLEET_AMX_EMULATE_SEQUENTIAL): the latter's sums are cpu_matmul.cpp's `fma` form's,
bit for bit, where no denormal occurs, the former's are not.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvfleet.shared.cpu_features import CpuFeatures, cpu_features
from tests.engine import amx_model
from tests.engine.kernel_variants import build_variant
from kvfleet.worker.engine.kernels import cpu_kernels, cpu_linear
from kvfleet.worker.engine.model import cpu_layers, numerics
from kvfleet.worker.engine.kernels.cpu_linear import BF16_FORM_CODES, KernelLinear
from kvfleet.worker.engine.kernels.kernel_binding import BoundKernel

AMX = BF16_FORM_CODES["amx"]
HAS_AMX = cpu_linear.AMX_FLAGS <= cpu_features().flags
SHAPES = [(83, 301), (37, 11), (160, 96), (16, 32)]  # partial blocks, k tails, whole tiles


def build_emulation(directory, sequential: bool) -> BoundKernel:
    """cpu_amx.cpp built with its scalar model of the tile instructions (the SDM's, or with
    `sequential` the intrinsics guide's)."""
    return build_variant("amx", directory, ("KVFLEET_AMX_EMULATE",)
                         + (("KVFLEET_AMX_EMULATE_SEQUENTIAL",) if sequential else ()))


@pytest.fixture(scope="module")
def emulated(tmp_path_factory) -> BoundKernel:
    return build_emulation(tmp_path_factory.mktemp("amx"), sequential=False)


@pytest.fixture(scope="module")
def sequential(tmp_path_factory) -> BoundKernel:
    return build_emulation(tmp_path_factory.mktemp("amx_sequential"), sequential=True)


def operands(n: int, k: int, m: int, seed: int, bias: bool = True, spikes: bool = True):
    """Random bf16 weight [n, k] and x [m, k], bias n floats. With `spikes`, pairs of columns
    whose products cancel exactly (x equal in both, weights +-H, H ~ 2^24): sums pass through
    values whose fp32 steps are ~4, so a bf16 output (~17, steps of 2^-3) shows which order the
    fp32 sums were taken in; without them bf16's rounding hides most order changes."""
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(n, k, generator=generator).to(torch.bfloat16)
    x = torch.randn(m, k, generator=generator).to(torch.bfloat16)
    if spikes:  # across tiles, within one tile's even columns, even to odd
        for first, second in {(1, k - 1), (2, k // 2), (4, 6)}:
            if first < second < k:
                x[:, second] = x[:, first]
                huge = (torch.randn(n, generator=generator) * 2.0 ** 24).to(torch.bfloat16)
                weight[:, first], weight[:, second] = huge, -huge
    return weight, x, (torch.randn(n, generator=generator) if bias else None)


def packed(kernel, weight: torch.Tensor) -> torch.Tensor:
    n, k = weight.shape
    out = torch.empty(amx_model.packed_size(n, k), dtype=torch.bfloat16)
    assert kernel.kvfleet_amx_pack(AMX, weight.data_ptr(), n, k, out.data_ptr(), 2) == 0
    return out


def run(kernel, weight: torch.Tensor, tiles: torch.Tensor, x: torch.Tensor,
        bias: torch.Tensor | None, threads: int = 2, code: int = AMX) -> torch.Tensor:
    n, k = weight.shape
    y = torch.empty(x.shape[0], n, dtype=torch.bfloat16)
    status = kernel(code, x.data_ptr(), x.shape[0], k, x.stride(0), tiles.data_ptr(), n,
                    None if bias is None else bias.data_ptr(), y.data_ptr(), n, threads)
    assert status == 0
    return y


def emulated_product(kernel: BoundKernel, weight, x, bias, threads: int = 2) -> torch.Tensor:
    return run(kernel.kvfleet_amx_linear, weight, packed(kernel, weight), x, bias, threads)


def modelled(weight, x, bias, sequential: bool = False) -> np.ndarray:
    return amx_model.product(amx_model.bits(x), amx_model.bits(weight),
                             None if bias is None else bias.numpy(), sequential)


# ---- the emulation: layout, sums, invariance --------------------------------------------------

@pytest.mark.parametrize("n, k", SHAPES)
def test_the_weights_pack_into_b_tiles(emulated, n, k):
    """The packed weight is the model's B tiles ([n/16][k/32 x 16 pairs][16][2], zero padded),
    in the emulation build and the engine's alike; with k a multiple of 32 it is cpu_matmul.cpp's
    bf16 layout."""
    weight, _, _ = operands(n, k, 1, seed=n + k)
    expected = amx_model.pack(amx_model.bits(weight))
    assert np.array_equal(amx_model.bits(packed(emulated, weight)), expected)
    assert np.array_equal(amx_model.bits(packed(cpu_kernels.amx_kernel(), weight)), expected)
    if k % 32 == 0:
        blocks = torch.empty(-(-n // 16) * 16 * k, dtype=torch.bfloat16)
        assert cpu_kernels.matmul_kernel().kvfleet_pack_linear(
            1, weight.data_ptr(), n, k, blocks.data_ptr(), 1) == 0
        assert np.array_equal(amx_model.bits(blocks), expected)
    untouched = torch.zeros(amx_model.packed_size(n, k), dtype=torch.bfloat16)
    assert emulated.kvfleet_amx_pack(1, weight.data_ptr(), n, k, untouched.data_ptr(), 1) == -1
    assert not untouched.any()  # dtype 1 is cpu_matmul.cpp's: refused, nothing written


@pytest.mark.parametrize("n, k", SHAPES)
def test_the_emulated_tiles_sum_as_the_sdm_model(emulated, n, k):
    """Every row count against the tiles (one A tile, two, a partial second; one B tile or two),
    bias or none: the model's sums bit for bit, and within a bf16 rounding of the exact product."""
    assert emulated.kvfleet_amx_supported(AMX) == 2 and emulated.kvfleet_amx_supported(1) == 0
    for m, bias in ((1, True), (5, False), (16, True), (17, True), (32, False), (40, True)):
        weight, x, b = operands(n, k, m, seed=m * 7 + k, bias=bias)
        got = emulated_product(emulated, weight, x, b)
        assert np.array_equal(amx_model.bits(got), modelled(weight, x, b)), (m, bias)
        weight, x, b = operands(n, k, m, seed=m * 7 + k, bias=bias, spikes=False)
        got = emulated_product(emulated, weight, x, b)
        exact = x.double() @ weight.double().T + (0 if b is None else b.double())
        assert (got.double() - exact).abs().max().item() <= 2 ** -7 * exact.abs().max().item()


def test_a_rows_sums_do_not_depend_on_the_batch_or_the_threads(emulated):
    """Row i's output is the same alone, in the first m rows for every m up to 40 (its place in
    the A tiles changes), in a slice that starts elsewhere, and with 1 or 2 threads."""
    weight, x, bias = operands(83, 301, 40, seed=3)
    batch = emulated_product(emulated, weight, x, bias, threads=2)
    tiles = packed(emulated, weight)
    kernel = emulated.kvfleet_amx_linear
    for m in range(1, 41):
        for threads in (1, 2):
            assert torch.equal(run(kernel, weight, tiles, x[:m], bias, threads), batch[:m]), m
    for i in (0, 15, 16, 39):
        assert torch.equal(run(kernel, weight, tiles, x[i:i + 1], bias, 1), batch[i:i + 1])
    assert torch.equal(run(kernel, weight, tiles, x[7:30], bias), batch[7:30])
    wide = torch.zeros(40, 320, dtype=torch.bfloat16)
    wide[:, :301] = x  # rows 320 apart: the stride is the caller's
    assert torch.equal(run(kernel, weight, tiles, wide[:, :301], bias), batch)
    # more rows than one task takes (1,024): each row as in the batch of 40, whichever task it is in
    many = x.repeat(26, 1)  # 1,040 rows
    for threads in (1, 2):
        out = run(kernel, weight, tiles, many, bias, threads)
        assert torch.equal(out, batch.repeat(26, 1)), threads


# ---- the two models of TDPBF16PS against cpu_matmul.cpp's `fma` form ----------------------------

def fma_form(weight, x, bias) -> torch.Tensor:
    matmul = cpu_kernels.matmul_kernel()
    fma = BF16_FORM_CODES["fma"]
    assert matmul.kvfleet_linear_supported(fma) in (cpu_linear.FAST, cpu_linear.PORTABLE)
    n, k = weight.shape
    blocks = torch.empty(-(-n // 16) * 16 * (k + k % 2), dtype=torch.bfloat16)
    assert matmul.kvfleet_pack_linear(fma, weight.data_ptr(), n, k, blocks.data_ptr(), 1) == 0
    return run(matmul.kvfleet_linear, weight, blocks, x, bias, code=fma)


def test_the_sequential_model_is_the_fma_form_bit_for_bit(sequential):
    """The intrinsics guide's TDPBF16PS adds each column's exact product in k order with one
    rounding, as the `fma` form's FMAs do: the same outputs bit for bit (no denormals occur)."""
    for n, k in SHAPES:
        for m in (1, 9, 33):
            weight, x, bias = operands(n, k, m, seed=n * m + k)
            got = emulated_product(sequential, weight, x, bias)
            assert np.array_equal(amx_model.bits(got), modelled(weight, x, bias, sequential=True))
            assert torch.equal(got, fma_form(weight, x, bias)), (n, k, m)


def test_the_sdm_model_is_not_the_fma_form(emulated, sequential):
    """The SDM's TDPBF16PS sums even and odd columns apart within each 32-column tile: another
    order than the `fma` form's. Columns 2^24, 1, -2^24, 1 (x all ones): in order, 2^24 + 1
    rounds back to 2^24 (a tie, to even) and the sum is 1; the SDM's even sum is 0, its odd sum
    2, and so its output. On random operands the forms agree within a bf16 rounding, and
    differ where the spikes make the order show (the numerics fingerprint tells them apart)."""
    weight = torch.tensor([[2.0 ** 24, 1.0, -2.0 ** 24, 1.0]] * 16, dtype=torch.bfloat16)
    x = torch.ones(1, 4, dtype=torch.bfloat16)
    assert (fma_form(weight, x, None) == 1).all()
    assert (emulated_product(sequential, weight, x, None) == 1).all()
    tiles = emulated_product(emulated, weight, x, None)
    assert (tiles == 2).all() and np.array_equal(amx_model.bits(tiles), modelled(weight, x, None))
    weight, x, bias = operands(83, 301, 24, seed=12, spikes=False)
    tiles, fma = emulated_product(emulated, weight, x, bias), fma_form(weight, x, bias)
    scale = fma.double().abs().max().item()
    assert (tiles.double() - fma.double()).abs().max().item() <= 2 ** -7 * scale
    weight, x, bias = operands(83, 301, 24, seed=12)  # the spikes show the orders differ
    assert not torch.equal(emulated_product(emulated, weight, x, bias), fma_form(weight, x, bias))


def test_a_denormal_input_is_where_the_tiles_and_the_fma_form_part(emulated, sequential):
    """Negative control: TDPBF16PS takes a denormal input as zero (DAZ), the fp32 FMAs do not. A
    column of x holding the bf16 denormal 2^-127, against weights of 2^10: the `fma` form's
    outputs are 2^-117, the tiles' (both models, as the numpy model says) zero."""
    weight, x, _ = operands(40, 64, 3, seed=21)
    x.zero_()
    x[:, 5] = torch.tensor([0x0040], dtype=torch.int16).view(torch.bfloat16)  # 64 x 2^-133
    weight[:, 5] = 2.0 ** 10
    assert x[0, 5].item() == 2.0 ** -127
    assert (fma_form(weight, x, None).float() == 2.0 ** -117).all()
    for kernel, model in ((emulated, False), (sequential, True)):
        got = emulated_product(kernel, weight, x, None)
        assert (got == 0).all()
        assert np.array_equal(amx_model.bits(got), modelled(weight, x, None, sequential=model))


# ---- the engine's kernel and the form's selection -----------------------------------------------

def test_the_engines_kernel_computes_only_on_amx_tiles():
    """The engine's build says 1 (tiles granted by Linux) on a CPU with AMX-BF16, else 0, and
    then refuses to compute rather than issue a tile instruction."""
    amx = cpu_kernels.amx_kernel()
    assert cpu_kernels.unavailable_reason("amx") is None
    assert amx.kvfleet_amx_supported(AMX) == (1 if HAS_AMX else 0)
    assert (cpu_linear.amx_tiles() is None) is HAS_AMX
    if not HAS_AMX:
        weight, x, bias = operands(16, 32, 2, seed=1)
        y = torch.empty(2, 16, dtype=torch.bfloat16)
        assert amx.kvfleet_amx_linear(AMX, x.data_ptr(), 2, 32, 32, packed(amx, weight).data_ptr(),
                                      16, bias.data_ptr(), y.data_ptr(), 16, 1) == -1


def test_the_bf16_form_rule_takes_the_tiles_where_the_cpu_has_them():
    """`amx` by the CPU's flags (AMX-TILE and AMX-BF16) where the kernel has the tiles; without
    them, or where the kernel has none, the rule for a CPU without AMX."""
    flags = frozenset({"avx512f", "avx512_bf16"})
    xeon = CpuFeatures("Intel(R) Xeon(R) Platinum 8581C", flags | cpu_linear.AMX_FLAGS,
                       "GenuineIntel")
    assert cpu_linear.bf16_form_rule(xeon) == "amx"
    assert cpu_linear.bf16_form_rule(xeon, tiles=False) == "fma"
    tile_only = CpuFeatures("Xeon", flags | {"amx_tile", "amx_int8"}, "GenuineIntel")
    assert cpu_linear.bf16_form_rule(tile_only) == "fma"


def test_amx_is_chosen_only_where_the_tiles_are(monkeypatch):
    """auto picks `amx` exactly where the kernel has tiles; KVFLEET_CPU_BF16_PRODUCT=amx is
    refused by name where it has none; the report names the tile kernel."""
    for value in ("auto", "amx"):
        monkeypatch.setenv("KVFLEET_CPU_BF16_PRODUCT", value)
        cpu_linear.bf16_form.cache_clear()
        try:
            if value == "auto" or HAS_AMX:
                assert (cpu_linear.bf16_form() == "amx") is HAS_AMX
            else:
                with pytest.raises(ValueError, match="KVFLEET_CPU_BF16_PRODUCT=amx"):
                    cpu_linear.bf16_form()
        finally:
            cpu_linear.bf16_form.cache_clear()
    monkeypatch.setattr(cpu_linear, "bf16_form", lambda: "amx")
    monkeypatch.setattr(cpu_linear, "own_product", lambda dtype, invariant=False: True)
    assert cpu_linear.products_report(torch.bfloat16, invariant=True) == (
        "in kvfleet's product (cpu_amx.cpp, AMX tiles: tdpbf16ps)")


def test_an_amx_linear_packs_whole_tiles_and_the_fingerprint_names_it():
    """KernelLinear in the `amx` form packs k up to whole tiles and is named `amx` in the
    numerics fingerprint's linears; without tiles its call fails (status -1), never computes."""
    linear = torch.nn.Linear(301, 83).to(torch.bfloat16)
    product = KernelLinear(linear, form="amx")
    assert product.packed_weight.numel() == amx_model.packed_size(83, 301)
    assert numerics.linear_kinds(torch.nn.Sequential(product)) == [f"kvfleet product {AMX} (amx)"]
    x = torch.randn(3, 301).to(torch.bfloat16)
    if not HAS_AMX:
        with pytest.raises(RuntimeError, match="kvfleet_amx_linear failed with status -1"):
            product(x)


# ---- grouped products (a mixture-of-experts layer's experts in one call) ---------------------

def grouped(kernel: BoundKernel, weights: list, x: torch.Tensor, counts: list[int],
            threads: int = 2) -> torch.Tensor:
    """kvfleet_amx_linear_groups: rows of x taken `counts[g]` at a time against weights[g]."""
    n, k = weights[0].shape
    tiles = [packed(kernel, w) for w in weights]
    at = torch.tensor([t.data_ptr() for t in tiles], dtype=torch.int64)
    offsets = torch.tensor([0, *np.cumsum(counts)], dtype=torch.int64)
    y = torch.full((x.shape[0], n), 7.0, dtype=torch.bfloat16)
    assert kernel.kvfleet_amx_linear_groups(AMX, x.data_ptr(), k, x.stride(0), offsets.data_ptr(),
                                            at.data_ptr(), len(weights), n, y.data_ptr(), n,
                                            threads) == 0
    return y


@pytest.mark.parametrize("n, k", [(83, 301), (96, 64)])
def test_grouped_products_are_each_groups_own_product(emulated, n, k):
    """Each group's rows get the bits kvfleet_amx_linear gives them alone against its weight,
    whatever the other groups hold: groups of none, one and more than a task's 1,024 rows, 1 and
    2 threads. Control: the same rows against the weights in another order differ."""
    weights = [operands(n, k, 1, seed=11 + g, bias=False)[0] for g in range(4)]
    counts = [3, 0, 1, 1030]
    _, x, _ = operands(n, k, sum(counts), seed=17, bias=False)
    expected, first = [], 0
    for weight, count in zip(weights, counts):
        if count:
            expected.append(emulated_product(emulated, weight, x[first:first + count], None))
        first += count
    expected = torch.cat(expected)
    for threads in (1, 2):
        assert torch.equal(grouped(emulated, weights, x, counts, threads), expected), threads
    assert not torch.equal(grouped(emulated, weights[::-1], x, counts), expected)


# ---- on AMX: the real tiles against the emulation ------------------------------------------------

@pytest.mark.skipif(not HAS_AMX, reason="needs a CPU with AMX-BF16 tiles (amx_tile, amx_bf16)")
def test_the_real_tiles_compute_what_the_emulation_does(emulated, sequential):
    """Bit for bit, every shape and row count, 1 or 2 threads, through KernelLinear too; where
    they differ, the message says whether the hardware follows the intrinsics guide's model."""
    amx = cpu_kernels.amx_kernel()
    for n, k in SHAPES:
        weight, x, bias = operands(n, k, 40, seed=n + 5 * k)
        bias = bias.to(torch.bfloat16).float()  # as a bf16 linear's bias reaches the kernel
        tiles = packed(amx, weight)
        expected = emulated_product(emulated, weight, x, bias)
        for m in range(1, 41):
            for threads in (1, 2):
                got = run(amx.kvfleet_amx_linear, weight, tiles, x[:m], bias, threads)
                follows = torch.equal(got, emulated_product(sequential, weight, x[:m], bias))
                assert torch.equal(got, expected[:m]), (
                    f"n={n} k={k} m={m}: the tiles differ from the SDM's model"
                    f"{' and equal the intrinsics guide' if follows else ' and from both models'}")
        linear = torch.nn.Linear(k, n).to(torch.bfloat16)
        with torch.no_grad():
            linear.weight.copy_(weight)
            linear.bias.copy_(bias)
        assert torch.equal(KernelLinear(linear, form="amx")(x), expected)
    # the grouped call (the experts of an MoE layer) on the real tiles, as emulated
    weights = [operands(83, 301, 1, seed=31 + g, bias=False)[0] for g in range(3)]
    _, x, _ = operands(83, 301, 40, seed=37, bias=False)
    for counts in ([1, 0, 39], [20, 19, 1]):
        assert torch.equal(grouped(amx, weights, x, counts), grouped(emulated, weights, x, counts))


# ---- the gate/up product with SiLU in its epilogue ---------------------------------------------

def silu_after(kernel: BoundKernel, weight, x, bias, threads: int = 2) -> torch.Tensor:
    """The unfused reference: the plain tile product of [gate; up], then the layer ops' pass."""
    gate_up = emulated_product(kernel, weight, x, bias, threads)
    return cpu_layers.silu_mul(gate_up)


def silu_fused(kernel: BoundKernel, weight, x, bias, threads: int = 2,
               alternate: bool = True) -> torch.Tensor:
    """kvfleet_amx_linear_silu over [gate; up] packed with the halves' blocks alternating (or,
    with `alternate` false, as they are: a wrong packing)."""
    n, k = weight.shape
    order = cpu_linear._alternate_halves if alternate else (lambda t: t)
    b = None if bias is None else order(bias).contiguous()
    y = torch.empty(x.shape[0], n // 2, dtype=torch.bfloat16)
    tiles = packed(kernel, order(weight))  # held: the kernel reads it
    status = kernel.kvfleet_amx_linear_silu(
        AMX, x.data_ptr(), x.shape[0], k, x.stride(0), tiles.data_ptr(), n,
        None if b is None else b.data_ptr(), y.data_ptr(), n // 2, threads)
    assert status == 0
    return y


@pytest.mark.parametrize("inter, k", [(48, 301), (96, 576), (16, 32)])
def test_the_silu_epilogue_gives_the_bits_of_the_product_then_silu_mul(emulated, inter, k):
    """silu(gate) * up computed in the product's epilogue is bit for bit the plain product
    followed by kvfleet_silu_mul, for every row count through the A tiles, bias or none, 1 or 2
    threads (an odd number of gate/up pairs splits unevenly across the threads' chunks)."""
    for m, bias, threads in ((1, False, 1), (17, True, 2), (40, False, 2), (83, True, 1)):
        weight, x, b = operands(2 * inter, k, m, seed=inter + m, bias=bias, spikes=False)
        weight = weight * 4  # gate values of several units: SiLU far from linear
        expected = silu_after(emulated, weight, x, b, threads)
        assert torch.equal(silu_fused(emulated, weight, x, b, threads), expected), (m, bias)


def test_the_silu_epilogue_needs_its_pairs(emulated):
    """Control: the same weight packed without alternating the halves' blocks pairs gate block
    0 with gate block 1 and gives other values; outputs that are no whole pairs of blocks are
    refused (status 1) with nothing written."""
    weight, x, _ = operands(2 * 48, 64, 20, seed=5, bias=False, spikes=False)
    expected = silu_after(emulated, weight, x, None)
    assert not torch.equal(silu_fused(emulated, weight, x, None, alternate=False), expected)
    y = torch.zeros(20, 24, dtype=torch.bfloat16)
    tiles = packed(emulated, weight[:48])
    assert emulated.kvfleet_amx_linear_silu(AMX, x.data_ptr(), 20, 64, 64, tiles.data_ptr(), 48,
                                            None, y.data_ptr(), 24, 2) == 1
    assert not y.any()


def test_the_fused_layer_takes_the_silu_epilogue_where_the_product_fuses_it(monkeypatch):
    """A KernelLinear with silu_pairs is built in the `amx` form, or in a form kvfleet's AVX-512
    product computes here (`fuses_silu`: not its portable product), over whole pairs of blocks;
    cpu_linear.product gives it for a gate/up stack only there, else the plain product (and the
    layer applies SiLU itself)."""
    linear = torch.nn.Linear(64, 96).to(torch.bfloat16)
    if cpu_linear.fuses_silu(torch.bfloat16, "fma"):
        assert KernelLinear(linear, form="fma", silu_pairs=True).silu_pairs
    else:
        with pytest.raises(ValueError, match="silu_pairs"):
            KernelLinear(linear, form="fma", silu_pairs=True)
    with pytest.raises(ValueError, match="silu_pairs"):
        KernelLinear(torch.nn.Linear(64, 80).to(torch.bfloat16), form="amx", silu_pairs=True)
    fused = KernelLinear(linear, form="amx", silu_pairs=True)
    assert fused.silu_pairs and fused.out_features == 96
    built = cpu_linear.product(linear, invariant=True, silu_pairs=True)
    fuses = (cpu_linear.own_product(torch.bfloat16, True)
             and cpu_linear.fuses_silu(torch.bfloat16))
    assert getattr(built, "silu_pairs", False) == fuses


@pytest.mark.skipif(not HAS_AMX, reason="needs a CPU with AMX-BF16 tiles (amx_tile, amx_bf16)")
def test_the_real_tiles_fuse_silu_as_the_emulation_does(emulated):
    """On AMX: the epilogue on real tiles equals the emulation's, and a KernelLinear with
    silu_pairs equals the plain KernelLinear followed by silu_mul, bit for bit (and gives the
    plain product itself when asked without SiLU)."""
    amx = cpu_kernels.amx_kernel()
    inter, k = 96, 576
    weight, x, bias = operands(2 * inter, k, 83, seed=11, spikes=False)
    weight = weight * 4
    bias = bias.to(torch.bfloat16).float()
    for m in (1, 16, 33, 83):
        for threads in (1, 2):
            assert torch.equal(silu_fused(amx, weight, x[:m], bias, threads),
                               silu_fused(emulated, weight, x[:m], bias, threads)), (m, threads)
    linear = torch.nn.Linear(k, 2 * inter).to(torch.bfloat16)
    with torch.no_grad():
        linear.weight.copy_(weight)
        linear.bias.copy_(bias)
    product = KernelLinear(linear, form="amx")(x)
    fused = KernelLinear(linear, form="amx", silu_pairs=True)
    assert torch.equal(fused(x), cpu_layers.silu_mul(product))
    # without SiLU (for an adapter's forward hook): the plain [gate | up] output, in that order
    assert torch.equal(fused(x, silu=False), product)


def test_chunks_capped_by_their_weight_bytes_sum_as_any_other(emulated):
    """At k = 8192 a block's packed weight is 256 KiB, so a chunk holds at most 4 blocks (1 MiB)
    and 66 blocks split into more chunks than the threads' 8 each would give: every row's
    outputs are still the same on 1 or 2 threads and alone, within bf16's rounding of the exact
    product, and on AMX the real tiles give the emulation's bits."""
    weight, x, bias = operands(1056, 8192, 3, seed=17, spikes=False)
    one = emulated_product(emulated, weight, x, bias, threads=1)
    assert torch.equal(emulated_product(emulated, weight, x, bias, threads=2), one)
    assert torch.equal(emulated_product(emulated, weight, x[1:2], bias, threads=2), one[1:2])
    exact = x.double() @ weight.double().T + bias.double()
    assert (one.double() - exact).abs().max().item() <= 2 ** -7 * exact.abs().max().item()
    if HAS_AMX:
        amx = cpu_kernels.amx_kernel()
        for threads in (1, 2):
            assert torch.equal(run(amx.kvfleet_amx_linear, weight, packed(amx, weight), x, bias,
                                   threads), one)


# ---- the product added into its addend (the layer's residual) ------------------------------

def added(kernel: BoundKernel, weight, x, bias, addend: torch.Tensor, threads: int = 2):
    n, k = weight.shape
    y = addend.clone()
    tiles = packed(kernel, weight)  # held: the kernel reads it
    assert kernel.kvfleet_amx_linear_add(
        AMX, x.data_ptr(), x.shape[0], k, x.stride(0), tiles.data_ptr(), n,
        None if bias is None else bias.data_ptr(), y.data_ptr(), n, threads) == 0
    return y


@pytest.mark.parametrize("n, k", SHAPES)
def test_the_product_added_in_its_epilogue_is_the_bf16_add_after_it(emulated, n, k):
    """y += x W^T in the epilogue gives the bits of the plain product followed by torch's bf16
    `add_` (pairs of whole blocks and a partial last one, k tails, bias or none, 1 or 2
    threads); the addends matter (a control: added to zeros it is the plain product, and not the
    sum)."""
    for m, bias, threads in ((1, True, 1), (17, False, 2), (40, True, 2)):
        weight, x, b = operands(n, k, m, seed=3 * m + n, bias=bias, spikes=False)
        addend = (torch.randn(m, n, generator=torch.Generator().manual_seed(m)) * 8).to(
            torch.bfloat16)
        plain = emulated_product(emulated, weight, x, b, threads)
        fused = added(emulated, weight, x, b, addend, threads)
        assert torch.equal(fused, addend.clone().add_(plain)), (m, bias, threads)
        assert torch.equal(added(emulated, weight, x, b, torch.zeros_like(addend), threads), plain)
        assert not torch.equal(fused, plain)


def test_a_kernel_linear_adds_into_its_target_in_every_form():
    """KernelLinear(x, add_to=y) returns y += its product, in place: through the epilogue in the
    `amx` form (where this process computes on tiles), through add_ in the others (float32 on
    every CPU; the AVX-512 bf16 forms where they build)."""
    linear = torch.nn.Linear(96, 64)
    products = [KernelLinear(linear)]  # float32: the portable product where there is no AVX-512
    bf16 = torch.nn.Linear(96, 64).to(torch.bfloat16)
    products += [KernelLinear(bf16, form="amx")] if HAS_AMX else []
    products += [KernelLinear(bf16, form=f) for f in ("dot", "fma")
                 if cpu_kernels.matmul_kernel().kvfleet_linear_supported(BF16_FORM_CODES[f]) == 1]
    for product in products:
        assert product.adds_in_place == (product.form == "amx")
        x = torch.randn(5, 96).to(product.dtype)
        target = torch.randn(5, 64).to(product.dtype)
        expected = target.clone().add_(product(x))
        assert product(x, add_to=target) is target
        assert torch.equal(target, expected), product.form


@pytest.mark.skipif(not HAS_AMX, reason="needs a CPU with AMX-BF16 tiles (amx_tile, amx_bf16)")
def test_the_real_tiles_add_as_the_emulation_does(emulated):
    amx = cpu_kernels.amx_kernel()
    for n, k in SHAPES:
        weight, x, bias = operands(n, k, 40, seed=n + k, spikes=False)
        bias = bias.to(torch.bfloat16).float()
        addend = (torch.randn(40, n, generator=torch.Generator().manual_seed(n)) * 8).to(
            torch.bfloat16)
        for m in (1, 16, 33, 40):
            for threads in (1, 2):
                assert torch.equal(added(amx, weight, x[:m], bias, addend[:m], threads),
                                   added(emulated, weight, x[:m], bias, addend[:m], threads))
