"""Failover benchmark: the pause a client sees when the worker serving it is SIGKILLed, whether its
text stays identical to an uninterrupted run, and what the kill costs — on an idle fleet, or on a
fleet kept at a given fraction of its measured capacity (`--load`).

    .venv/bin/python -m benchmarks.failover --trials 5 --requests 8 --max-tokens 120
    .venv/bin/python -m benchmarks.failover --trials 10 --requests 8 --seeded 2 --max-tokens 300 \
        --kill-after-chars 40 --no-calm   # issue 35's trial, at the default --deterministic
    OMP_WAIT_POLICY=PASSIVE GOMP_SPINCOUNT=10000 .venv/bin/python -m benchmarks.failover --trials 20 --requests 6 \\
        --max-tokens 60 --no-calm --load 0.8

Each trial: 2 workers serve N streamed requests (greedy; the last `--seeded` of them sampled at
temperature 0.8 with a seed each); once every request has `--kill-after-chars` characters (or 5
checkpointed tokens), the worker serving most of them is SIGKILLed and a replacement started afterwards. Reported: per-request pause
(largest gap between content chunks) of resumed requests, p50 and max over all trials; fraction of
requests whose text equals the uninterrupted reference; median wall time of runs with a kill vs
runs without one (each trial runs both, after one warm-up run).

With `--load F`: first the fleet's capacity is measured (output tokens/s of closed-loop clients at
each `--capacity-concurrency`, the largest rate); then a background closed loop at the smallest of
those concurrencies that reached F x capacity runs through every trial, the replacement worker
included. Reported too: the load the fleet served in the `--load-window-s` before each kill as a
share of capacity, and whether every background answer (the victim's included) equals the first
answer its prompt got.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import redis

from benchmarks.fleet_load import (Answer, ClosedLoop, References, measure_capacity,
                                   served_tokens_per_s, start_two_workers, stream_answer)
from kvfleet.shared.redis_server import EmbeddedRedis
from kvfleet.shared.wire import Keys, RequestRecord
from kvfleet.shared.wire.checkpoint import TOKEN_BYTES
from tests.helpers.processes import ProcessFleet


def run(url: str, n: int, max_tokens: int, during=None,
        seeded: int = 0) -> tuple[list[Answer], float]:
    answers = [Answer(i, max_tokens) for i in range(n)]
    threads = [threading.Thread(target=stream_answer, args=(url, i, max_tokens, answers[i]),
                                kwargs={"sampled": i >= n - seeded})
               for i in range(n)]
    start = time.monotonic()
    for t in threads:
        t.start()
    if during:
        during(answers)
    for t in threads:
        t.join()
    return answers, time.monotonic() - start


def kill_busiest(fleet: ProcessFleet, client: redis.Redis, answers: list[Answer],
                 min_chars: int = 0) -> float:
    """Once every request streams (5 checkpointed tokens, `min_chars` characters received),
    SIGKILL the worker that owns most of them; the kill's time."""
    keys = Keys(fleet.prefix)
    while True:
        ids = [a.req_id for a in answers]
        if all(ids) and min(a.chars for a in answers) >= min_chars:
            owners = [client.hget(keys.request(i), RequestRecord.WORKER) for i in ids]
            done = [client.strlen(keys.checkpoint(i)) // TOKEN_BYTES for i in ids]
            if min(done) >= 5 and all(owners):
                victim_id = max(set(owners), key=owners.count).decode()
                fleet.workers.pop(victim_id).kill()
                return time.monotonic()
        time.sleep(0.02)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=120)
    parser.add_argument("--seeded", type=int, default=0,
                        help="of the requests, this many (the last) sample at temperature 0.8")
    parser.add_argument("--kill-after-chars", type=int, default=0,
                        help="kill once every stream has this many characters")
    parser.add_argument("--dtype", default="auto",
                        help="the workers' --dtype (auto: what users get, bf16 on CPUs with "
                             "native bf16)")
    parser.add_argument("--no-deterministic", action="store_true",
                        help="start the workers with --no-deterministic (the code before issue 35)")
    parser.add_argument("--heartbeat-ttl-s", type=float, default=2.0)
    parser.add_argument("--no-calm", action="store_true",
                        help="kill runs only (no throughput comparison): more trials per minute")
    parser.add_argument("--load", type=float, default=0.0,
                        help="keep the fleet at this fraction of its measured capacity (0: idle)")
    parser.add_argument("--capacity-concurrency", default="8,16,32,64,96",
                        help="closed-loop concurrencies of the capacity measurement")
    parser.add_argument("--capacity-s", type=float, default=30.0)
    parser.add_argument("--background-max-tokens", type=int, default=64)
    parser.add_argument("--load-window-s", type=float, default=5.0)
    parser.add_argument("--settle-s", type=float, default=10.0,
                        help="with --load: wait after the replacement worker joined, so that each "
                             "trial starts from the loaded steady state")
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    flags = ["--dtype", args.dtype, "--kv-memory", "512MiB", "--num-threads", "1",
             "--heartbeat-ttl-s", str(args.heartbeat_ttl_s), "--heartbeat-interval-s", "0.5"]
    if args.no_deterministic:
        flags.append("--no-deterministic")
    if args.load > 0:  # the load is the point: the gateway queues it instead of answering 429
        os.environ["KVFLEET_MAX_QUEUE_WAIT_S"] = "0"
    references = References()
    background: ClosedLoop | None = None
    loads: list[float] = []
    with EmbeddedRedis() as server, tempfile.TemporaryDirectory() as logs:
        fleet = ProcessFleet(server.url, Path(logs), worker_flags=flags)
        client = redis.Redis.from_url(server.url)
        try:
            start_two_workers(fleet)
            # The first run warms up (and fills the prefix cache) and gives the reference texts.
            reference, _ = run(fleet.url, args.requests, args.max_tokens, seeded=args.seeded)
            references.check(reference)
            if args.load > 0:
                print("capacity (2 workers, no kill):", flush=True)
                concurrencies = [int(c) for c in args.capacity_concurrency.split(",")]
                capacity, rates, sweep = measure_capacity(
                    fleet.url, concurrencies, args.background_max_tokens, args.capacity_s,
                    warmup_s=10.0)
                references.check(sweep)
                chosen = min((c for c, r in rates.items() if r >= args.load * capacity),
                             default=max(concurrencies))
                print(f"capacity {capacity:.1f} tokens/s; background load: {chosen} clients "
                      f"({rates[chosen]:.1f} tokens/s = {rates[chosen] / capacity:.0%})", flush=True)
                background = ClosedLoop(fleet.url, chosen, args.background_max_tokens,
                                        first_prompt=7).start()
                time.sleep(10)  # the background reaches its steady state
            pauses, walls, calm_walls = [], [], []
            for trial in range(args.trials):
                if not args.no_calm:
                    calm_walls.append(run(fleet.url, args.requests, args.max_tokens,
                                          seeded=args.seeded)[1])
                killed_at = []
                answers, wall_s = run(fleet.url, args.requests, args.max_tokens,
                                      during=lambda a: killed_at.append(
                                          kill_busiest(fleet, client, a, args.kill_after_chars)),
                                      seeded=args.seeded)
                walls.append(wall_s)
                references.check(answers)
                for answer in answers:
                    attempt = client.hget(Keys(fleet.prefix).request(answer.req_id),
                                          RequestRecord.ATTEMPT)
                    if attempt not in (b"1", None) and len(answer.times) > 1:
                        pauses.append(max(b - a for a, b in zip(answer.times, answer.times[1:])))
                load = ""
                if background is not None:
                    served = background.snapshot() + answers
                    rate = served_tokens_per_s(served, killed_at[0] - args.load_window_s,
                                               killed_at[0])
                    loads.append(rate / capacity)
                    load = f"; load before the kill {rate:.0f} tokens/s = {rate / capacity:.0%}"
                fleet.start_worker(f"spare{trial}")  # two workers again for the next trial
                if background is not None:
                    time.sleep(args.settle_s)
                print(f"trial {trial + 1}: {wall_s:.1f} s with a kill{load}; resumed so far "
                      f"{len(pauses)}, identical so far {references.identical}/"
                      f"{references.checked}", flush=True)
            if background is not None:
                references.check(background.stop())
        finally:
            fleet.stop()
    print(f"\nanswers identical to the first answer of their prompt: "
          f"{references.identical}/{references.checked}")
    if references.mismatches:
        incomplete = [m for m in references.mismatches if m[1].startswith("incomplete")]
        print(f"  not identical: {len(references.mismatches) - len(incomplete)} with other text, "
              f"{len(incomplete)} incomplete; first: {references.mismatches[:5]}")
    if pauses:
        print(f"client-visible pause of resumed requests: p50 {statistics.median(pauses):.2f} s, "
              f"max {max(pauses):.2f} s (n={len(pauses)}; heartbeat TTL {args.heartbeat_ttl_s} s)")
    if loads:
        print(f"load in the {args.load_window_s:g} s before each kill: min {min(loads):.0%}, "
              f"median {statistics.median(loads):.0%} of capacity")
    killed = statistics.median(walls)
    if calm_walls:
        calm = statistics.median(calm_walls)
        print(f"wall time of a run: median {calm:.1f} s without a kill, {killed:.1f} s with one "
              f"(ratio {killed / calm:.2f})")
    return 0 if not references.mismatches else 1


if __name__ == "__main__":
    sys.exit(main())
