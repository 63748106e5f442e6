"""Where a prefill step's time goes on the CPU, part by part, and what kvfleet's product's fused
epilogues save (SiLU x up in the gate/up product, the residual add in the down product): one
process, two engines on the default model (the fused layers as the engine builds them, and the
same with both left as passes of their own after plain products), their prefill steps
alternated.

    .venv/bin/python -m benchmarks.prefill_parts --tokens 2048 --rounds 5

(`--model random:llama-3.2-1b`: a model shape's engine in place of the default model's.)
(`--dtype float32`: the engines in float32, as on CPUs without AVX512-BF16.)

Each round adds --tokens / 256 seeded random prompts of 256 tokens to an engine and times the
step that computes them all (max_batched_tokens = --tokens; nothing is found in the prefix
cache: the prompts differ in every round), then lets them finish. The parts are timed by
wrapping the fused layer's calls (cpu_layers.py: each product by its shape, RMSNorm, RoPE, the
attention with its K/V write, SiLU x up) and summed over the step's layers; the rest is the
step's time outside them (the residual add where it is a pass of its own, embedding, LM head
rows, sampling, scheduling, Python). Medians over the rounds after the first (a warm-up). A
step that fails stops the script. On AMX tiles the engine fuses both; with AVX-512 (no AMX)
SiLU x up alone; where it fuses neither (kvfleet's portable product, or `--no-deterministic`
without AMX), both engines are the same and the ratio is ~1: the script says so.
"""

from __future__ import annotations

import argparse
import collections
import random
import statistics
import time

import torch

from kvfleet.shared.models import DEFAULT_MODEL, resolve_model_path
from kvfleet.shared.wire import SamplingParams
from kvfleet.worker.engine.engine import Engine, EngineConfig
from kvfleet.worker.engine.kernels import cpu_linear
from kvfleet.worker.engine.model import cpu_layers

PROMPT_LEN = 256


class PartTimer:
    """Seconds per named part, accumulated while `active`."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = collections.defaultdict(float)
        self.active = False

    def wrap(self, owner, name: str, label: str) -> None:
        inner = getattr(owner, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                if self.active:
                    self.seconds[label] += time.perf_counter() - start

        setattr(owner, name, timed)

    def wrap_products(self) -> None:
        inner = cpu_linear.KernelLinear.forward
        timer = self

        def forward(module, x, add_to=None):
            start = time.perf_counter()
            try:
                return inner(module, x, add_to=add_to)
            finally:
                if timer.active:
                    fused = (" + SiLU x up" if module.silu_pairs else
                             " + residual add" if add_to is not None else "")
                    timer.seconds[f"product {module.in_features} x {module.out_features}{fused}"] \
                        += time.perf_counter() - start

        cpu_linear.KernelLinear.forward = forward

    def wrap_layers(self) -> None:
        """Every part of the fused CPU layers (cpu_layers.py): the products by their shapes,
        RMSNorm, RoPE, the attention with its K/V write, SiLU x up where it is a pass of its
        own. For the rest of the process: a script that splits steps calls it once."""
        self.wrap_products()
        for name, label in (("rms_norm", "RMSNorm"), ("rope_", "RoPE"),
                            ("fused_layer_attention", "attention (K/V write, kernel)"),
                            ("silu_mul", "SiLU x up (its own pass)")):
            self.wrap(cpu_layers, name, label)


def build(tokens: int, fuse: bool, dtype: str = "auto", model: str = DEFAULT_MODEL) -> Engine:
    """`model`'s engine (the default model's unless given); without `fuse`, its layers' gate/up
    products are built plain (cpu_layers applies SiLU x up as its own pass) and their down
    products add into the residual with add_."""
    product = cpu_layers.product
    if not fuse:
        cpu_layers.product = lambda linear, invariant=False, silu_pairs=False: product(
            linear, invariant, False)
    try:
        engine = Engine.from_pretrained(resolve_model_path(model), EngineConfig(
            device="cpu", dtype=dtype, max_batched_tokens=tokens, max_running=64))
    finally:
        cpu_layers.product = product
    if not fuse:
        for layer in engine.model.model.layers:
            layer._add_in_product = False
    return engine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=2048, help="prompt tokens in the step")
    parser.add_argument("--rounds", type=int, default=5, help="timed steps per engine")
    parser.add_argument("--dtype", default="auto", help="the engines' --dtype")
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help="the model (default: the default model; `random:<shape>` for a shape)")
    args = parser.parse_args()
    timer = PartTimer()
    timer.wrap_layers()
    engines = {"fused epilogues": build(args.tokens, True, args.dtype, args.model),
               "passes of their own": build(args.tokens, False, args.dtype, args.model)}
    fused = any(getattr(layer, "_silu_in_product", False)
                or getattr(layer, "_add_in_product", False)
                for layer in engines["fused epilogues"].model.model.layers)
    rng = random.Random(0)
    steps: dict[str, list[float]] = collections.defaultdict(list)
    parts: dict[str, list[dict[str, float]]] = collections.defaultdict(list)
    for round_ in range(args.rounds + 1):
        for name, engine in engines.items():
            for i in range(args.tokens // PROMPT_LEN):
                engine.add_request(f"{round_}-{i}", [rng.randrange(1000, 40000)
                                                     for _ in range(PROMPT_LEN)],
                                   SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
            timer.seconds.clear()
            timer.active = True
            start = time.perf_counter()
            outputs = engine.step()
            elapsed = time.perf_counter() - start
            failed = [o for o in outputs if getattr(o, "error", None)]
            if failed:
                raise SystemExit(f"{name}: a step failed: {failed[0].error}")
            timer.active = False
            while engine.has_unfinished():
                engine.step()
            if round_:  # the first round warms up
                steps[name].append(elapsed)
                parts[name].append(dict(timer.seconds))
    print(f"# {torch.get_num_threads()} threads; --dtype {args.dtype}; "
          f"{engines['fused epilogues'].device_report()}")
    print(f"# {args.tokens // PROMPT_LEN} prompts of "
          f"{PROMPT_LEN} tokens a step; {args.rounds} rounds, alternated; medians, ms; "
          f"epilogues fused here: {'yes' if fused else 'no (both engines alike)'}")
    names = sorted({p for rounds in parts.values() for r in rounds for p in r})
    print("| part | " + " | ".join(engines) + " |")
    print("|---|" + "---:|" * len(engines))
    for part in names:
        cells = [statistics.median(r.get(part, 0.0) for r in parts[e]) * 1e3 for e in engines]
        print(f"| {part} | " + " | ".join(f"{c:.1f}" for c in cells) + " |")
    for label, cells in (("the rest", [statistics.median(
            s - sum(r.values()) for s, r in zip(steps[e], parts[e])) * 1e3 for e in engines]),
            ("**step**", [statistics.median(steps[e]) * 1e3 for e in engines])):
        print(f"| {label} | " + " | ".join(f"{c:.1f}" for c in cells) + " |")
    ratios = [b / a for a, b in zip(steps["fused epilogues"], steps["passes of their own"])]
    print(f"step time, passes of their own over fused epilogues: median of the rounds' "
          f"ratios {statistics.median(ratios):.3f} ({', '.join(f'{r:.3f}' for r in ratios)})")


if __name__ == "__main__":
    main()
