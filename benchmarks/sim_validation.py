"""The simulator against the real thing (issue 51, item 5): simulated workers fed a real CPU
worker's measured step cost, against those real CPU workers, on the same trace.

    .venv/bin/python -m benchmarks.sim_validation                       # 1 and 3 workers
    .venv/bin/python -m benchmarks.sim_validation --workers 1 --requests 32 --rate 0.8

For each worker count W: a real fleet (`kvfleet up --workers W`, the default model on this CPU, an
embedded Redis) serves a seeded trace of Poisson arrivals (`--rate` requests/s; prompts of
`--prompt-tokens` random words, lengths uniform over the range; `--output-tokens` answers with
ignore_eos) through its gateway; then every worker's fitted step cost is read from its heartbeat
(shared/pace.py's curve, fitted on the trace's own steps), their coefficients averaged, and a
simulated fleet (`kvfleet up --sim-workers W --sim-step-cost <that curve>`, the same model's
config and tokenizer, the same KV memory and block size) serves the same trace. Printed side by
side: output tokens/s, TTFT p50/p90 and ITL p50/p99 of each, and the simulated over the real.
The targets (issue 51): within 10% on throughput and 20% on the latencies, at 1 and 3 workers.
Both fleets run on this host; the simulated one at time scale 1 (it keeps up with a CPU worker's
steps). The real workers share the host's cores with the gateway, Redis and the client, which their
measured curve includes; the simulated workers' own loop runs for real (its overhead is not the
curve's).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import redis

from kvfleet.bench.client import BenchTarget
from kvfleet.bench.loadgen import LoadSpec, replay
from kvfleet.bench.stats import Slo, Summary, summarise
from kvfleet.bench.trace import TraceRequest
from kvfleet.shared.models import DEFAULT_MODEL
from kvfleet.shared.pace import COEFFICIENTS, StepCostCurve
from kvfleet.shared.redis_server import EmbeddedRedis, free_port
from kvfleet.shared.wire import Heartbeat, Keys

WORDS = ("river", "stone", "market", "window", "garden", "signal", "copper", "lantern", "harbor",
         "meadow", "engine", "violet", "canyon", "ledger", "orbit", "thistle")
THROUGHPUT_TOLERANCE = 0.10
LATENCY_TOLERANCE = 0.20


def make_trace(requests: int, rate: float, prompt_tokens: tuple[int, int], output_tokens: int,
               seed: int) -> list[TraceRequest]:
    """Poisson arrivals at `rate`; prompts of random common words (about a token each)."""
    rng = random.Random(seed)
    trace, t = [], 0.0
    for _ in range(requests):
        words = rng.randint(*prompt_tokens)
        trace.append(TraceRequest(t, " ".join(rng.choice(WORDS) for _ in range(words)),
                                  output_tokens, ignore_eos=True))
        t += rng.expovariate(rate)
    return trace


def mean_curve(curves: list[StepCostCurve]) -> StepCostCurve:
    """The workers' curves averaged coefficient by coefficient (each a fit of the same kind of
    steps on the same host)."""
    if not curves:
        raise ValueError("no worker has a fitted step cost")
    fields = {name: sum(getattr(c, name) for c in curves) / len(curves) for name in COEFFICIENTS}
    return StepCostCurve(**fields, steps=min(c.steps for c in curves))


@dataclass(frozen=True)
class Side:
    name: str
    summary: Summary


def compare(real: Summary, sim: Summary) -> list[tuple[str, float | None, float | None,
                                                      float | None, bool | None]]:
    """(figure, real, simulated, simulated / real, within its tolerance) rows."""
    rows = []
    figures = [("output tok/s", real.output_tokens_per_s, sim.output_tokens_per_s,
                THROUGHPUT_TOLERANCE),
               ("TTFT p50 s", real.ttft_s.p50, sim.ttft_s.p50, LATENCY_TOLERANCE),
               ("TTFT p90 s", real.ttft_s.p90, sim.ttft_s.p90, LATENCY_TOLERANCE),
               ("ITL p50 s", real.itl_s.p50, sim.itl_s.p50, LATENCY_TOLERANCE),
               ("ITL p99 s", real.itl_s.p99, sim.itl_s.p99, LATENCY_TOLERANCE)]
    for name, a, b, tolerance in figures:
        ratio = b / a if a and b is not None else None
        rows.append((name, a, b, ratio, None if ratio is None else abs(ratio - 1) <= tolerance))
    return rows


class Fleet:
    """`kvfleet up` on its own embedded Redis, stopped with Ctrl-C's signal."""

    def __init__(self, flags: list[str], workers: int, log: Path):
        self.redis = EmbeddedRedis(port=free_port()).start()
        self.port = free_port()
        self.keys = Keys("kvf:")
        self.workers = workers
        self.log = open(log, "w")
        env = {**os.environ, "KVFLEET_REDIS_URL": self.redis.url}
        self.proc = subprocess.Popen([sys.executable, "-m", "kvfleet", "up", "--port",
                                      str(self.port), *flags], env=env, stdout=self.log,
                                     stderr=subprocess.STDOUT)
        self.client = redis.Redis.from_url(self.redis.url)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def beats(self) -> list[Heartbeat]:
        return [Heartbeat.decode(self.client.hgetall(k))
                for k in self.client.scan_iter(self.keys.worker("*"))]

    def wait_ready(self, timeout_s: float = 600) -> None:
        deadline = time.monotonic() + timeout_s
        while len(self.beats()) < self.workers or not _healthy(self.url):
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise SystemExit(f"the fleet did not come up: see {self.log.name}")
            time.sleep(1.0)

    def stop(self) -> None:
        self.proc.send_signal(2)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()
        self.redis.stop()


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


async def run_trace(url: str, trace: list[TraceRequest], workers: int) -> Summary:
    target = BenchTarget(model=DEFAULT_MODEL, endpoint="completions", timeout_s=600)
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        result = await replay(client, target, trace, LoadSpec(rate=1.0))
    return summarise(result, Slo(), workers, None)


def validate(args, workers: int, trace: list[TraceRequest], log_dir: Path) -> tuple[Side, Side]:
    common = ["--model", DEFAULT_MODEL, "--kv-memory", args.kv_memory]
    real = Fleet([*common, "--workers", str(workers)], workers, log_dir / f"real-{workers}.log")
    try:
        real.wait_ready()
        real_summary = asyncio.run(run_trace(real.url, trace, workers))
        time.sleep(2.5)  # every worker's heartbeat after its last step
        beats = [b for b in real.beats() if b.step_cost]
        curve = mean_curve([StepCostCurve.from_json(b.step_cost) for b in beats])
        block_size = beats[0].block_size
    finally:
        real.stop()
    curve_file = log_dir / f"curve-{workers}.json"
    curve_file.write_text(curve.to_json())
    print(f"{workers} worker(s): measured step cost {curve.to_json()}", flush=True)
    sim = Fleet([*common, "--sim-workers", str(workers), "--sim-step-cost", str(curve_file),
                 "--block-size", str(block_size)], workers, log_dir / f"sim-{workers}.log")
    try:
        sim.wait_ready()
        sim_summary = asyncio.run(run_trace(sim.url, trace, workers))
        lagged = sum(b.sim_lagged_steps for b in sim.beats())
        steps = sum(b.sim_steps for b in sim.beats())
        print(f"{workers} simulated worker(s): {steps} steps, {lagged} lagged", flush=True)
    finally:
        sim.stop()
    return Side("real", real_summary), Side("simulated", sim_summary)


def report(workers: int, real: Summary, sim: Summary) -> str:
    lines = [f"{workers} worker(s): {real.num_ok}/{real.num_requests} real, "
             f"{sim.num_ok}/{sim.num_requests} simulated requests answered",
             "| figure | real CPU worker | simulated (its curve) | simulated / real | within |",
             "|---|---:|---:|---:|---|"]
    for name, a, b, ratio, ok in compare(real, sim):
        def cell(v):
            return "-" if v is None else f"{v:,.3f}"
        verdict = "-" if ok is None else ("yes" if ok else "NO")
        lines.append(f"| {name} | {cell(a)} | {cell(b)} | "
                     f"{'-' if ratio is None else f'{ratio:.2f}'} | {verdict} |")
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", default="1,3", help="comma-separated worker counts")
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--rate", type=float, default=1.0, help="requests/s (Poisson)")
    parser.add_argument("--prompt-tokens", default="64-384", help="range A-B of prompt words")
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--kv-memory", default="1GiB")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    low, high = (int(x) for x in args.prompt_tokens.split("-"))
    trace = make_trace(args.requests, args.rate, (low, high), args.output_tokens, args.seed)
    log_dir = Path(tempfile.mkdtemp(prefix="sim-validation-"))
    reports, failed = [], False
    for workers in (int(x) for x in args.workers.split(",")):
        real, sim = validate(args, workers, trace, log_dir)
        failed |= real.summary.num_errors > 0 or sim.summary.num_errors > 0
        reports.append(report(workers, real.summary, sim.summary))
        print(reports[-1], flush=True)
    print()
    print("\n\n".join(reports))
    print(f"logs: {log_dir}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
