"""What routing one request costs the gateway (issue #34's target: at most 1 ms at p99 for
2,000-token prompts): `Router.route` timed on prompts of a given length against a prefix index
holding a given number of blocks per worker, with the workers' loads set as heartbeats would.

No Redis is involved: `route` reads only the in-memory index and loads (Redis feeds them in the
background), so this is the whole per-request cost. Run:

    python -m benchmarks.routing_cost [--workers 3] [--blocks 10000] [--prompt-tokens 2000]

It prints the median, p90, p99 and max of `route`'s wall time over `--requests` calls, for three
kinds of prompt: one whose every block a worker holds, one sharing a tenant's system prompt
(half its blocks) and one nobody holds.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from kvfleet.gateway.fleet.affinity import Router, WorkerLoads
from kvfleet.gateway.fleet.prefix_index import PrefixIndex
from kvfleet.shared.wire import Heartbeat, Keys
from kvfleet.shared.wire.prefix_hash import block_hashes, root_hash

MODEL = "bench-model"


def build_router(workers: int, blocks: int, block_size: int, prompts: list[list[int]],
                 seed: int) -> Router:
    """A router whose index holds `blocks` announce ids per worker: the blocks of the prompts
    given (worker i holds prompt i's) plus random ids up to the count."""
    rng = random.Random(seed)
    router = Router(redis=None, keys=Keys("bench:"))
    index = PrefixIndex(redis=_NoRedis(), keys=router.keys, model=MODEL, listing_ttl_ms=10_000)
    index.last_id = "0-0"  # synced
    root = root_hash(MODEL)
    for i in range(workers):
        held = {h[:8] for h in block_hashes(prompts[i % len(prompts)], block_size, root)}
        while len(held) < blocks:
            held.add(rng.randbytes(8))
        index.sets[f"w{i}"] = held
    router.indexes[MODEL] = index
    loads = WorkerLoads()
    loads.update({f"w{i}": Heartbeat(model=MODEL, ts=time.time(), blocks_total=100_000,
                                     blocks_free=50_000, running=2,
                                     block_size=block_size, max_running=64)
                  for i in range(workers)})
    router.loads[MODEL] = loads
    return router


class _NoRedis:
    """Stands in for the Redis client the index registers its script with (never called)."""

    def register_script(self, script):
        return None


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--blocks", type=int, default=10_000, help="announce ids per worker")
    parser.add_argument("--prompt-tokens", type=int, default=2000)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    n = args.prompt_tokens
    held = [[rng.randrange(50_000) for _ in range(n)] for _ in range(args.workers)]
    half = held[0][:n // 2] + [rng.randrange(50_000) for _ in range(n - n // 2)]
    nobody = [rng.randrange(50_000) for _ in range(n)]
    router = build_router(args.workers, args.blocks, args.block_size, held, args.seed)
    print(f"# Router.route: {args.workers} workers x {args.blocks} indexed blocks, "
          f"{n}-token prompts, block size {args.block_size}, {args.requests} calls each")
    print("| prompt | median ms | p90 ms | p99 ms | max ms | routed to |")
    print("|---|---:|---:|---:|---:|---|")
    for name, prompt in (("all blocks held", held[0]), ("half held", half),
                         ("none held", nobody)):
        times = []
        route = None
        for _ in range(args.requests):
            started = time.perf_counter()
            route = router.route(MODEL, prompt)
            times.append(time.perf_counter() - started)
            if route.worker is not None:
                router.loads[MODEL].ended(route.worker)  # keep the loads as they were
        ms = [t * 1000 for t in times]
        print(f"| {name} | {statistics.median(ms):.3f} | {percentile(ms, 0.9):.3f} | "
              f"{percentile(ms, 0.99):.3f} | {max(ms):.3f} | {route.worker or 'shared'} "
              f"({route.cached_tokens} cached) |")


if __name__ == "__main__":
    main()
