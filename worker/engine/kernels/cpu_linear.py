"""Linear layers with their weights pre-packed, for CPU models (bf16 and float32).

`F.linear` on a bf16 CPU tensor reorders the weight into oneDNN's blocked layout on every call;
packing it once at start-up (what torch.compile's CPU freezing does) saves that, most at decode
sizes. The packed op computes the same products: bf16 outputs are bit-identical to `F.linear` in
our measurements. float32 `F.linear` goes to MKL's sgemm; oneDNN's packed float32 product beats it
at decode sizes (measured on an AVX2-only CPU; level at prefill sizes), with sums taken in another
order (relative differences of ~1e-7, greedy output still that of HF `generate` in the tests).
bf16 packs only on CPUs with native bf16. oneDNN's packing is a private torch API:
torch_private.py guards it, and where it is missing or disagrees linears stay on `F.linear`.

On CPUs with AVX-512 and no AMX, linears take kvfleet's own product instead (`KernelLinear`,
cpu_matmul.cpp; bf16 needs AVX512-BF16): one weight copy packed in 16-output blocks of columns
(bf16: column pairs), streamed once per product with FMA (vdpbf16ps). oneDNN reads its packed
weights at about half the memory bandwidth at decode sizes, which is what decode steps are bound
by (docs/BENCHMARKS.md has the measurements). On AMX CPUs oneDNN's tiles do bf16 prefill products
faster, so they keep oneDNN. `KVFLEET_CPU_PRODUCTS` overrides: `onednn` (oneDNN wherever it
packs) or `kvfleet` (the own product wherever it builds).

Batch-invariant products (`invariant`, the engine's `--deterministic`): kvfleet's product sums
every output in one order whatever the rows of the call; oneDNN's and MKL's pick kernels by the
call's shape, so a row's result can depend on how many rows came with it. Invariant engines take
kvfleet's product wherever it builds: on AMX CPUs too (bf16 on the tiles, cpu_amx.cpp, in its own
invariant order), and on CPUs without AVX-512 its portable form (cpu_matmul.cpp), unless
`KVFLEET_CPU_PRODUCTS=onednn` asks for oneDNN.
"""

from __future__ import annotations

import copy
import functools

import torch

from kvfleet.shared.cpu_features import CpuFeatures, cpu_features
from kvfleet.shared.settings import KernelSettings
from kvfleet.worker.engine.kernels import torch_private
from kvfleet.worker.engine.kernels.cpu_attention import DTYPE_CODES, KernelUnavailable
from kvfleet.worker.engine.kernels.cpu_kernels import amx_kernel, matmul_kernel

PACKED_DTYPES = (torch.bfloat16, torch.float32)
_BATCH_HINT = 64  # rows the packing is tuned for (its speed hardly depends on the hint)
PRODUCTS_ENV = "KVFLEET_CPU_PRODUCTS"
PRODUCTS_CHOICES = ("auto", "onednn", "kvfleet")


def packing_available(dtype: torch.dtype = torch.bfloat16) -> bool:
    """oneDNN packs `dtype` weights here: float32 on any CPU, bf16 only where the CPU computes
    bf16 natively (AVX512-BF16, AMX or AVX-NE-CONVERT); on an AVX2-only CPU its reorder refuses
    bf16. Nowhere where torch's private packing ops are missing or disagree (torch_private.py)."""
    return dtype in PACKED_DTYPES and torch_private.onednn_packing_available(dtype)


def products_choice() -> str:
    return KernelSettings().cpu_products


FAST, PORTABLE = 1, 2  # kvfleet_linear_supported: the AVX-512 product, the portable one


@functools.cache
def own_product(dtype: torch.dtype, invariant: bool = False) -> bool:
    """Linears of this dtype take kvfleet's product (KernelLinear) here: by default bf16 on CPUs
    whose kernel build has AVX512-BF16, float32 on AVX-512 CPUs, neither where the CPU has AMX;
    `invariant`: wherever it builds (its portable form where the CPU has no AVX-512).
    `KVFLEET_CPU_PRODUCTS` overrides."""
    choice = products_choice()
    if choice not in PRODUCTS_CHOICES:
        raise ValueError(f"{PRODUCTS_ENV}={choice!r}: expected one of {', '.join(PRODUCTS_CHOICES)}")
    if (dtype not in DTYPE_CODES or choice == "onednn"
            or (choice == "auto" and cpu_features().isa == "AMX" and not invariant)):
        return False
    try:
        matmul = matmul_kernel()
        supported = int(matmul.kvfleet_linear_supported(DTYPE_CODES[dtype]))
    except KernelUnavailable as exc:
        if choice == "kvfleet":
            raise ValueError(f"{PRODUCTS_ENV}=kvfleet, but the kernel is unavailable: {exc}") from exc
        return False
    if choice == "kvfleet" and not supported:
        raise ValueError(f"{PRODUCTS_ENV}=kvfleet, but this build has no {dtype} products")
    return supported == FAST or (supported == PORTABLE and (invariant or choice == "kvfleet"))


# the dtype argument of each bf16 form: kvfleet_linear's (cpu_matmul.cpp) for dot and fma,
# kvfleet_amx_linear's (cpu_amx.cpp) for amx
BF16_FORM_CODES = {"dot": 1, "fma": 2, "amx": 3}
AMX_FLAGS = frozenset({"amx_tile", "amx_bf16"})


@functools.cache
def amx_tiles() -> str | None:
    """None where kvfleet's bf16 product computes on AMX tiles here (cpu_amx.cpp: the CPU has
    them, the kernel built, Linux granted the tile state), else why not."""
    try:
        if int(amx_kernel().kvfleet_amx_supported(BF16_FORM_CODES["amx"])) == FAST:
            return None
        return "the CPU has no AMX-BF16 tiles, or Linux refused the process their state"
    except KernelUnavailable as exc:
        return str(exc)


@functools.cache
def bf16_form() -> str:
    """How kvfleet's bf16 product sums here: `dot` (vdpbf16ps), `fma` (fp32 FMAs over the widened
    weights) or `amx` (tdpbf16ps on AMX tiles): KVFLEET_CPU_BF16_PRODUCT, else `bf16_form_rule`
    for this CPU. Never timed: the forms round differently, and every process of one machine
    kind must choose alike (a start-up timing on a loaded host chose either), or a stream resumed
    on another worker would not continue bit for bit. Where the CPU has AMX but the kernel cannot
    use it (a compiler without the intrinsics, Linux refusing the tile state: the same on every
    process of the machine), the rule for a CPU without it. In a portable build the AVX-512 forms
    are one product (`dot`)."""
    choice = KernelSettings().cpu_bf16_product
    if choice == "amx" and amx_tiles() is not None:
        raise ValueError(f"KVFLEET_CPU_BF16_PRODUCT=amx, but there are no AMX tiles here: "
                         f"{amx_tiles()}")
    if choice != "auto":
        return choice
    rule = bf16_form_rule(cpu_features(), tiles=amx_tiles() is None)
    if rule != "amx" and matmul_kernel().kvfleet_linear_supported(BF16_FORM_CODES["fma"]) != FAST:
        return "dot"
    return rule


def bf16_form_rule(features: CpuFeatures, tiles: bool = True) -> str:
    """`amx` on CPUs with AMX-BF16 tiles (where `tiles`: the kernel can use them), which compute
    bf16 products several times the AVX-512 FMA rate per core; otherwise `fma` on Intel CPUs,
    whose vdpbf16ps issues at half the FMA rate (measured 0.57x dot's time at prefill sizes on a
    Xeon, family 6 model 207, without AMX; docs/BENCHMARKS.md); `dot` elsewhere (AMD's Zen 4 and
    5 issue it at the FMA rate, two products per lane)."""
    if tiles and AMX_FLAGS <= features.flags:
        return "amx"
    return "fma" if features.vendor == "GenuineIntel" else "dot"


def packs(dtype: torch.dtype, invariant: bool = False) -> bool:
    """A linear of this dtype computes faster here through a packed weight (ours or oneDNN's);
    `invariant`: or batch-invariantly through ours."""
    return own_product(dtype, invariant) or packing_available(dtype)


def product(linear: torch.nn.Linear, invariant: bool = False,
            silu_pairs: bool = False) -> torch.nn.Module:
    """The module that computes `linear` fastest here (batch-invariantly where `invariant`):
    KernelLinear where own_product, else PackedLinear where its dtype packs, else the linear
    itself (F.linear: MKL's own path for float32, no reorder). `silu_pairs`: `linear` is a SiLU
    MLP's gate and up projections stacked ([gate; up]); where its product is kvfleet's on AMX
    tiles or with AVX-512 (`fuses_silu`) and the outputs are whole pairs of 16-output blocks (a
    multiple of 32), the KernelLinear returned computes silu(gate) * up in the product's
    epilogue (its `silu_pairs` is then true); otherwise the plain product is returned, and the
    caller applies the activation."""
    if linear.weight.is_cpu and own_product(linear.weight.dtype, invariant):
        fused = (silu_pairs and fuses_silu(linear.weight.dtype)
                 and linear.out_features % 32 == 0)
        return KernelLinear(linear, silu_pairs=fused)
    return PackedLinear(linear) if packing_available(linear.weight.dtype) else linear


def fuses_silu(dtype: torch.dtype, form: str | None = None) -> bool:
    """kvfleet's product of this dtype (bf16: in `form`, default `bf16_form()`) computes a SiLU
    MLP's silu(gate) * up in its epilogue here: on AMX tiles (cpu_amx.cpp), or with AVX-512
    (cpu_matmul.cpp; not its portable product)."""
    if dtype == torch.bfloat16:
        form = form or bf16_form()
        if form == "amx":
            return True
        code = BF16_FORM_CODES[form]
    elif dtype == torch.float32:
        code = DTYPE_CODES[dtype]
    else:
        return False
    try:
        return matmul_kernel().kvfleet_linear_supported(code) == 1
    except KernelUnavailable:
        return False


def products_report(dtype: torch.dtype, invariant: bool = False) -> str:
    """What computes the linears of a CPU model in this dtype, for the start-up log."""
    if own_product(dtype, invariant):
        if dtype == torch.bfloat16 and bf16_form() == "amx":
            return "in kvfleet's product (cpu_amx.cpp, AMX tiles: tdpbf16ps)"
        portable = matmul_kernel().kvfleet_linear_supported(DTYPE_CODES[dtype]) == PORTABLE
        form = ("" if portable or dtype != torch.bfloat16 else
                {"dot": ", vdpbf16ps", "fma": ", bf16 weights summed with fp32 FMAs"}[bf16_form()])
        return f"in kvfleet's {'portable ' if portable else ''}product (cpu_matmul.cpp{form})"
    if packing_available(dtype):
        return "in oneDNN, weights packed"
    return "in F.linear"


class KernelLinear(torch.nn.Module):
    """nn.Linear's forward (bf16 or float32) through kvfleet's product (cpu_matmul.cpp), over its
    weight packed once in 16-output blocks of columns (bf16: column pairs; the `amx` form,
    cpu_amx.cpp: the same with the columns padded to whole 32-column tiles): fp32 sums, the bias
    added in fp32, one rounding to the output dtype; every output summed in one order whatever
    the thread count or the batch. `form`: the bf16 form (default `bf16_form()`).

    `silu_pairs` (where `fuses_silu`, an even number of 16-output blocks): `linear` is [gate; up]
    of a SiLU MLP and the module returns silu(gate) * up, [..., out_features / 2], computed in
    the product's epilogue (cpu_amx.cpp's kvfleet_amx_linear_silu, cpu_matmul.cpp's
    kvfleet_linear_silu): the same bits as the product followed by the layer ops' SiLU pass,
    without writing the gate/up output to memory and reading it back. Its weight is packed with
    the gate's and up's blocks of 16 outputs alternating, so each pair of blocks the product
    takes together is one gate/up pair."""

    def __init__(self, linear: torch.nn.Linear, form: str | None = None,
                 silu_pairs: bool = False):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.dtype = linear.weight.dtype
        self.form = (form or bf16_form()) if self.dtype == torch.bfloat16 else "float32"
        self.silu_pairs = silu_pairs
        if silu_pairs and (not fuses_silu(self.dtype, self.form if self.dtype == torch.bfloat16
                                          else None) or self.out_features % 32):
            raise ValueError("silu_pairs needs a product that fuses SiLU here (AMX tiles or "
                             "AVX-512) and outputs in whole pairs of blocks")
        weight = linear.weight.detach().contiguous()
        bias = None if linear.bias is None else linear.bias.detach()
        if silu_pairs:  # [gate; up] -> gate block 0, up block 0, gate block 1, ...
            weight = _alternate_halves(weight)
            bias = None if bias is None else _alternate_halves(bias)
        # what every call passes, looked up once (a decode step makes ~4 calls per layer)
        self._code = (BF16_FORM_CODES[self.form] if self.dtype == torch.bfloat16
                      else DTYPE_CODES[self.dtype])
        self._amx = self.form == "amx"
        per = 2 if self.dtype == torch.bfloat16 else 1  # columns per step of the product
        columns = 32 if self._amx else per  # the packed columns: whole steps (amx: k tiles)
        blocks, steps = -(-self.out_features // 16), -(-self.in_features // columns)
        # kept as a plain attribute, like PackedLinear's: nothing that casts or counts parameters
        # must take it for an [out, in] matrix
        self.packed_weight = torch.empty(blocks * steps * columns * 16, dtype=self.dtype)
        if self._amx:
            amx = amx_kernel()
            _check(amx.kvfleet_amx_pack(
                self._code, weight.data_ptr(), self.out_features, self.in_features,
                self.packed_weight.data_ptr(), torch.get_num_threads()), "kvfleet_amx_pack")
            self._kvfleet_amx_linear = amx.kvfleet_amx_linear
            self._kvfleet_amx_linear_silu = amx.kvfleet_amx_linear_silu
            self._kvfleet_amx_linear_add = amx.kvfleet_amx_linear_add
        else:
            matmul = matmul_kernel()
            _check(matmul.kvfleet_pack_linear(
                DTYPE_CODES[self.dtype], weight.data_ptr(), self.out_features, self.in_features,
                self.packed_weight.data_ptr(), torch.get_num_threads()), "kvfleet_pack_linear")
            self._kvfleet_linear = matmul.kvfleet_linear
            self._kvfleet_linear_silu = matmul.kvfleet_linear_silu
        self.bias = None if linear.bias is None else torch.nn.Parameter(linear.bias.detach(),
                                                                        requires_grad=False)
        self._bias32 = None if bias is None else bias.float().contiguous()
        self._weight_ptr = self.packed_weight.data_ptr()
        self._bias_ptr = None if self._bias32 is None else self._bias32.data_ptr()

    @property
    def code(self) -> int:
        """The product's code for this linear's dtype and bf16 form, which every call passes
        (and the numerics fingerprint names)."""
        return self._code

    def __deepcopy__(self, memo) -> KernelLinear:
        return _copy_sharing_packed_weight(self, memo)

    @property
    def adds_in_place(self) -> bool:
        """forward(x, add_to=y) adds the product into y in its epilogue (the `amx` form)."""
        return self._amx and not self.silu_pairs

    def forward(self, x: torch.Tensor, add_to: torch.Tensor | None = None,
                silu: bool = True) -> torch.Tensor:  # [..., in] -> [..., out]
        """The product; with `add_to` (same dtype, [..., out]), that tensor += the product, in
        place, and returned: in the `amx` form inside the product's epilogue (`adds_in_place`:
        the bf16 output added in fp32 and rounded, as `add_to.add_(product)` rounds it), else
        by that add_. With `silu_pairs`, silu(gate) * up, or with `silu` false the plain
        [..., gate | up] output (a copy put back in that order: for forward hooks, such as
        adapter terms, that add to the gate's and up's columns)."""
        if x.dtype != self.dtype or not x.is_cpu:
            raise TypeError(f"this linear takes {self.dtype} CPU input, got {x.dtype} on {x.device}")
        rows = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        if rows.stride(-1) != 1 or (rows.shape[0] > 1 and rows.stride(0) < self.in_features):
            rows = rows.contiguous()
        num_rows = rows.shape[0]
        if add_to is not None:
            target = add_to.view(num_rows, self.out_features)  # raises unless it is [..., out]
            if not self.adds_in_place or not target.is_contiguous() or target.dtype != self.dtype:
                return add_to.add_(self.forward(x).view(add_to.shape))
            _check(self._kvfleet_amx_linear_add(
                self._code, rows.data_ptr(), num_rows, self.in_features, rows.stride(0),
                self._weight_ptr, self.out_features, self._bias_ptr, target.data_ptr(),
                self.out_features, torch.get_num_threads()), "kvfleet_amx_linear_add")
            return add_to
        if self.silu_pairs and not silu:
            out = torch.empty((num_rows, self.out_features), dtype=self.dtype)
            if self._amx:
                status = self._kvfleet_amx_linear(
                    self._code, rows.data_ptr(), num_rows, self.in_features, rows.stride(0),
                    self._weight_ptr, self.out_features, self._bias_ptr, out.data_ptr(),
                    self.out_features, torch.get_num_threads())
            else:
                status = self._kvfleet_linear(
                    self._code, rows.data_ptr(), num_rows, self.in_features, rows.stride(0),
                    self._weight_ptr, self.out_features, self._bias_ptr, out.data_ptr(),
                    self.out_features, torch.get_num_threads())
            _check(status, "kvfleet_amx_linear" if self._amx else "kvfleet_linear")
            # blocks of 16 alternating (gate, up, gate, ...) -> gate's columns, then up's
            out = out.view(num_rows, -1, 2, 16).transpose(1, 2).reshape(num_rows, -1)
            return out if x.dim() == 2 else out.view(*x.shape[:-1], self.out_features)
        columns = self.out_features // 2 if self.silu_pairs else self.out_features
        out = torch.empty((num_rows, columns), dtype=self.dtype)
        if self.silu_pairs and self._amx:
            status = self._kvfleet_amx_linear_silu(
                self._code, rows.data_ptr(), num_rows, self.in_features, rows.stride(0),
                self._weight_ptr, self.out_features, self._bias_ptr, out.data_ptr(),
                columns, torch.get_num_threads())
        elif self.silu_pairs:
            status = self._kvfleet_linear_silu(
                self._code, rows.data_ptr(), num_rows, self.in_features, rows.stride(0),
                self._weight_ptr, self.out_features, self._bias_ptr, out.data_ptr(),
                columns, torch.get_num_threads())
        elif self._amx:
            status = self._kvfleet_amx_linear(
                self._code, rows.data_ptr(), num_rows, self.in_features, rows.stride(0),
                self._weight_ptr, self.out_features, self._bias_ptr, out.data_ptr(),
                columns, torch.get_num_threads())
        else:
            status = self._kvfleet_linear(
                self._code, rows.data_ptr(), num_rows, self.in_features, rows.stride(0),
                self._weight_ptr, self.out_features, self._bias_ptr, out.data_ptr(),
                self.out_features, torch.get_num_threads())
        _check(status, ("kvfleet_amx_linear_silu" if self.silu_pairs else "kvfleet_amx_linear")
               if self._amx else
               "kvfleet_linear_silu" if self.silu_pairs else "kvfleet_linear")
        return out if x.dim() == 2 else out.view(*x.shape[:-1], columns)


def _alternate_halves(t: torch.Tensor) -> torch.Tensor:
    """[2 * h, ...] (first half, second half) -> the halves' blocks of 16 rows alternating."""
    halves = t.reshape(2, t.shape[0] // 32, 16, *t.shape[1:])
    return halves.transpose(0, 1).reshape(t.shape).contiguous()


def _copy_sharing_packed_weight(module: torch.nn.Module, memo) -> torch.nn.Module:
    """A deep copy of a packed linear that shares its packed weight (never written after
    packing) and copies its parameters."""
    clone = copy.copy(module)
    clone._parameters = {name: copy.deepcopy(p, memo) for name, p in module._parameters.items()}
    clone._buffers, clone._modules = dict(module._buffers), {}
    return clone


def _check(status: int, name: str) -> None:
    if status != 0:
        raise RuntimeError(f"{name} failed with status {status}")


class PackedLinear(torch.nn.Module):
    """nn.Linear's forward over a oneDNN-packed copy of its weight (CPU, inference only)."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # The packed tensor has the opaque mkldnn layout: kept as a plain attribute, not a
        # parameter or buffer, so that nothing that walks parameters (casts, byte counts) sees it.
        self.packed_weight = torch_private.pack_linear_weight(linear.weight.detach(), _BATCH_HINT)
        self._linear_op = torch_private.linear_op()  # resolved once: called per forward
        self.bias = None if linear.bias is None else torch.nn.Parameter(linear.bias.detach(),
                                                                        requires_grad=False)

    def __deepcopy__(self, memo) -> PackedLinear:
        # an opaque mkldnn tensor has no storage that copy.deepcopy could clone
        return _copy_sharing_packed_weight(self, memo)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        return self._linear_op(x, self.packed_weight, self.bias, "none", [], "")


def pack_cpu_linears(model: torch.nn.Module, shared: bool = False,
                     invariant: bool = False) -> int:
    """Replace the model's CPU nn.Linear layers whose dtype packs by their `product` (Bf16Linear
    or PackedLinear); returns how many.

    A layer whose weight is shared with another module (a tied LM head and embedding) is packed
    only with `shared`: the packed copy is a second copy of that matrix (the embedding keeps
    reading the plain one).
    """
    counts: dict[int, int] = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            counts[param.data_ptr()] = counts.get(param.data_ptr(), 0) + 1
    targets = [(name, module) for name, module in model.named_modules()
               if type(module) is torch.nn.Linear and module.weight.is_cpu
               and packs(module.weight.dtype, invariant)
               and (shared or counts[module.weight.data_ptr()] == 1)]
    for name, module in targets:
        owner_name, _, attr = name.rpartition(".")
        owner = model.get_submodule(owner_name) if owner_name else model
        setattr(owner, attr, product(module, invariant))
    return len(targets)


# Linears of one block that read the same input: one matrix product instead of two or three.
SIBLING_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class SiblingProduct:
    """One packed product for linears that read the same input (a layer's q/k/v, gate/up).

    The model still calls each linear on its own (transformers' attention and MLP code is left as
    it is): the first call of a round computes every sibling's output in one matmul over the
    concatenated weights and keeps the others; each sibling's call takes its share once. A call
    with another input tensor (or a share taken twice) starts a new round, so a model that calls
    the siblings in any order, or skips one, still gets what its own linear would compute.
    Fewer, larger matmuls per layer (7 -> 4) matter at decode sizes, where each product's fixed
    cost is a large share of its time.
    """

    def __init__(self, linears: list[torch.nn.Linear], invariant: bool = False):
        fused = torch.nn.Linear(linears[0].in_features, sum(m.out_features for m in linears),
                                bias=linears[0].bias is not None)
        with torch.no_grad():
            fused.weight = torch.nn.Parameter(torch.cat([m.weight for m in linears]), False)
            if fused.bias is not None:
                fused.bias = torch.nn.Parameter(torch.cat([m.bias for m in linears]), False)
        self.product = product(fused, invariant)
        self.sizes = [m.out_features for m in linears]
        self._input: torch.Tensor | None = None  # this round's input (held, so its id is unique)
        self._outputs: list[torch.Tensor | None] = []

    def __deepcopy__(self, memo) -> SiblingProduct:
        clone = copy.copy(self)
        clone.product = copy.deepcopy(self.product, memo)
        clone._input, clone._outputs = None, []
        return clone

    def output(self, index: int, x: torch.Tensor) -> torch.Tensor:
        if x is not self._input or self._outputs[index] is None:
            self._input, self._outputs = x, list(self.product(x).split(self.sizes, dim=-1))
        out, self._outputs[index] = self._outputs[index], None
        if all(o is None for o in self._outputs):
            self._input = None  # the round is over: hold nothing between forwards
        return out


class SiblingLinear(torch.nn.Module):
    """One linear of a SiblingProduct: forward(x) is what the original linear computed."""

    def __init__(self, group: SiblingProduct, index: int, in_features: int, out_features: int):
        super().__init__()
        self.group, self.index = group, index
        self.in_features, self.out_features = in_features, out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.output(self.index, x)


def fuse_sibling_linears(model: torch.nn.Module, invariant: bool = False) -> int:
    """Replace each SIBLING_GROUPS set of CPU linears that pack (same input size, all biased or none)
    by SiblingLinears over one SiblingProduct; returns how many groups were fused."""
    fused = 0
    for module in list(model.modules()):
        for names in SIBLING_GROUPS:
            linears = [getattr(module, name, None) for name in names]
            if not all(type(m) is torch.nn.Linear and m.weight.is_cpu
                       and packs(m.weight.dtype, invariant) for m in linears):
                continue
            if (len({m.in_features for m in linears}) != 1
                    or len({m.bias is None for m in linears}) != 1):
                continue
            group = SiblingProduct(linears, invariant)
            for index, (name, m) in enumerate(zip(names, linears)):
                setattr(module, name, SiblingLinear(group, index, m.in_features, m.out_features))
            fused += 1
    return fused
