"""Where one decode step's time goes: torch.profiler over pure decode steps of kvfleet's engine
at a fixed number of running streams (the first N chat-mix prompts, all prefilled first).

    .venv/bin/python -m benchmarks.profile_decode --streams 32 --dtype auto --attention-backend cpu

Prints the step time and the operators with the most self CPU time per step (the C++ decode
kernel shows under `attention (cpu kernel)`, a record_function around its call). torch.profiler
sees torch's operators only, not kvfleet's products (called through their own binding); with
`--no-torch-profiler` the steps run unprofiled, for a sampling profiler of the whole process:

    perf record -g -- .venv/bin/python -m benchmarks.profile_decode --streams 32 --steps 400 \
        --no-torch-profiler
    perf report --no-children --sort dso,symbol

With `--parts` (and no torch.profiler) each step's time is split by wrapping the fused CPU
layers' calls, as benchmarks/prefill_parts.py splits a prefill step: each product by its shape
(kvfleet's, which torch.profiler cannot see), RMSNorm, RoPE, the attention with its K/V write,
SiLU x up where it is a pass of its own, and the rest (embedding, LM head rows outside the
products, sampling, scheduling, Python); medians over the steps. `--model random:llama-3.2-1b`
takes a model shape in place of the default model:

    .venv/bin/python -m benchmarks.profile_decode --streams 32 --steps 20 --parts
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.engine_throughput import WORKLOAD, greedy, load_requests
from benchmarks.prefill_parts import PartTimer
from kvfleet.shared.cpu_features import cpu_features
from kvfleet.shared.models import DEFAULT_MODEL, load_tokenizer, resolve_model_path
from kvfleet.worker.engine.engine import Engine, EngineConfig


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--top", type=int, default=18)
    p.add_argument("--no-torch-profiler", action="store_true",
                   help="time the steps without torch.profiler (for perf over the process)")
    p.add_argument("--parts", action="store_true",
                   help="split each step's time by the fused layers' calls (no torch.profiler)")
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help="the model (default: the default model; `random:<shape>` for a shape)")
    args = p.parse_args(argv)
    timer = None
    if args.parts:
        args.no_torch_profiler = True
        timer = PartTimer()
        timer.wrap_layers()
    if args.threads:
        torch.set_num_threads(args.threads)
    path = resolve_model_path(args.model)
    requests = load_requests(WORKLOAD, args.streams, load_tokenizer(path))
    engine = Engine.from_pretrained(path, EngineConfig(
        device="cpu", dtype=args.dtype, attention_backend=args.attention_backend,
        max_running=args.streams))
    for i, r in enumerate(requests):
        engine.add_request(f"d{i}", r.prompt, greedy(2 * args.steps + 64))
    while engine.stats().num_waiting or any(s.num_uncomputed_tokens > 1
                                            for s in engine.scheduler.running):
        engine.step()
    for _ in range(args.steps):  # warm-up
        engine.step()
    start = time.perf_counter()
    prof = None
    steps: list[float] = []
    parts: list[dict[str, float]] = []
    if timer is not None:
        for _ in range(args.steps):
            timer.seconds.clear()
            timer.active = True
            began = time.perf_counter()
            engine.step()
            steps.append(time.perf_counter() - began)
            timer.active = False
            parts.append(dict(timer.seconds))
    elif args.no_torch_profiler:
        for _ in range(args.steps):
            engine.step()
    else:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(args.steps):
                engine.step()
    per_step_ms = (time.perf_counter() - start) / args.steps * 1e3
    contexts = [s.num_tokens for s in engine.scheduler.running]
    print(f"# CPU {cpu_features().describe()}; {torch.get_num_threads()} threads; dtype "
          f"{engine.dtype}; attention {engine.attention_backend.name}; {len(contexts)} streams, "
          f"contexts {min(contexts)}-{max(contexts)} (mean {sum(contexts) / len(contexts):.0f})")
    where = "without torch.profiler" if prof is None else "under the profiler"
    print(f"step {per_step_ms:.1f} ms {where} ({len(contexts) * 1e3 / per_step_ms:.0f} tok/s)")
    if prof is not None:
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top))
    if parts:
        print(f"step median {statistics.median(steps) * 1e3:.1f} ms; its parts, medians (ms):")
        print("| part | ms a step |")
        print("|---|---:|")
        for name in sorted({n for r in parts for n in r}):
            print(f"| {name} | {statistics.median(r.get(name, 0.0) for r in parts) * 1e3:.2f} |")
        rest = statistics.median(s - sum(r.values()) for s, r in zip(steps, parts))
        print(f"| the rest | {rest * 1e3:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
