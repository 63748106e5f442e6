"""One numerics fingerprint per machine kind (issue 53): N `kvfleet worker` processes started at
once, on a host whose every core is kept busy by spinning processes, and the fingerprints their
heartbeats report:

    .venv/bin/python -m benchmarks.numerics_fleet                      # 16 workers, default model
    .venv/bin/python -m benchmarks.numerics_fleet --workers 4 --model random:llama-3.2-1b

The workers run at the defaults users get (`--dtype auto`, `--deterministic`), one torch thread
each, 128 MiB of KV, on an embedded Redis. Prints each fingerprint with the workers reporting
it and what it stands for (the start-up log's `numerics` line); exits 1 unless every worker
reported one and the same. Before the bf16 product form was chosen by rule, a timing at start-up
could make workers of one host choose either form.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import redis

from kvfleet.shared.cpu_features import cpu_features
from kvfleet.shared.redis_server import EmbeddedRedis
from kvfleet.shared.wire import Keys


def _spin(stop) -> None:
    while not stop.is_set():
        sum(i * i for i in range(10_000))


def start_workers(url: str, count: int, model: str, logs: Path) -> list[subprocess.Popen]:
    env = {**os.environ, "KVFLEET_REDIS_URL": url}
    procs = []
    for i in range(count):
        log = open(logs / f"w{i}.log", "wb")
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "kvfleet", "worker", "--worker-id", f"w{i}", "--model", model,
             "--kv-memory", "128MiB", "--num-threads", "1", "--metrics-port", "-1"],
            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
    return procs


def wait_for_fingerprints(client: redis.Redis, count: int, procs, timeout_s: float) -> dict:
    """worker id -> the numerics field of its heartbeat, once every worker beats."""
    keys, deadline = Keys(), time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = {f"w{i}": client.hget(keys.worker(f"w{i}"), "numerics") for i in range(count)}
        if all(v is not None for v in found.values()):
            return {w: v.decode() for w, v in found.items()}
        if any(p.poll() is not None for p in procs):
            raise SystemExit("a worker exited early: see its log")
        time.sleep(0.5)
    raise SystemExit(f"not every worker beat within {timeout_s} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=16)
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--spinners", type=int, default=os.cpu_count() or 2,
                        help="processes keeping the cores busy meanwhile")
    parser.add_argument("--timeout-s", type=float, default=900)
    args = parser.parse_args()
    print(f"CPU: {cpu_features().describe()}; {os.cpu_count()} cores; {args.workers} workers "
          f"started at once beside {args.spinners} spinning processes")
    context = multiprocessing.get_context("spawn")
    stop = context.Event()
    spinners = [context.Process(target=_spin, args=(stop,)) for _ in range(args.spinners)]
    for spinner in spinners:
        spinner.start()
    with EmbeddedRedis() as server, tempfile.TemporaryDirectory() as logs_dir:
        logs = Path(logs_dir)
        started = time.monotonic()
        procs = start_workers(server.url, args.workers, args.model, logs)
        try:
            prints = wait_for_fingerprints(redis.Redis.from_url(server.url), args.workers, procs,
                                           args.timeout_s)
        finally:
            stop.set()
            for proc in procs:
                proc.kill()
            for spinner in spinners:
                spinner.join(timeout=10)
        print(f"all {args.workers} heartbeats in {time.monotonic() - started:.0f} s")
        by_print = defaultdict(list)
        for worker, fingerprint in sorted(prints.items(), key=lambda kv: int(kv[0][1:])):
            by_print[fingerprint].append(worker)
        for fingerprint, workers in by_print.items():
            log = (logs / f"{workers[0]}.log").read_text(errors="replace")
            described = re.search(r"numerics (fp_\w+ \(.*\))", log)
            print(f"{fingerprint}: {len(workers)} workers ({', '.join(workers)})")
            print(f"  {described[1] if described else '(no start-up line found)'}")
    print(f"fingerprints: {len(by_print)} (target: 1)")
    sys.exit(0 if len(by_print) == 1 else 1)


if __name__ == "__main__":
    main()
