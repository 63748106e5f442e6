"""Sustained overload without false failovers: two workers whose prefill steps take longer than
the heartbeat TTL, fed for `--minutes` by closed-loop clients asking about twice what the fleet
holds at once. No worker dies, so every takeover would be a false one.

    OMP_WAIT_POLICY=PASSIVE GOMP_SPINCOUNT=10000 .venv/bin/python -m benchmarks.overload --minutes 10

Workers (the issue's reproduction): `--max-batched-tokens 8192 --heartbeat-ttl-s 2`, 1 torch thread
and `--kv-memory 512MiB` each (about 11k tokens of the default model in fp32: ~5 of these prompts
per worker). Clients: `--concurrency` streamed completions of random token-id prompts of 1,000 to
3,000 tokens, `--max-tokens` greedy output tokens each; the gateway's wait-based 429 is off, so
the excess waits in the stream. Reported: requests completed, takeovers counted by the workers
(`kvfleet_worker_takeovers_total`), requests whose fencing `attempt` is above 1, engine steps
longer than the TTL (from `kvfleet_worker_step_duration_seconds`), and the overload factor
(clients / streams running, sampled every 2 s).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import redis

from benchmarks.fleet_load import start_two_workers
from kvfleet.shared.models import DEFAULT_MODEL
from kvfleet.shared.redis_server import EmbeddedRedis
from kvfleet.shared.wire import Heartbeat, Keys, RequestRecord
from tests.helpers.processes import ProcessFleet


def completion(url: str, prompt: list[int], max_tokens: int) -> tuple[str, int, str | None]:
    """(request id, completion tokens, error) of one streamed completion."""
    body = {"model": DEFAULT_MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "temperature": 0, "ignore_eos": True, "stream_options": {"include_usage": True}}
    req_id, tokens, error = "", 0, None
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=1800) as response:
            if response.status_code != 200:
                return "", 0, f"HTTP {response.status_code}"
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    req_id = req_id or chunk.get("id", "")
                    error = error or (str(chunk["error"]) if "error" in chunk else None)
                    if chunk.get("usage"):
                        tokens = chunk["usage"]["completion_tokens"]
    except httpx.HTTPError as exc:
        error = f"{type(exc).__name__}: {exc}"
    return req_id, tokens, error


def worker_metric(url: str, name: str) -> dict[str, float]:
    """Samples of one metric family from a worker's /metrics: {suffix+labels: value}."""
    text = httpx.get(url, timeout=10).text
    return {m[1]: float(m[2]) for m in re.finditer(rf"^{name}(\S*) (\S+)$", text, re.M)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--concurrency", type=int, default=24)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--heartbeat-ttl-s", type=float, default=2.0)
    args = parser.parse_args()
    flags = ["--kv-memory", "512MiB", "--num-threads", "1", "--max-batched-tokens", "8192",
             "--heartbeat-ttl-s", str(args.heartbeat_ttl_s)]
    os.environ["KVFLEET_MAX_QUEUE_WAIT_S"] = "0"  # the gateway queues instead of answering 429
    rng = random.Random(17)
    results: list[tuple[str, int, str | None]] = []
    running, waiting, queued = [], [], []
    stop = threading.Event()
    with EmbeddedRedis() as server, tempfile.TemporaryDirectory() as logs:
        fleet = ProcessFleet(server.url, Path(logs), worker_flags=flags)
        client = redis.Redis.from_url(server.url)
        keys = Keys(fleet.prefix)
        try:
            start_two_workers(fleet)
            metrics_urls = [Heartbeat.decode(client.hgetall(keys.worker(w))).metrics_url
                            for w in ("a", "b")]

            def client_loop() -> None:
                while not stop.is_set():
                    prompt = [rng.randrange(100, 40000) for _ in range(rng.randint(1000, 3000))]
                    results.append(completion(fleet.url, prompt, args.max_tokens))

            def monitor() -> None:
                stream = keys.queue(DEFAULT_MODEL)
                while not stop.wait(2.0):
                    beats = [Heartbeat.decode(client.hgetall(keys.worker(w))) for w in "ab"]
                    running.append(sum(b.running for b in beats))
                    waiting.append(sum(b.waiting for b in beats))
                    groups = client.xinfo_groups(stream) if client.exists(stream) else []
                    queued.append(sum(int(g.get("lag") or 0) for g in groups))

            threads = [threading.Thread(target=client_loop) for _ in range(args.concurrency)]
            threads.append(threading.Thread(target=monitor))
            started = time.monotonic()
            for thread in threads:
                thread.start()
            while time.monotonic() - started < args.minutes * 60:
                time.sleep(30)
                print(f"{(time.monotonic() - started) / 60:4.1f} min: {len(results)} done, "
                      f"running {running[-1] if running else '-'}, queued "
                      f"{queued[-1] if queued else '-'}", flush=True)
            stop.set()
            for thread in threads:
                thread.join(timeout=1800)
            takeovers = sum(sum(worker_metric(u, "kvfleet_worker_takeovers_total").values())
                            for u in metrics_urls)
            steps = [worker_metric(u, "kvfleet_worker_step_duration_seconds_bucket")
                     for u in metrics_urls]
            ttl = args.heartbeat_ttl_s
            # The smallest histogram bound at or above the TTL: steps beyond it surely exceed it.
            bound = min(float(le) for le in re.findall(r'le="([0-9.]+)"', " ".join(steps[0]))
                        if float(le) >= ttl)
            total_steps = sum(v for s in steps for k, v in s.items() if 'le="+Inf"' in k)
            within = sum(v for s in steps for k, v in s.items()
                         if re.search(r'le="([0-9.]+)"', k) and
                         float(re.search(r'le="([0-9.]+)"', k)[1]) == bound)
            attempts = [int(client.hget(keys.request(r), RequestRecord.ATTEMPT) or 0)
                        for r, _, _ in results if r]
        finally:
            stop.set()
            fleet.stop()
    errors = [e for _, _, e in results if e]
    complete = [t for _, t, e in results if not e and t == args.max_tokens]
    mean_running = statistics.mean(running) if running else 0
    print(f"\n{args.minutes:g} min, {args.concurrency} clients: {len(complete)} requests complete, "
          f"{len(errors)} errors {errors[:3]}")
    print(f"overload: mean running {mean_running:.1f}, admitted but waiting "
          f"{statistics.mean(waiting):.1f}, queued in the stream {statistics.mean(queued):.1f} -> "
          f"clients / running = {args.concurrency / max(mean_running, 1e-9):.2f}x")
    print(f"engine steps longer than {bound:g} s (heartbeat TTL {ttl:g} s): "
          f"{total_steps - within:.0f} of {total_steps:.0f}")
    print(f"takeovers counted by the workers: {takeovers:.0f}; requests with attempt > 1: "
          f"{sum(a > 1 for a in attempts)} of {len(attempts)}")
    return 0 if takeovers == 0 and not any(a > 1 for a in attempts) and not errors else 1


if __name__ == "__main__":
    sys.exit(main())
