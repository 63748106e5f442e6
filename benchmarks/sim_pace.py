"""The promised pace against fixed groups, on simulated workers (issue 51, item 7: "the promised
pace at 1.5x the single-stream step at 2x load against the best fixed group"; target: ITL p99 at
most the target, with at least 90% of the best fixed group's throughput).

    .venv/bin/python -m benchmarks.sim_pace                       # 16 H100s, Llama-3.1-8B
    .venv/bin/python -m benchmarks.sim_pace --groups 8,16,32,64 --duration 90

The target is 1.5x the modelled step of one decoding stream (the roofline of `--device` for the
model at `--tensor-parallel`, at the trace's mean context); the load is twice what the fleet
serves at that pace by the roofline (streams whose step stays within the target, per worker, x
workers x 2), a closed loop of non-streamed completions; long prompts (4,000 tokens), so that the
KV the streams read, not only the weights, sizes the group (with short ones an H100's decode
step stays within 1.5x of one stream's up to about 200 streams). Then one fresh fleet per configuration,
each on its own embedded Redis and gateway: the pace (`--target-itl-ms`, the engine's own group
size), and every fixed group of `--groups` (`--max-running G`, no target). The workers measure
their own time between tokens (the pace's window, the heartbeat's `itl_p99_ms`: the gaps of every
stream, not of coalesced events) and count their tokens (`generated_tokens`, read when the load's
time is up; the requests still running are then cancelled): the fleet's ITL p99 is its worst
worker's, its throughput the tokens generated during the load, both in modelled time.
The best fixed group is the one with the most throughput among those whose ITL p99 meets the
target. Token events are coalesced (`--publish-interval-ms`) so that the gateway and the client on
this host keep up with thousands of streams; the pace does not see them.
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
from kvfleet.shared.pace import StepFeatures
from kvfleet.shared.redis_server import free_port
from kvfleet.shared.wire import Heartbeat
from kvfleet.worker.sim.cost import RooflineCost

TARGET_SHARE = 0.9


def streams_at_pace(cost, target_s: float, context: int, limit: int = 4096) -> int:
    """The most decoding streams whose modelled step stays within `target_s`."""
    n = 0
    while n < limit and cost.step_seconds(StepFeatures.of_decode(n + 1, context)) <= target_s:
        n += 1
    return n


@dataclass(frozen=True)
class PaceRow:
    config: str  # "pace" or "group G"
    tokens_per_s: float  # modelled
    itl_p99_s: float  # the worst worker's, modelled
    requests: int
    failed: int
    counts: StepCounts
    running: int = 0  # streams the workers ran at the window's end (their heartbeats)


def best_fixed(rows: list[PaceRow], target_s: float) -> PaceRow | None:
    """The fixed group with the most throughput among those meeting the target."""
    meeting = [r for r in rows if r.config != "pace" and r.itl_p99_s <= target_s]
    return max(meeting, key=lambda r: r.tokens_per_s, default=None)


async def load(url: str, model: str, streams: int, duration_s: float, prompt_tokens: int,
               output_tokens: int, seed: int, at_end, marks=()) -> tuple[int, int]:
    """A closed loop of non-streamed completions for `duration_s`; each `(seconds, callback)` of
    `marks` is called that long into it, `at_end()` when the time is up, before the requests
    still running are cancelled; (answered, failed)."""
    rng = random.Random(seed)
    done = failed = 0
    async with httpx.AsyncClient(base_url=url, timeout=3600,
                                 limits=httpx.Limits(max_connections=streams)) as client:
        async def loop() -> None:
            nonlocal done, failed
            while True:
                body = {"model": model, "prompt": prompt_text(prompt_tokens, rng),
                        "max_tokens": output_tokens, "ignore_eos": True}
                try:
                    response = await client.post("/v1/completions", json=body)
                    ok = response.status_code == 200
                except httpx.HTTPError:
                    ok = False
                done += ok
                failed += not ok

        tasks = [asyncio.create_task(loop()) for _ in range(streams)]
        waited = 0.0
        for at_s, callback in sorted(marks, key=lambda m: m[0]):
            await asyncio.sleep(at_s - waited)
            waited = at_s
            callback()
        await asyncio.sleep(duration_s - waited)
        at_end()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return done, failed


def run_config(args, config: str, flags: list[str], streams: int, log_dir: Path) -> PaceRow:
    k = args.time_scale
    port = free_port()
    name = config.replace(" ", "-")
    commands = {f"{name}-gateway": kvfleet("gateway", "--port", str(port), "--max-queue-wait-s",
                                           "0", "--max-queue-depth", "0"),
                f"{name}-workers": kvfleet(
                    "worker", "--sim-workers", str(args.workers), "--sim-device", args.device,
                    "--sim-time-scale", str(k), "--worker-id", "pace", "--metrics-port", "-1",
                    "--tensor-parallel-size", str(args.tensor_parallel), *flags)}
    env = {"KVFLEET_MODEL": args.model,
           "KVFLEET_PUBLISH_INTERVAL_MS": str(args.publish_interval_ms)}
    with SimFleet(commands, env, log_dir) as fleet:
        url, ended = f"http://127.0.0.1:{port}", {}
        fleet.wait_ready(args.workers, [url])
        before, started = fleet.beats(), time.perf_counter()

        def at_end() -> None:  # the fleet's counts when the load's time is up
            ended["beats"], ended["at"] = fleet.beats(), time.perf_counter()

        done, failed = asyncio.run(load(url, args.model, streams, args.duration,
                                        args.prompt_tokens, args.output_tokens, args.seed,
                                        at_end))
    return summarise(config, before, ended["beats"], ended["at"] - started, k, done, failed)


def summarise(config: str, before: list[Heartbeat], after: list[Heartbeat], seconds: float,
              k: float, done: int, failed: int) -> PaceRow:
    tokens = sum(b.generated_tokens for b in after) - sum(b.generated_tokens for b in before)
    itl = max((b.itl_p99_ms for b in after), default=0.0) / 1000 / k
    counts = step_counts(after).since(step_counts(before))
    return PaceRow(config, tokens / seconds * k if seconds > 0 else 0.0, itl, done, failed,
                   counts)


def report(rows: list[PaceRow], target_s: float, streams: int, args) -> str:
    lines = [f"{args.workers} simulated {args.device} workers x TP {args.tensor_parallel} "
             f"({args.model}); target ITL {target_s * 1000:.1f} ms (1.5x one stream's step); "
             f"{streams} streams (2x the fleet at pace) of {args.prompt_tokens} + "
             f"{args.output_tokens} tokens for {args.duration:g} s at time scale "
             f"{args.time_scale:g}",
             "| config | modelled out tok/s | worst worker's ITL p99 ms | meets target | "
             "requests (failed) | lag share |", "|---|---:|---:|---|---:|---:|"]
    for r in rows:
        lag = f"{r.counts.share:.1%}" + ("" if r.counts.valid else " INVALID")
        lines.append(f"| {r.config} | {r.tokens_per_s:,.0f} | {r.itl_p99_s * 1000:.1f} | "
                     f"{'yes' if r.itl_p99_s <= target_s else 'no'} | {r.requests} "
                     f"({r.failed}) | {lag} |")
    pace = next((r for r in rows if r.config == "pace"), None)
    best = best_fixed(rows, target_s)
    if pace is not None and best is not None:
        share = pace.tokens_per_s / best.tokens_per_s if best.tokens_per_s else 0.0
        met = pace.itl_p99_s <= target_s and share >= TARGET_SHARE
        within = "within" if pace.itl_p99_s <= target_s else "over"
        lines.append(f"pace / best fixed group meeting the target ({best.config}): {share:.2f} "
                     f"of its throughput, ITL p99 {within} the target (target: within, and at "
                     f"least {TARGET_SHARE}: {'met' if met else 'NOT met'})")
    elif pace is not None:
        lines.append("no fixed group met the target")
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=16)
    parser.add_argument("--device", default="h100")
    parser.add_argument("--model", default="random:llama-3.1-8b")
    parser.add_argument("--tensor-parallel", type=int, default=1)
    parser.add_argument("--groups", default="8,16,32,64")
    parser.add_argument("--prompt-tokens", type=int, default=4000)
    parser.add_argument("--output-tokens", type=int, default=256)
    parser.add_argument("--duration", type=float, default=150.0, help="seconds of load, real")
    parser.add_argument("--time-scale", type=float, default=20.0)
    parser.add_argument("--publish-interval-ms", type=float, default=100.0,
                        help="token events coalesced over this many modelled ms")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    cost = RooflineCost(args.device, args.model, args.tensor_parallel)
    context = args.prompt_tokens + args.output_tokens // 2
    target_s = 1.5 * cost.step_seconds(StepFeatures.of_decode(1, context))
    per_worker = streams_at_pace(cost, target_s, context)
    streams = 2 * per_worker * args.workers
    log_dir = Path(tempfile.mkdtemp(prefix="sim-pace-"))
    configs = [("pace", ["--target-itl-ms", f"{target_s * 1000:.3f}", "--max-running", "256"])]
    configs += [(f"group {g}", ["--max-running", g]) for g in args.groups.split(",")]
    rows = []
    for config, flags in configs:
        rows.append(run_config(args, config, flags, streams, log_dir))
        print(f"{config}: {rows[-1].tokens_per_s:,.0f} modelled tok/s, ITL p99 "
              f"{rows[-1].itl_p99_s * 1000:.1f} ms", flush=True)
    print(report(rows, target_s, streams, args))
    print(f"logs: {log_dir}")
    return 1 if any(r.failed for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
