"""The CPU's ceilings, measured in the benchmark's own run, and what a model's step needs of them.

- `product_rates` / `peak_product_rate`: FLOP/s of every product implementation this machine has
  (`product_implementations`: kvfleet's product in each of its forms, oneDNN's through torch
  with weights packed and not, MKL's packed sgemm, `F.linear`, `torch.mm`), each timed at a
  model's largest linear shape (rows x hidden -> intermediate); the peak prefill is judged
  against is the best of them, named, whether or not the engine computes with it (on an AMX CPU
  oneDNN's tiles, while `--deterministic` sums in kvfleet's FMA form).
- `read_bandwidth`: bytes/s read from a buffer the size of a decode step's reads (the faster of
  torch's sum and MKL's sgemv over it): the memory roofline of decode.
- `ModelCost`: a model's FLOPs per prompt token and bytes per decode step (weights read once,
  every stream's K/V; for an MoE model only the experts a step's tokens route to, expected).

`python -m benchmarks.roofline --features 2048x8192` prints the products' breakdown alone.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kvfleet.shared.cpu_features import cpu_features
from kvfleet.worker.engine.kernels import cpu_linear, torch_private
from kvfleet.worker.engine.kernels.cpu_attention import DTYPE_CODES, KernelUnavailable
from kvfleet.worker.engine.kernels.cpu_kernels import matmul_kernel

Product = Callable[[torch.Tensor], torch.Tensor]  # x [rows, in] -> [rows, out]
Implementation = Callable[[torch.nn.Linear], Product]  # packs what it needs once, per linear
# a product whose output differs from F.linear's by more than this (relative to its largest
# output) is not timed: bf16 outputs round to 8 bits, and the forms sum in other orders
_AGREEMENT = {torch.bfloat16: 2 ** -6, torch.float32: 1e-4}


def _best_seconds(fn, repeats: int, rounds: int = 3) -> float:
    for _ in range(3):
        fn()
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        best = min(best, (time.perf_counter() - start) / repeats)
    return best


def kvfleet_forms(dtype: torch.dtype) -> dict[str, str | None]:
    """kvfleet's product in each form its kernels compute `dtype` in here, by name, with the form
    `KernelLinear` takes for it: bf16 `kvfleet dot` (vdpbf16ps) and `kvfleet fma` (fp32 FMAs over
    the widened weights) where the build has AVX512-BF16, `kvfleet amx` (AMX tiles,
    cpu_amx.cpp) where the CPU has AMX-BF16 and Linux grants the tiles, float32 `kvfleet fp32`
    on AVX-512, `kvfleet portable` where only the portable build computes it; none where the
    kernel is unavailable."""
    if dtype not in DTYPE_CODES:
        return {}
    try:
        supported = matmul_kernel().kvfleet_linear_supported
        if dtype == torch.float32:
            level = supported(DTYPE_CODES[dtype])
            return {} if not level else {
                "kvfleet fp32" if level == cpu_linear.FAST else "kvfleet portable": None}
        codes = cpu_linear.BF16_FORM_CODES
        if supported(codes["dot"]) == cpu_linear.PORTABLE:  # the forms are one product there
            return {"kvfleet portable": "dot"}
        forms = {f"kvfleet {form}": form for form in ("dot", "fma")
                 if supported(codes[form]) == cpu_linear.FAST}
    except KernelUnavailable:
        return {}
    if cpu_linear.amx_tiles() is None:
        forms["kvfleet amx"] = "amx"
    return forms


def _kvfleet_product(form: str | None) -> Implementation:
    def build(linear: torch.nn.Linear) -> Product:
        # the weight packed as the engine packs it for that form; called as the engine calls it
        return cpu_linear.KernelLinear(linear, form=form)
    return build


def _onednn_unpacked(linear: torch.nn.Linear) -> Product:
    op, weight = torch.ops.mkldnn._linear_pointwise, linear.weight.detach()
    return lambda x: op(x, weight, None, "none", [], "")


def _mkl_packed(linear: torch.nn.Linear) -> Product:
    weight, batch = linear.weight.detach(), 512
    packed = torch.ops.mkl._mkl_reorder_linear_weight(weight, batch)
    op = torch.ops.mkl._mkl_linear
    return lambda x: op(x, packed, weight, None, batch)


def _transposed_mm(linear: torch.nn.Linear) -> Product:
    weight_t = linear.weight.detach().t().contiguous()  # [in, out]
    return lambda x: torch.mm(x, weight_t)


def product_implementations(dtype: torch.dtype) -> dict[str, Implementation]:
    """Every product of `dtype` this machine has, by name: kvfleet's forms (`kvfleet_forms`);
    `oneDNN packed` (cpu_linear.PackedLinear: the engine's oneDNN path, on AMX CPUs its bf16 tiles)
    where oneDNN packs `dtype`; `oneDNN unpacked` (torch.ops.mkldnn._linear_pointwise over the
    plain weight) where oneDNN computes `dtype` natively; float32 `MKL packed`
    (torch.ops.mkl._mkl_linear over cblas_sgemm_pack's weight) where torch has MKL; `F.linear`
    (torch.matmul(x, w.T): MKL's sgemm for float32, oneDNN for bf16); `torch.mm` over the weight
    stored transposed ([in, out], another layout for the same libraries). One that torch lacks
    fails when built or called: product_rates reports it as skipped, not timed."""
    impls: dict[str, Implementation] = {
        name: _kvfleet_product(form) for name, form in kvfleet_forms(dtype).items()}
    if cpu_linear.packing_available(dtype):
        impls["oneDNN packed"] = cpu_linear.PackedLinear
    if torch.backends.mkldnn.is_available() and (
            dtype == torch.float32 or torch_private.onednn_bf16_supported()):
        impls["oneDNN unpacked"] = _onednn_unpacked
    if dtype == torch.float32 and torch.backends.mkl.is_available():
        impls["MKL packed"] = _mkl_packed
    impls["F.linear"] = lambda linear: lambda x: F.linear(x, linear.weight)
    impls["torch.mm"] = _transposed_mm
    return impls


def engine_product(dtype: torch.dtype, invariant: bool) -> str:
    """The implementation (a name of product_implementations) the engine computes `dtype`
    linears with here: batch-invariantly (`--deterministic`, the default) or not."""
    if cpu_linear.own_product(dtype, invariant):
        if matmul_kernel().kvfleet_linear_supported(DTYPE_CODES[dtype]) == cpu_linear.PORTABLE:
            return "kvfleet portable"
        return f"kvfleet {cpu_linear.bf16_form()}" if dtype == torch.bfloat16 else "kvfleet fp32"
    return "oneDNN packed" if cpu_linear.packing_available(dtype) else "F.linear"


@dataclass(frozen=True)
class ProductRates:
    """Every implementation's FLOP/s at one product shape, and the peak: the best of them."""

    dtype: torch.dtype
    rows: int
    in_features: int
    out_features: int
    rates: dict[str, float]  # implementation -> FLOP/s
    isa: str  # shared/cpu_features.py's: "AMX" where the CPU has AMX tiles
    # "deterministic" / "no-deterministic" (the engine's flag) -> the implementation it takes
    engine: dict[str, str] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)  # implementation -> why not timed

    @property
    def peak(self) -> float:
        return max(self.rates.values())

    @property
    def peak_by(self) -> str:
        """The implementation that set the peak."""
        return max(self.rates, key=self.rates.__getitem__)

    def as_dict(self) -> dict[str, float]:
        """peak_product_rate's answer: every implementation's FLOP/s by name, "kvfleet" (the
        engine's product by default, --deterministic, where it was timed) and "peak"."""
        rates = dict(self.rates)
        if self.engine.get("deterministic") in self.rates:
            rates["kvfleet"] = self.rates[self.engine["deterministic"]]
        return rates | {"peak": self.peak}

    def describe(self) -> str:
        """One line: the shape, every implementation's GFLOP/s, the peak and who set it, what the
        engine computes with, whether the CPU has AMX, what was not timed."""
        name = {torch.bfloat16: "bf16", torch.float32: "float32"}.get(self.dtype, str(self.dtype))
        rates = ", ".join(f"{k} {v / 1e9:.0f}" for k, v in self.rates.items())
        engine = ""
        if self.engine:
            engine = "; the engine computes with " + (
                self.engine["deterministic"] if len(set(self.engine.values())) == 1 else
                " / ".join(f"{v} (--{k})" for k, v in self.engine.items()))
        skipped = "".join(f"; {k} not timed: {v}" for k, v in self.skipped.items())
        amx = "AMX" if self.isa == "AMX" else f"{self.isa}, no AMX"
        return (f"{name} [{self.rows}, {self.in_features}] x [{self.in_features}, "
                f"{self.out_features}] ({amx}): {rates} GFLOP/s; peak {self.peak / 1e9:.0f} by "
                f"{self.peak_by}{engine}{skipped}")


def product_rates(dtype: torch.dtype, in_features: int, out_features: int, rows: int = 512,
                  implementations: dict[str, Implementation] | None = None,
                  rounds: int = 3, round_seconds: float = 0.1) -> ProductRates:
    """FLOP/s of a [rows, in] x [in, out] product by every implementation (default:
    product_implementations(dtype)), each built once over the same weight and checked against
    F.linear's output (one that fails or disagrees is skipped, with why), then timed in `rounds`
    rounds that alternate the implementations (a loaded host slows them alike), each round about
    `round_seconds` of calls per implementation; an implementation's rate is its best round's."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(in_features, out_features, bias=False, dtype=dtype)
    x = torch.randn(rows, in_features, dtype=dtype)
    flops = 2 * rows * in_features * out_features
    impls = product_implementations(dtype) if implementations is None else implementations
    calls: dict[str, Product] = {}
    repeats: dict[str, int] = {}
    skipped: dict[str, str] = {}
    with torch.inference_mode():
        expected = F.linear(x, linear.weight).float()
        tolerance = _AGREEMENT.get(dtype, 1e-4) * expected.abs().max().item()
        for name, build in impls.items():
            try:
                call = build(linear)
                for _ in range(2):  # first-call costs (reorders, allocations) out of the timing
                    got = call(x)
                start = time.perf_counter()
                call(x)
                once = time.perf_counter() - start
            except (RuntimeError, AttributeError, TypeError, ValueError) as exc:
                skipped[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
                continue
            if got.shape != expected.shape:
                skipped[name] = f"output shape {tuple(got.shape)}"
                continue
            error = (got.float() - expected).abs().max().item()
            if not error <= tolerance:
                skipped[name] = f"disagrees with F.linear (max difference {error:.3g})"
                continue
            calls[name] = call
            repeats[name] = max(2, math.ceil(round_seconds / max(once, 1e-9)))
        best = dict.fromkeys(calls, float("inf"))
        for _ in range(rounds):
            for name, call in calls.items():
                start = time.perf_counter()
                for _ in range(repeats[name]):
                    call(x)
                best[name] = min(best[name], (time.perf_counter() - start) / repeats[name])
    if not best:
        raise RuntimeError(f"no {dtype} product could be timed here: {skipped}")
    engine = {}
    if implementations is None:
        engine = {"deterministic": engine_product(dtype, True),
                  "no-deterministic": engine_product(dtype, False)}
    return ProductRates(dtype, rows, in_features, out_features,
                        {name: flops / seconds for name, seconds in best.items()},
                        cpu_features().isa, engine, skipped)


def peak_product_rate(dtype: torch.dtype, in_features: int, out_features: int,
                      rows: int = 512, round_seconds: float = 0.1) -> dict[str, float]:
    """FLOP/s of a [rows, in] x [in, out] product by every implementation here, by name
    (product_rates), "kvfleet" (the one the engine computes with by default) and "peak", the
    best of them (product_rates(...).peak_by names it)."""
    return product_rates(dtype, in_features, out_features, rows,
                         round_seconds=round_seconds).as_dict()


def read_bandwidth(num_bytes: int, passes: int = 3) -> float:
    """Memory read bandwidth over a buffer of `num_bytes`: the faster of two readers that stream
    it once, torch's sum and MKL's float32 matrix-vector product (best of `passes` each)."""
    columns = 1024
    matrix = torch.ones(max(num_bytes // (4 * columns), 256), columns, dtype=torch.float32)
    vector = torch.ones(columns, dtype=torch.float32)
    seconds = min(_best_seconds(matrix.sum, 1, passes),
                  _best_seconds(lambda: torch.mv(matrix, vector), 1, passes))
    return matrix.numel() * 4 / seconds


@dataclass(frozen=True)
class ModelCost:
    """What a model's forward costs, from its config and parameter counts."""

    layer_params: int  # parameters of the decoder layers (all experts of an MoE)
    expert_params: int  # of those, in routed experts
    num_experts: int
    experts_per_token: int
    head_params: int  # the LM head's (vocab x hidden), computed for sampled rows only
    num_layers: int
    q_width: int  # query heads x head dim
    kv_width: int  # KV heads x head dim

    @classmethod
    def of(cls, model) -> ModelCost:
        cfg = model.config
        layers = model.model.layers
        layer_params = sum(p.numel() for p in layers.parameters())
        expert_params = sum(p.numel() for n, p in layers.named_parameters()
                            if ".experts." in n)
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        return cls(layer_params, expert_params,
                   getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", 1) or 1,
                   getattr(cfg, "num_experts_per_tok", 1) or 1,
                   cfg.vocab_size * cfg.hidden_size, cfg.num_hidden_layers,
                   cfg.num_attention_heads * head_dim, cfg.num_key_value_heads * head_dim)

    @property
    def active_layer_params(self) -> float:
        """Layer parameters a token computes with (an MoE token: its experts_per_token only)."""
        return (self.layer_params - self.expert_params
                + self.expert_params * self.experts_per_token / self.num_experts)

    def prefill_flops(self, prompt_lengths: list[int]) -> float:
        """FLOPs of computing these prompts: the layers' products per token, attention over the
        causal pairs (QK^T and PV), the LM head once per prompt."""
        tokens = sum(prompt_lengths)
        pairs = sum(n * (n + 1) / 2 for n in prompt_lengths)
        return (2 * self.active_layer_params * tokens + 4 * self.num_layers * self.q_width * pairs
                + 2 * self.head_params * len(prompt_lengths))

    def decode_step_bytes(self, streams: int, mean_context: float, elem: int,
                          kv_elem: int | None = None) -> dict[str, float]:
        """Bytes a decode step of `streams` rows reads at least: every weight it computes with
        once (an MoE: the experts its tokens route to, expected under uniform routing) and every
        stream's K/V."""
        share = 1.0
        if self.num_experts > 1:  # expected fraction of experts hit by streams x k choices
            share = 1 - (1 - self.experts_per_token / self.num_experts) ** streams
        weights = (self.layer_params - self.expert_params + self.expert_params * share
                   + self.head_params) * elem
        kv = streams * mean_context * self.num_layers * 2 * self.kv_width * (kv_elem or elem)
        return {"weights": weights, "kv": kv, "total": weights + kv}

    def decode_step_flops(self, streams: int) -> float:
        return 2 * (self.active_layer_params + self.head_params) * streams


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Every product implementation's FLOP/s at one "
                                "linear shape on this machine, and the peak: the best of them.")
    p.add_argument("--features", default="2048x8192",
                   help="in x out of the linear (default: Llama-3.2-1B's MLP, 2048x8192)")
    p.add_argument("--rows", type=int, default=512)
    p.add_argument("--dtypes", default="bfloat16,float32")
    args = p.parse_args(argv)
    in_features, out_features = (int(n) for n in args.features.lower().split("x"))
    print(f"{cpu_features().describe()}; {torch.get_num_threads()} threads")
    for name in args.dtypes.split(","):
        print(product_rates(getattr(torch, name), in_features, out_features, args.rows).describe())


if __name__ == "__main__":
    main()
