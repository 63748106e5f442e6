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
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.engine_throughput import WORKLOAD, greedy, load_requests
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
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    path = resolve_model_path(DEFAULT_MODEL)
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
    if args.no_torch_profiler:
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
