"""Decode steps by KV block size, side by side: one engine per block size in one process, the
same N chat-mix requests in each, prefilled, then their decode steps interleaved (a step of
each engine in turn), so that a noisy machine slows every size alike.

    OMP_WAIT_POLICY=PASSIVE GOMP_SPINCOUNT=10000 .venv/bin/python -m benchmarks.block_size \
        --streams 32 --block-sizes 16,64,128 --fragmented

A fresh pool hands out its blocks in order, so a prompt's pages lie one after another. In a
pool that has served for a while the free blocks come back in no order, and a sequence's pages
lie anywhere: `--fragmented` gives each engine such a pool (every block taken and freed again in
a random order) before the requests arrive. Prints each size's median step and the median of
the per-step ratios against the first size.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

import torch

from benchmarks.engine_throughput import WORKLOAD, greedy, load_requests
from kvfleet.shared.cpu_features import cpu_features
from kvfleet.shared.models import DEFAULT_MODEL, load_tokenizer, resolve_model_path
from kvfleet.worker.engine.engine import Engine, EngineConfig


def fragment(engine: Engine, seed: int) -> None:
    """Leave the engine's free list in a random order: take every block, free them shuffled."""
    manager = engine.block_manager
    names = [f"fragment-{i}" for i in range(manager.num_free_blocks)]
    for name in names:
        manager.allocate_slots(name, 1)
    random.Random(seed).shuffle(names)
    for name in names:
        manager.free(name)


def decoding_engine(path, block_size: int, args, requests) -> Engine:
    """An engine whose requests are all prefilled and decoding (each asks for more tokens than
    the run takes)."""
    engine = Engine.from_pretrained(path, EngineConfig(device="cpu", dtype=args.dtype,
                                                       block_size=block_size))
    if args.fragmented:
        fragment(engine, seed=block_size)
    for i, r in enumerate(requests):
        engine.add_request(f"r{i}", r.prompt, greedy(args.steps + 10))
    while engine.stats().num_waiting or any(s.num_uncomputed_tokens > 1
                                            for s in engine.scheduler.running):
        engine.step()
    return engine


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", type=int, default=32, help="requests decoding together")
    p.add_argument("--block-sizes", default="16,64,128", help="comma-separated; the first is "
                   "the baseline of the ratios")
    p.add_argument("--steps", type=int, default=60, help="decode steps timed per engine")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--fragmented", action="store_true",
                   help="start from a pool whose free blocks are in random order")
    args = p.parse_args(argv)
    sizes = [int(s) for s in args.block_sizes.split(",")]
    path = resolve_model_path(DEFAULT_MODEL)
    requests = load_requests(WORKLOAD, args.streams, load_tokenizer(path))
    engines = {size: decoding_engine(path, size, args, requests) for size in sizes}
    times: dict[int, list[float]] = {size: [] for size in sizes}
    for _ in range(args.steps):
        for size, engine in engines.items():
            start = time.perf_counter()
            engine.step()
            times[size].append(time.perf_counter() - start)
    contexts = [s.num_tokens for s in engines[sizes[0]].scheduler.running]
    print(f"# CPU {cpu_features().describe()}; {torch.get_num_threads()} threads; dtype "
          f"{engines[sizes[0]].dtype}; attention {engines[sizes[0]].attention_backend.name}; "
          f"{args.streams} streams, mean context {statistics.mean(contexts):.0f}; "
          f"{'fragmented' if args.fragmented else 'fresh'} pool; {args.steps} steps each")
    print(f"| block size | median decode step | step time of blocks of {sizes[0]} / this |")
    print("|---:|---:|---:|")
    for size in sizes:
        ratio = statistics.median(a / b for a, b in zip(times[sizes[0]], times[size]))
        print(f"| {size} | {statistics.median(times[size]) * 1e3:.1f} ms | {ratio:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
