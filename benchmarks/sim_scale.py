"""How many simulated workers this host plays in time (issue 51, item 3): N simulated workers, two
gateways and Redis on one machine, under load, at a time scale, and the share of steps that ended
later than modelled.

    .venv/bin/python -m benchmarks.sim_scale                                    # 64 H100s, x10
    .venv/bin/python -m benchmarks.sim_scale --workers 64 --time-scales 5,10,20 --duration 60
    .venv/bin/python -m benchmarks.sim_scale --workers 16 --device a100 --model random:llama-3.1-8b \\
        --tensor-parallel 1

Per time scale: a fresh fleet (`kvfleet up --sim-workers N --sim-device ... --sim-time-scale k`
with its gateway, plus a second `kvfleet gateway` on the same Redis; an embedded Redis), then a
closed loop of `--streams` streaming completions (a `--prompt-tokens` prompt of random words, a
fixed `--output-tokens` answer with ignore_eos) spread over both gateways for `--duration`
seconds. The workers' heartbeats give the steps they played and those that lagged (ended more
than 10% of their modelled time, and 2 ms, late: worker/sim/clock.py), read before and after the
load; a run whose lagged steps exceed 5% of its steps is INVALID: the host could not play the
modelled accelerators at that scale. The client's figures are divided by k back to modelled time
(TTFT, ITL) or multiplied by it (tokens/s, requests/s): what the modelled fleet would serve.
The target (issue 51): 64 simulated H100 workers, two gateways and Redis on this machine, lag
under 5% of steps at a time scale of 10 or less.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import httpx

from benchmarks.sim_fleet import SimFleet, StepCounts, kvfleet, step_counts
from kvfleet.bench.client import BenchTarget, RequestRecord, stream_request
from kvfleet.bench.stats import distribution
from kvfleet.bench.trace import TraceRequest
from kvfleet.shared.redis_server import free_port

WORDS = ("river", "stone", "market", "window", "garden", "signal", "copper", "lantern", "harbor",
         "meadow", "engine", "violet", "canyon", "ledger", "orbit", "thistle")


@dataclass(frozen=True)
class ScaleResult:
    time_scale: float
    workers: int
    counts: StepCounts  # during the load
    requests: int
    failed: int
    output_tokens_per_s: float  # modelled (client's rate x k)
    ttft_p50_s: float | None  # modelled (client's / k)
    ttft_p90_s: float | None
    itl_p50_s: float | None
    itl_p99_s: float | None
    load_average: float  # the host's 1-minute load at the end
    errors: dict[str, int]  # failed requests by error


def modelled(records: list[RequestRecord], duration_s: float, k: float, workers: int,
             counts: StepCounts, load_average: float) -> ScaleResult:
    """The client's figures brought back to modelled time (divided by the time scale k)."""
    ok = [r for r in records if r.done and r.error is None]
    tokens = sum(r.output_tokens or 0 for r in ok)
    ttft = distribution([r.ttft_s / k for r in ok if r.ttft_s is not None])
    gaps = [(b - a) / k for r in ok for a, b in zip(r.chunk_offsets_s, r.chunk_offsets_s[1:])]
    itl = distribution(gaps)
    return ScaleResult(k, workers, counts, len(ok), len(records) - len(ok),
                       tokens / duration_s * k if duration_s > 0 else 0.0,
                       ttft.p50, ttft.p90, itl.p50, itl.p99, load_average,
                       dict(Counter(str(r.error or "not done")[:120] for r in records
                                    if r not in ok)))


def prompt_text(tokens: int, rng: random.Random) -> str:
    """About `tokens` tokens of the default tokenizer: one common word ~ one token."""
    return " ".join(rng.choice(WORDS) for _ in range(tokens))


async def closed_loop(urls: list[str], model: str, streams: int, duration_s: float,
                      prompt_tokens: int, output_tokens: int, seed: int) -> list[RequestRecord]:
    """`streams` loops, each sending its next request when its last one ends, over `urls` in
    turn, until `duration_s` has passed (requests in flight then are awaited)."""
    rng = random.Random(seed)
    target = BenchTarget(model=model, endpoint="completions", timeout_s=600)
    records: list[RequestRecord] = []
    start = time.perf_counter()
    clients = [httpx.AsyncClient(base_url=url, timeout=600,
                                 limits=httpx.Limits(max_connections=streams))
               for url in urls]

    async def loop(index: int) -> None:
        client = clients[index % len(clients)]
        while time.perf_counter() - start < duration_s:
            request = TraceRequest(0.0, prompt_text(prompt_tokens, rng), output_tokens,
                                   ignore_eos=True)
            record = RequestRecord(len(records), time.perf_counter() - start, output_tokens)
            records.append(record)
            await stream_request(client, target, request, record, start)

    try:
        await asyncio.gather(*(loop(i) for i in range(streams)))
    finally:
        for client in clients:
            await client.aclose()
    return records


def run_scale(args, k: float, log_dir: Path) -> ScaleResult:
    ports = [free_port(), free_port()]
    # the gateways' back-pressure limit is real time (a queue wait of 60 s is 6 modelled s at
    # x10): off, the closed loop bounds the queue
    commands = {f"up-x{k:g}": kvfleet(
        "up", "--sim-workers", str(args.workers), "--sim-device", args.device, "--model",
        args.model, "--tensor-parallel-size", str(args.tensor_parallel), "--sim-time-scale",
        str(k), "--port", str(ports[0]), "--metrics-port", "-1", "--max-queue-wait-s", "0"),
        f"gateway2-x{k:g}": kvfleet("gateway", "--model", args.model, "--port", str(ports[1]),
                                    "--max-queue-wait-s", "0")}
    env = {"KVFLEET_PUBLISH_INTERVAL_MS": str(args.publish_interval_ms)}
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    with SimFleet(commands, env, log_dir, prefix=f"simscale{int(k)}:") as fleet:
        fleet.wait_ready(args.workers, urls)
        before = step_counts(fleet.beats())
        started = time.perf_counter()
        records = asyncio.run(closed_loop(urls, args.model, args.streams, args.duration,
                                          args.prompt_tokens, args.output_tokens, args.seed))
        duration = time.perf_counter() - started
        time.sleep(2.5)  # a heartbeat after the last step
        counts = step_counts(fleet.beats()).since(before)
    return modelled(records, duration, k, args.workers, counts, os.getloadavg()[0])


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:,.0f}"


def report(results: list[ScaleResult], args) -> str:
    lines = [f"{args.workers} simulated {args.device} workers x TP {args.tensor_parallel} "
             f"({args.model}), 2 gateways, Redis; {args.streams} streams of "
             f"{args.prompt_tokens} + {args.output_tokens} tokens for {args.duration:g} s",
             "| time scale | steps | lagged | lag share | verdict | requests (failed) | "
             "modelled out tok/s | TTFT p50 / p90 ms | ITL p50 / p99 ms | load avg |",
             "|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|"]
    for r in results:
        c = r.counts
        verdict = "valid" if c.valid else "INVALID"
        lines.append(f"| {r.time_scale:g} | {c.steps:,} | {c.lagged:,} | {c.share:.1%} | "
                     f"{verdict} | {r.requests} ({r.failed}) | {r.output_tokens_per_s:,.0f} | "
                     f"{_ms(r.ttft_p50_s)} / {_ms(r.ttft_p90_s)} | "
                     f"{_ms(r.itl_p50_s)} / {_ms(r.itl_p99_s)} | {r.load_average:.1f} |")
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=64)
    parser.add_argument("--time-scales", default="10",
                        help="comma-separated time scales, a fresh fleet each")
    parser.add_argument("--device", default="h100")
    parser.add_argument("--model", default="random:qwen3-32b")
    parser.add_argument("--tensor-parallel", type=int, default=2)
    parser.add_argument("--streams", type=int, default=128, help="concurrent streams (2 a worker)")
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of load, real")
    parser.add_argument("--publish-interval-ms", type=float, default=0.0,
                        help="the workers' --publish-interval-ms, modelled (they scale it by k)")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    scales = [float(x) for x in args.time_scales.split(",")]
    log_dir = Path(tempfile.mkdtemp(prefix="sim-scale-"))
    results = []
    for k in scales:
        results.append(run_scale(args, k, log_dir))
        print(report(results[-1:], args), flush=True)
    print()
    print(report(results, args))
    print(f"logs: {log_dir}")
    for r in results:
        for error, count in r.errors.items():
            print(f"x{r.time_scale:g}: {count} failed: {error}")
    failed = any(r.failed for r in results)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
