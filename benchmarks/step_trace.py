"""Where an offline run's time goes, step by step: kvfleet's engine on the first N chat-mix
requests at t=0 (as benchmarks/engine_throughput.py runs them), each step timed and classed by
what it computed: steps with prefill work, then pure decode steps by running batch size.

    OMP_WAIT_POLICY=PASSIVE GOMP_SPINCOUNT=10000 .venv/bin/python -m benchmarks.step_trace --num-requests 64

A decode step's cost barely falls with the batch (every step reads all the weights), so the
requests that run longest, alone in a small batch at the end, cost many nearly full steps.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict

import torch

from benchmarks.engine_throughput import WORKLOAD, greedy, load_requests
from kvfleet.shared.cpu_features import cpu_features
from kvfleet.shared.models import DEFAULT_MODEL, load_tokenizer, resolve_model_path
from kvfleet.worker.engine.engine import Engine, EngineConfig


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-batched-tokens", type=int, default=512)
    p.add_argument("--max-running", type=int, default=64)
    p.add_argument("--block-size", type=int, default=EngineConfig.block_size,
                   help="tokens per KV block")
    p.add_argument("--bucket", type=int, default=8, help="decode batch sizes per table row")
    p.add_argument("--raw-prompts", action="store_true",
                   help="prompts as plain text, as the HTTP comparison sends them (default: each "
                        "in the chat template)")
    args = p.parse_args(argv)
    path = resolve_model_path(DEFAULT_MODEL)
    requests = load_requests(WORKLOAD, args.num_requests, load_tokenizer(path),
                             args.raw_prompts)
    engine = Engine.from_pretrained(path, EngineConfig(
        device="cpu", dtype=args.dtype, max_batched_tokens=args.max_batched_tokens,
        max_running=args.max_running, block_size=args.block_size))
    for i, r in enumerate(requests):
        engine.add_request(f"t{i}", r.prompt, greedy(r.max_tokens))
    prefill_steps, prefill_s = 0, 0.0
    decode = defaultdict(lambda: [0, 0.0])  # bucket -> [steps, seconds]
    start = time.perf_counter()
    while engine.has_unfinished():
        running = engine.scheduler.running
        prefilling = engine.stats().num_waiting or any(s.num_uncomputed_tokens > 1 for s in running)
        batch = len(running)
        t = time.perf_counter()
        engine.step()
        seconds = time.perf_counter() - t
        if prefilling:
            prefill_steps, prefill_s = prefill_steps + 1, prefill_s + seconds
        else:
            bucket = -(-batch // args.bucket) * args.bucket
            decode[bucket][0] += 1
            decode[bucket][1] += seconds
    total = time.perf_counter() - start
    print(f"# CPU {cpu_features().describe()}; {torch.get_num_threads()} threads; dtype "
          f"{engine.dtype}; attention {engine.attention_backend.name}; blocks of "
          f"{engine.config.block_size}; {args.num_requests} requests "
          f"({'raw prompts' if args.raw_prompts else 'prompts in the chat template'}), "
          f"{sum(r.max_tokens for r in requests)} output tokens in {total:.1f} s")
    print("| steps | count | seconds | share of the run | ms per step |")
    print("|---|---:|---:|---:|---:|")
    rows = [("with prefill work", prefill_steps, prefill_s)]
    rows += [(f"decode, batch {b - args.bucket + 1}-{b}", *decode[b]) for b in sorted(decode)]
    for name, count, seconds in rows:
        if count:
            print(f"| {name} | {count} | {seconds:.1f} | {seconds / total:.0%} | "
                  f"{seconds / count * 1e3:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
