"""The promised pace (issue 39), in one run on the default model at its default dtype:

    .venv/bin/python -m benchmarks.pace                  # all three parts
    .venv/bin/python -m benchmarks.pace --skip-fleet     # the engine parts only
    .venv/bin/python -m benchmarks.pace --quick          # a short try

1. **A trace at twice the pace's capacity.** The target is set from the host: 1.5 x the median
   step of one stream decoding alone, measured first (`--target-factor`). What one worker serves at that pace is
   measured next (requests/s of a paced engine given a saturating queue); the trace then sends
   Poisson arrivals at twice that (chat-like: prompts of 16-128 tokens, 64-192 output tokens,
   greedy, `ignore_eos`) for `--trace-s` seconds. The same trace runs through an engine with
   `--target-itl-ms` (the paced one), with the defaults (max_running 64, max_batched_tokens
   512), and with a sweep of fixed `--max-running` (and, as an operator tuning both by hand,
   of max_running x max_batched_tokens); reported per run: the served streams' ITL p99 (every
   gap between two tokens of a stream), TTFT p50, throughput (output tokens over the run).
   The best fixed configuration is the highest throughput whose ITL p99 meets the target.
2. **The same trace with a long-prompt burst** (`--burst` prompts of 1,500 tokens halfway
   through): the paced engine's ITL p99 (and the defaults', for contrast).
3. **Two workers, one twice as slow** (`kvfleet worker` processes behind a gateway, an
   embedded Redis; on a host with 4 cores or more the slow one has half the fast one's threads,
   each on cores of its own; on a smaller one each has one thread on a core of its own and the
   slow one is capped at half a core by a CPU cgroup, the other half of its core left to Redis,
   the gateway and the clients). The target is 1.5 x the slow worker's single-stream step. Each
   serves a closed loop of `--clients` streaming clients alone, then both together: each
   worker's ITL p99 (its own metric) and the fleet's tokens/s against the sum of each alone.

Parts 1 and 2 drive the engine in this process (`--threads` torch threads) with a wall clock,
so a request waits in the engine's queue as it would in Redis for a single worker; the engines
share one loaded model.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import torch

from kvfleet.shared.cpu_features import cpu_features
from kvfleet.shared.models import DEFAULT_MODEL, resolve_model_path
from kvfleet.shared.redis_connect import connect
from kvfleet.shared.redis_server import EmbeddedRedis
from kvfleet.shared.wire import Heartbeat, SamplingParams
from tests.helpers.processes import ProcessFleet
from kvfleet.worker.engine.engine import Engine, EngineConfig, load_pretrained
from kvfleet.worker.engine.core.pace import warm_up

VOCAB = (200, 48_000)


@dataclass
class Request:
    at: float  # seconds after the trace's start
    prompt: list[int]
    max_tokens: int


@dataclass
class Run:
    """One trace through one engine: the emission times of every stream."""

    name: str
    arrivals: dict[str, float] = field(default_factory=dict)
    emits: dict[str, list[float]] = field(default_factory=dict)
    tokens: int = 0
    seconds: float = 0.0

    def gaps(self) -> list[float]:
        return [b - a for times in self.emits.values() for a, b in zip(times, times[1:])]

    def summary(self) -> dict:
        ttft = [times[0] - self.arrivals[r] for r, times in self.emits.items() if times]
        return {"name": self.name, "itl_p99_ms": 1000 * percentile(self.gaps(), 99),
                "itl_p50_ms": 1000 * percentile(self.gaps(), 50),
                "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
                "tokens_per_s": self.tokens / self.seconds, "requests": len(self.emits)}


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(int(q / 100 * len(ordered)), len(ordered) - 1)]


def chat_trace(rate: float, seconds: float, seed: int) -> list[Request]:
    rng, at, trace = random.Random(seed), 0.0, []
    while True:
        at += rng.expovariate(rate)
        if at > seconds:
            return trace
        trace.append(Request(at, [rng.randrange(*VOCAB) for _ in range(rng.randrange(16, 129))],
                             rng.randrange(64, 193)))


def with_burst(trace: list[Request], count: int, at: float, seed: int) -> list[Request]:
    rng = random.Random(seed)
    burst = [Request(at, [rng.randrange(*VOCAB) for _ in range(1500)], 32) for _ in range(count)]
    return sorted(trace + burst, key=lambda r: r.at)


def replay(model, config: EngineConfig, trace: list[Request], name: str) -> Run:
    """The trace through a fresh engine in real time; the emission times of every stream. A
    paced engine warms up first, as a worker does (--pace-warmup)."""
    engine = Engine(model, config)
    if config.pace_warmup and engine.pace.enabled:
        warm_up(engine)
    run, pending = Run(name), deque(trace)
    t0, wall0 = time.monotonic(), time.time()
    while pending or engine.has_unfinished():
        now = time.monotonic() - t0
        while pending and pending[0].at <= now:
            request = pending.popleft()
            req_id = f"r{len(run.arrivals)}"
            run.arrivals[req_id], run.emits[req_id] = request.at, []
            engine.add_request(req_id, request.prompt,
                               SamplingParams(max_tokens=request.max_tokens, temperature=0.0,
                                              ignore_eos=True), arrival=wall0 + request.at)
        if not engine.has_unfinished():
            time.sleep(max(min(pending[0].at - now, 0.05), 0))
            continue
        outputs = engine.step()
        done = time.monotonic() - t0
        for output in outputs:
            if output.new_token_ids:
                run.emits[output.req_id].append(done)
                run.tokens += len(output.new_token_ids)
    run.seconds = time.monotonic() - t0
    return run


def single_stream_step(model, config: EngineConfig) -> float:
    """The median step of one stream decoding alone (a 100-token prompt, 64 tokens)."""
    engine = Engine(model, config)
    engine.add_request("one", list(range(300, 400)),
                       SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True))
    times = []
    while engine.has_unfinished():
        started = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - started)
    return statistics.median(times[8:])


def capacity_at_pace(model, config: EngineConfig, seconds: float) -> float:
    """Requests/s a paced engine completes given a queue that never empties (over the last
    three quarters of `seconds`)."""
    trace = chat_trace(1000.0, seconds / 20, seed=1)[:400]
    for request in trace:
        request.at = 0.0
    engine = Engine(model, config)
    if config.pace_warmup and engine.pace.enabled:
        warm_up(engine)
    for i, request in enumerate(trace):
        engine.add_request(f"c{i}", request.prompt, SamplingParams(
            max_tokens=request.max_tokens, temperature=0.0, ignore_eos=True))
    t0, finished = time.monotonic(), 0
    start = t0 + seconds / 4  # after the first answers: the ramp is not the steady rate
    while time.monotonic() - t0 < seconds and engine.has_unfinished():
        done = sum(o.finish_reason is not None for o in engine.step())
        if time.monotonic() >= start:
            finished += done
    return finished / (time.monotonic() - start)


# ---- parts 1 and 2: the engine ---------------------------------------------------------------

def engine_parts(args, log) -> dict:
    torch.set_num_threads(args.threads)
    model = load_pretrained(resolve_model_path(DEFAULT_MODEL, None), "auto", "cpu")
    base = EngineConfig(device="cpu", dtype="auto", kv_memory=1 << 30)
    step_s = single_stream_step(model, base)
    target_ms = round(args.target_factor * step_s * 1000, 1)
    paced = EngineConfig(**{**base.__dict__, "target_itl_ms": target_ms})
    log(f"single-stream step {step_s * 1000:.1f} ms -> target ITL {target_ms} ms "
        f"({args.target_factor} x)")
    capacity = capacity_at_pace(model, paced, args.capacity_s)
    rate = 2 * capacity
    log(f"a paced worker completes {capacity:.2f} requests/s; the trace: {rate:.2f}/s for "
        f"{args.trace_s:.0f} s")
    trace = chat_trace(rate, args.trace_s, seed=2)
    runs = [replay(model, paced, trace, "paced")]
    log(f"  {json.dumps(runs[-1].summary())}")
    runs.append(replay(model, base, trace, "default (64, 512)"))
    log(f"  {json.dumps(runs[-1].summary())}")
    sweep = [(n, 512) for n in args.sweep] + [(n, t) for n in args.sweep_both
                                            for t in args.sweep_tokens]
    for max_running, tokens in sweep:
        config = EngineConfig(**{**base.__dict__, "max_running": max_running,
                                 "max_batched_tokens": tokens})
        runs.append(replay(model, config, trace, f"fixed ({max_running}, {tokens})"))
        log(f"  {json.dumps(runs[-1].summary())}")
    results = [r.summary() for r in runs]
    meeting = [r for r in results[2:] if r["itl_p99_ms"] <= target_ms]
    best_running = max((r for r in meeting if r["name"].endswith(", 512)")),
                       key=lambda r: r["tokens_per_s"], default=None)
    best_any = max(meeting, key=lambda r: r["tokens_per_s"], default=None)
    burst_trace = with_burst(trace, args.burst, args.trace_s / 2, seed=3)
    burst = [replay(model, paced, burst_trace, "paced + burst").summary(),
             replay(model, base, burst_trace, "default + burst").summary()]
    for r in burst:
        log(f"  {json.dumps(r)}")
    return {"single_step_ms": step_s * 1000, "target_itl_ms": target_ms,
            "capacity_rps": capacity, "trace_rps": rate, "trace_requests": len(trace),
            "runs": results, "best_fixed_running": best_running, "best_fixed_any": best_any,
            "burst": burst}


# ---- part 3: two workers, one twice as slow ------------------------------------------------------

def pin(pid: int, cpus: str) -> None:
    subprocess.run(["taskset", "-a", "-p", "-c", cpus, str(pid)], check=True,
                   stdout=subprocess.DEVNULL)


class CpuCap:
    """A CPU cgroup (v2, else v1) capping its processes at `share` of one CPU."""

    def __init__(self, share: float, period_us: int = 20_000):
        self.path = None
        name = f"kvfleet-pace-{os.getpid()}"
        quota = int(share * period_us)
        v2 = Path("/sys/fs/cgroup/cgroup.controllers")
        try:
            if v2.exists():
                self.path = Path("/sys/fs/cgroup") / name
                self.path.mkdir()
                (self.path / "cpu.max").write_text(f"{quota} {period_us}")
                self.procs = self.path / "cgroup.procs"
            else:
                self.path = Path("/sys/fs/cgroup/cpu") / name
                self.path.mkdir()
                (self.path / "cpu.cfs_period_us").write_text(str(period_us))
                (self.path / "cpu.cfs_quota_us").write_text(str(quota))
                self.procs = self.path / "cgroup.procs"
        except OSError as exc:
            raise SystemExit(f"part 3 needs a CPU cgroup on a host with < 4 cores ({exc}); "
                             "run with --skip-fleet") from None

    def add(self, pid: int) -> None:
        self.procs.write_text(str(pid))

    def close(self) -> None:
        if self.path is not None:
            try:
                self.path.rmdir()
            except OSError:
                pass


class ClosedLoop:
    """`clients` threads each streaming one completion after another; tokens received."""

    def __init__(self, url: str, clients: int, seed: int):
        self.url, self.stop_at = url, float("inf")
        self.received: list[float] = []  # monotonic arrival of each content chunk
        self.errors: list[str] = []
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._client, args=(seed + i,), daemon=True)
                        for i in range(clients)]

    def _client(self, seed: int) -> None:
        rng = random.Random(seed)
        while time.monotonic() < self.stop_at:
            body = {"model": DEFAULT_MODEL, "prompt": [rng.randrange(*VOCAB) for _ in
                                                        range(rng.randrange(16, 129))],
                    "max_tokens": rng.randrange(64, 193), "temperature": 0, "ignore_eos": True,
                    "stream": True}
            try:
                with httpx.stream("POST", f"{self.url}/v1/completions", json=body,
                                  timeout=600) as response:
                    if response.status_code != 200:
                        self.errors.append(f"HTTP {response.status_code}")
                        time.sleep(0.5)
                        continue
                    for line in response.iter_lines():
                        if line.startswith("data: {") and '"text":"' in line.replace(" ", ""):
                            with self.lock:
                                self.received.append(time.monotonic())
            except httpx.HTTPError as exc:
                self.errors.append(repr(exc))

    def run(self, warmup_s: float, seconds: float) -> float:
        """Tokens/s received over `seconds` after `warmup_s`."""
        for thread in self.threads:
            thread.start()
        t0 = time.monotonic() + warmup_s
        t1 = t0 + seconds
        self.stop_at = t1
        time.sleep(max(t1 - time.monotonic(), 0))
        with self.lock:
            count = sum(t0 <= t < t1 for t in self.received)
        return count / seconds


def metric(url: str, name: str) -> float:
    """A series' value from a worker's /metrics (summed over its labels)."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in httpx.get(url, timeout=10).text.splitlines()
               if line.startswith(name + "{"))


def fleet_part(args, log) -> dict:
    cores = os.cpu_count() or 1
    threads_mode = cores >= 4
    log(f"part 3: {'threads' if threads_mode else 'one core each, the slow one capped at 50%'}")
    cap = None if threads_mode else CpuCap(0.5)
    # Redis, the gateway and this process's clients on the cores no worker has (on a 2-core
    # host the slow worker's core, whose other half its cap leaves to them)
    affinity = os.sched_getaffinity(0)
    os.sched_setaffinity(0, set(range(3, cores)) if threads_mode else {1})
    server = EmbeddedRedis().start()
    log_dir = Path(tempfile.mkdtemp(prefix="kvfleet-pace-"))
    common = ["--kv-memory", "1GiB", "--dtype", "auto", "--max-running", "64"]

    def start(fleet: ProcessFleet, name: str, target_ms: float | None):
        fast = name == "fast"
        fleet.worker_flags = [*common, "--num-threads", "2" if fast and threads_mode else "1"]
        if target_ms:
            fleet.worker_flags += ["--target-itl-ms", str(target_ms)]
        proc = fleet.start_worker(name)
        if threads_mode:
            pin(proc.popen.pid, "0-1" if fast else "2")
        else:
            pin(proc.popen.pid, "0" if fast else "1")
            if not fast:
                cap.add(proc.popen.pid)
        return proc

    def beat(fleet, name) -> Heartbeat:
        client = connect(server.url)
        try:
            return Heartbeat.decode(client.hgetall(fleet.keys.worker(name)))
        finally:
            client.close()

    def serve(names: list[str], target_ms: float) -> dict:
        fleet = ProcessFleet(server.url, log_dir, gateway_flags=["--max-queue-wait-s", "0"])
        try:
            fleet.start_gateway()
            for name in names:
                start(fleet, name, target_ms)
            loop = ClosedLoop(fleet.url, args.clients, seed=len(names))
            rate = loop.run(args.fleet_warmup_s, args.fleet_s)
            # each worker's own p99 over its last minute (the heartbeat's, exact)
            beats = {n: beat(fleet, n) for n in names}
            return {"tokens_per_s": rate, "errors": len(loop.errors),
                    "itl_p99_ms": {n: b.itl_p99_ms for n, b in beats.items()},
                    "pace_streams": {n: b.pace_streams for n, b in beats.items()}}
        finally:
            fleet.stop()

    def slow_step_ms() -> float:
        """The slow worker's mean time between tokens of one stream alone (its own metric)."""
        fleet = ProcessFleet(server.url, log_dir)
        try:
            fleet.start_gateway()
            start(fleet, "slow", None)
            url = beat(fleet, "slow").metrics_url
            body = {"model": DEFAULT_MODEL, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
            httpx.post(f"{fleet.url}/v1/completions", timeout=600,
                       json=body | {"prompt": list(range(300, 400))})  # kernels warm
            before = [metric(url, "kvfleet_worker_itl_seconds_" + k) for k in ("sum", "count")]
            httpx.post(f"{fleet.url}/v1/completions", timeout=600,
                       json=body | {"prompt": list(range(400, 500)), "max_tokens": 96})
            after = [metric(url, "kvfleet_worker_itl_seconds_" + k) for k in ("sum", "count")]
            return 1000 * (after[0] - before[0]) / (after[1] - before[1])
        finally:
            fleet.stop()

    try:
        step_ms = slow_step_ms()
        target_ms = round(1.5 * step_ms, 1)
        log(f"slow worker's single-stream step {step_ms:.1f} ms -> target {target_ms} ms")
        alone = {name: serve([name], target_ms) for name in ("fast", "slow")}
        for name, result in alone.items():
            log(f"  {name} alone: {json.dumps(result)}")
        both = serve(["fast", "slow"], target_ms)
        log(f"  both: {json.dumps(both)}")
        total = sum(r["tokens_per_s"] for r in alone.values())
        return {"target_itl_ms": target_ms, "alone": alone, "both": both,
                "fleet_over_sum": both["tokens_per_s"] / total if total else float("nan")}
    finally:
        server.stop()
        os.sched_setaffinity(0, affinity)
        if cap is not None:
            cap.close()


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=min(torch.get_num_threads(), 2))
    parser.add_argument("--target-factor", type=float, default=1.5,
                        help="the ITL target over the single-stream step (parts 1 and 2)")
    parser.add_argument("--trace-s", type=float, default=40.0)
    parser.add_argument("--capacity-s", type=float, default=40.0)
    parser.add_argument("--sweep", type=int, nargs="*", default=[1, 2, 3, 4, 6, 8])
    parser.add_argument("--sweep-both", type=int, nargs="*", default=[3, 4, 6])
    parser.add_argument("--sweep-tokens", type=int, nargs="*", default=[8, 16])
    parser.add_argument("--burst", type=int, default=4)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--fleet-s", type=float, default=60.0)
    parser.add_argument("--fleet-warmup-s", type=float, default=15.0)
    parser.add_argument("--skip-fleet", action="store_true")
    parser.add_argument("--skip-engine", action="store_true")
    parser.add_argument("--quick", action="store_true", help="short runs, a smaller sweep")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args(argv)
    if args.quick:
        args.trace_s, args.capacity_s, args.sweep, args.sweep_both = 15.0, 15.0, [1, 4], []
        args.fleet_s, args.fleet_warmup_s = 20.0, 8.0
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    features = cpu_features()
    log = lambda line: print(line, flush=True)  # noqa: E731
    log(f"# {datetime.date.today()}; CPU {features.describe()}; {os.cpu_count()} cores")
    results = {"date": str(datetime.date.today()), "cpu": features.describe()}
    if not args.skip_engine:
        engine = results["engine"] = engine_parts(args, log)
        target = engine["target_itl_ms"]
        paced = engine["runs"][0]
        default = engine["runs"][1]
        log(f"\ntarget ITL {target} ms ({args.target_factor} x {engine['single_step_ms']:.1f} ms)")
        log(f"paced:   ITL p99 {paced['itl_p99_ms']:.1f} ms, {paced['tokens_per_s']:.1f} tok/s, "
            f"TTFT p50 {paced['ttft_p50_s']:.2f} s")
        log(f"default: ITL p99 {default['itl_p99_ms']:.1f} ms, "
            f"{default['tokens_per_s']:.1f} tok/s (meets: {default['itl_p99_ms'] <= target})")
        for key, label in (("best_fixed_running", "best fixed --max-running"),
                           ("best_fixed_any", "best fixed (max_running, max_batched_tokens)")):
            best = engine[key]
            if best:
                log(f"{label} meeting it: {best['name']} {best['tokens_per_s']:.1f} tok/s -> "
                    f"paced / best = {paced['tokens_per_s'] / best['tokens_per_s']:.2f}x")
            else:
                log(f"{label}: none meets the target")
        burst = engine["burst"]
        log(f"with a burst of {args.burst} x 1500-token prompts: paced ITL p99 "
            f"{burst[0]['itl_p99_ms']:.1f} ms, default {burst[1]['itl_p99_ms']:.1f} ms")
    if not args.skip_fleet:
        fleet = results["fleet"] = fleet_part(args, log)
        log(f"\ntwo workers at {fleet['target_itl_ms']} ms: fleet {fleet['both']['tokens_per_s']:.1f}"
            f" tok/s = {fleet['fleet_over_sum']:.2f}x the sum alone; ITL p99 by worker "
            f"{fleet['both']['itl_p99_ms']}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
