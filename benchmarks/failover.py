"""Failover benchmark: the pause a client sees when the worker serving it is SIGKILLed, whether its
text stays identical to an uninterrupted run, and what the kill costs in throughput.

    .venv/bin/python -m benchmarks.failover --trials 5 --requests 8 --max-tokens 120

Each trial: 2 workers serve N streamed greedy requests; once every request has tokens, the worker
serving most of them is SIGKILLed and a replacement started afterwards. Reported: per-request pause
(largest gap between content chunks) of resumed requests, p50 and max over all trials; fraction of
requests whose text equals the uninterrupted reference; median wall time of runs with a kill vs
runs without one (each trial runs both, after one warm-up run).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import redis

from shared.models import DEFAULT_MODEL
from shared.redis_server import EmbeddedRedis
from tests.helpers.processes import ProcessFleet


def body(i: int, max_tokens: int) -> dict:
    return {"model": DEFAULT_MODEL, "stream": True, "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0,
            "messages": [{"role": "user", "content": f"Tell story number {i} about a lighthouse."}]}


def stream(url: str, payload: dict, record: dict) -> None:
    pieces, times = [], []
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=payload, timeout=900) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                record.setdefault("id", chunk.get("id"))
                for choice in chunk.get("choices", []):
                    if choice["delta"].get("content"):
                        pieces.append(choice["delta"]["content"])
                        times.append(time.monotonic())
    record["text"], record["times"] = "".join(pieces), times


def run(url: str, n: int, max_tokens: int, during=None) -> tuple[list[dict], float]:
    records = [dict() for _ in range(n)]
    threads = [threading.Thread(target=stream, args=(url, body(i, max_tokens), records[i]))
               for i in range(n)]
    start = time.monotonic()
    for t in threads:
        t.start()
    if during:
        during(records)
    for t in threads:
        t.join()
    return records, time.monotonic() - start


def kill_busiest(fleet: ProcessFleet, client: redis.Redis, records: list[dict]) -> str:
    """Once every request streams, SIGKILL the worker that owns most of them."""
    while True:
        ids = [r.get("id") for r in records]
        if all(ids):
            owners = [client.hget(f"{fleet.prefix}req:{i}", "worker") for i in ids]
            done = [client.strlen(f"{fleet.prefix}req:{i}:ckpt") // 4 for i in ids]
            if min(done) >= 5 and all(owners):
                victim_id = max(set(owners), key=owners.count).decode()
                fleet.workers.pop(victim_id).kill()
                return victim_id
        time.sleep(0.02)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=120)
    parser.add_argument("--heartbeat-ttl-s", type=float, default=2.0)
    parser.add_argument("--no-calm", action="store_true",
                        help="kill runs only (no throughput comparison): more trials per minute")
    args = parser.parse_args()
    flags = ["--kv-memory", "512MiB", "--num-threads", "1", "--heartbeat-ttl-s",
             str(args.heartbeat_ttl_s), "--heartbeat-interval-s", "0.5"]
    with EmbeddedRedis() as server, tempfile.TemporaryDirectory() as logs:
        fleet = ProcessFleet(server.url, Path(logs), worker_flags=flags)
        client = redis.Redis.from_url(server.url)
        try:
            fleet.start_gateway()
            for name in ("a", "b"):
                fleet.start_worker(name)
            # The first run warms up (and fills the prefix cache) and gives the reference texts.
            reference, _ = run(fleet.url, args.requests, args.max_tokens)
            pauses, identical, walls, calm_walls = [], 0, [], []
            for trial in range(args.trials):
                if not args.no_calm:
                    calm_walls.append(run(fleet.url, args.requests, args.max_tokens)[1])
                records, wall_s = run(fleet.url, args.requests, args.max_tokens,
                                      during=lambda recs: kill_busiest(fleet, client, recs))
                walls.append(wall_s)
                for got, want in zip(records, reference):
                    identical += got["text"] == want["text"]
                    attempt = client.hget(f"{fleet.prefix}req:{got['id']}", "attempt")
                    if attempt not in (b"1", None) and len(got["times"]) > 1:
                        gaps = [b - a for a, b in zip(got["times"], got["times"][1:])]
                        pauses.append(max(gaps))
                fleet.start_worker(f"spare{trial}")  # two workers again for the next trial
                print(f"trial {trial + 1}: {wall_s:.1f} s with a kill; resumed so far "
                      f"{len(pauses)}, identical so far {identical}", flush=True)
        finally:
            fleet.stop()
    total = args.trials * args.requests
    print(f"\nrequests identical to the uninterrupted run: {identical}/{total}")
    if pauses:
        print(f"client-visible pause of resumed requests: p50 {statistics.median(pauses):.2f} s, "
              f"max {max(pauses):.2f} s (n={len(pauses)}; heartbeat TTL {args.heartbeat_ttl_s} s)")
    killed = statistics.median(walls)
    if calm_walls:
        calm = statistics.median(calm_walls)
        print(f"wall time of a run: median {calm:.1f} s without a kill, {killed:.1f} s with one "
              f"(ratio {killed / calm:.2f})")
    return 0 if identical == total else 1


if __name__ == "__main__":
    sys.exit(main())
