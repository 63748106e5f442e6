"""Prefill apart from decode against both on every worker, on simulated workers (issue 51, item
7: "prefill/decode apart vs both (a prompt burst into steady decoding)"; target: the decoding
streams' ITL p99 during the burst at most 1.5x calm with prefill and decode apart).

    .venv/bin/python -m benchmarks.sim_roles                  # 16 H100s, Llama-3.1-8B
    .venv/bin/python -m benchmarks.sim_roles --workers 16 --burst 96 --burst-prompt-tokens 6000

Two fleets of `--workers` simulated workers in turn, each on its own embedded Redis with one
gateway: every worker `--role both` (one `kvfleet worker --sim-workers N` process), then half
`--role prefill` and half `--role decode` (two processes; the prefill workers hand each stream
to a decode worker after its first token, with its KV's modelled size: worker/sim/engine.py's
SimMoves). On each: `--streams` steady streams decode long answers (a short prompt, `--steady-
output-tokens`); once they all decode, a burst of `--burst` long prompts (`--burst-prompt-
tokens`, short answers) arrives at once. The steady streams' inter-token gaps are split by when
they ended: calm (before the burst) and burst (from the burst's send to its last first token);
their p99s, in modelled time, and burst / calm. Also the burst's TTFT p50/p90, and the lag.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from benchmarks.sim_fleet import SimFleet, StepCounts, kvfleet, step_counts
from benchmarks.sim_scale import prompt_text
from kvfleet.bench.client import BenchTarget, RequestRecord, stream_request
from kvfleet.bench.stats import distribution
from kvfleet.bench.trace import TraceRequest
from kvfleet.shared.redis_server import free_port

TARGET_RATIO = 1.5


@dataclass(frozen=True)
class RolesResult:
    fleet: str
    calm_itl_p99_s: float | None  # modelled
    burst_itl_p99_s: float | None
    burst_ttft_p50_s: float | None
    burst_ttft_p90_s: float | None
    failed: int
    counts: StepCounts

    @property
    def ratio(self) -> float | None:
        if not self.calm_itl_p99_s or self.burst_itl_p99_s is None:
            return None
        return self.burst_itl_p99_s / self.calm_itl_p99_s


def split_gaps(records: list[RequestRecord], burst_start_s: float, burst_end_s: float,
               calm_from_s: float) -> tuple[list[float], list[float]]:
    """The steady streams' gaps between content chunks (run seconds), by when each gap ended:
    in [calm_from, burst_start) calm, in [burst_start, burst_end] burst; the rest neither."""
    calm, burst = [], []
    for r in records:
        if r.sent_at_s is None:
            continue
        times = [r.sent_at_s + offset for offset in r.chunk_offsets_s]
        for a, b in zip(times, times[1:]):
            if calm_from_s <= b < burst_start_s:
                calm.append(b - a)
            elif burst_start_s <= b <= burst_end_s:
                burst.append(b - a)
    return calm, burst


async def burst_into_steady(url: str, model: str, args, rng: random.Random
                            ) -> tuple[list[RequestRecord], list[RequestRecord], float, float]:
    """Start the steady streams, wait until each has its first token (plus a calm spell), send
    the burst; returns (steady, burst, burst start, burst end) in run seconds."""
    target = BenchTarget(model=model, endpoint="completions", timeout_s=3600)
    start = time.perf_counter()
    steady = [RequestRecord(i, 0.0, args.steady_output_tokens) for i in range(args.streams)]
    burst = [RequestRecord(i, 0.0, args.burst_output_tokens) for i in range(args.burst)]
    async with httpx.AsyncClient(base_url=url, timeout=3600,
                                 limits=httpx.Limits(max_connections=args.streams + args.burst)
                                 ) as client:
        steady_tasks = [asyncio.create_task(stream_request(
            client, target, TraceRequest(0.0, prompt_text(args.steady_prompt_tokens, rng),
                                         args.steady_output_tokens, ignore_eos=True), r, start))
            for r in steady]
        while not all(r.chunk_offsets_s for r in steady):
            if all(t.done() for t in steady_tasks):
                break
            await asyncio.sleep(0.1)
        await asyncio.sleep(args.calm_s * args.time_scale)
        burst_start = time.perf_counter() - start
        burst_tasks = [asyncio.create_task(stream_request(
            client, target, TraceRequest(0.0, prompt_text(args.burst_prompt_tokens, rng),
                                         args.burst_output_tokens, ignore_eos=True), r, start))
            for r in burst]
        await asyncio.gather(*burst_tasks)
        firsts = [r.sent_at_s + r.ttft_s for r in burst if r.ttft_s is not None]
        burst_end = max(firsts) if firsts else time.perf_counter() - start
        for task in steady_tasks:
            task.cancel()
        await asyncio.gather(*steady_tasks, return_exceptions=True)
    return steady, burst, burst_start, burst_end


def run_fleet(args, roles: list[str], log_dir: Path) -> RolesResult:
    k = args.time_scale
    port = free_port()
    name = "+".join(roles)
    per_role = args.workers // len(roles)
    commands = {f"{name}-gateway": kvfleet("gateway", "--port", str(port),
                                           "--max-queue-wait-s", "0")}
    for role in roles:
        commands[f"{name}-{role}"] = kvfleet(
            "worker", "--sim-workers", str(per_role), "--sim-device", args.device,
            "--sim-time-scale", str(k), "--role", role, "--worker-id", role, "--metrics-port",
            "-1", "--tensor-parallel-size", str(args.tensor_parallel))
    env = {"KVFLEET_MODEL": args.model, "KVFLEET_HANDOFF_ADVERTISE_HOST": "127.0.0.1"}
    with SimFleet(commands, env, log_dir) as fleet:
        fleet.wait_ready(per_role * len(roles), [f"http://127.0.0.1:{port}"])
        before = step_counts(fleet.beats())
        steady, burst, burst_start, burst_end = asyncio.run(burst_into_steady(
            f"http://127.0.0.1:{port}", args.model, args, random.Random(args.seed)))
        time.sleep(2.5)
        counts = step_counts(fleet.beats()).since(before)
    calm_from = burst_start - args.calm_s * k
    calm, during = split_gaps(steady, burst_start, burst_end, calm_from)
    ttft = distribution([r.ttft_s / k for r in burst if r.ttft_s is not None])
    failed = sum(1 for r in burst if not r.done or r.error)
    return RolesResult(name, _p99(calm, k), _p99(during, k), ttft.p50, ttft.p90, failed, counts)


def _p99(gaps: list[float], k: float) -> float | None:
    return distribution([g / k for g in gaps]).p99


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:,.1f}"


def report(results: list[RolesResult], args) -> str:
    lines = [f"{args.workers} simulated {args.device} workers, {args.model}; {args.streams} steady "
             f"streams ({args.steady_prompt_tokens} + {args.steady_output_tokens} tokens), a "
             f"burst of {args.burst} x {args.burst_prompt_tokens} prompt tokens; time scale "
             f"{args.time_scale:g}",
             "| fleet | steady ITL p99 calm ms | during the burst ms | burst / calm | "
             "burst TTFT p50 / p90 s | burst failed | lag share |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        ratio = "-" if r.ratio is None else f"{r.ratio:.2f}"
        lag = f"{r.counts.share:.1%}" + ("" if r.counts.valid else " INVALID")
        lines.append(f"| {r.fleet} | {_ms(r.calm_itl_p99_s)} | {_ms(r.burst_itl_p99_s)} | "
                     f"{ratio} | {_s(r.burst_ttft_p50_s)} / {_s(r.burst_ttft_p90_s)} | "
                     f"{r.failed} | {lag} |")
    apart = next((r for r in results if "decode" in r.fleet), None)
    if apart is not None and apart.ratio is not None:
        lines.append(f"apart: burst / calm {apart.ratio:.2f} (target at most {TARGET_RATIO}: "
                     f"{'met' if apart.ratio <= TARGET_RATIO else 'NOT met'})")
    return "\n".join(lines)


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:,.2f}"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=16)
    parser.add_argument("--device", default="h100")
    parser.add_argument("--model", default="random:llama-3.1-8b")
    parser.add_argument("--tensor-parallel", type=int, default=1)
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--steady-prompt-tokens", type=int, default=128)
    parser.add_argument("--steady-output-tokens", type=int, default=4000)
    parser.add_argument("--burst", type=int, default=64)
    parser.add_argument("--burst-prompt-tokens", type=int, default=4000)
    parser.add_argument("--burst-output-tokens", type=int, default=8)
    parser.add_argument("--calm-s", type=float, default=2.0, help="modelled seconds of calm")
    parser.add_argument("--time-scale", type=float, default=10.0)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    log_dir = Path(tempfile.mkdtemp(prefix="sim-roles-"))
    results = []
    for roles in (["both"], ["prefill", "decode"]):
        results.append(run_fleet(args, roles, log_dir))
        print(report(results[-1:], args).splitlines()[-1], flush=True)
    print(report(results, args))
    print(f"logs: {log_dir}")
    return 1 if any(r.failed for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
