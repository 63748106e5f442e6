"""`kvfleet plan` against a simulated run (issue 51, item 4: "`kvfleet plan` can check its
arithmetic against a simulated run"; docs/OPERATIONS.md, "Checking a plan"): the fleet the plan
sizes from a simulated worker's step-cost curve, then a simulated fleet of that size offered the
planned demand. Target: it serves at least 0.9x the demand with its worst worker's ITL p99
within 1.05x the target.

    .venv/bin/python -m benchmarks.sim_plan                   # H100, Llama-3.1-8B, ~5 min
    .venv/bin/python -m benchmarks.sim_plan --fit-duration 30 --warmup 40 --duration 50
    .venv/bin/python -m benchmarks.sim_plan --demand 30000    # a stated demand, modelled tok/s
    .venv/bin/python -m benchmarks.sim_plan --prompt-tokens 1000 --answer-tokens 256

1. The curve: one simulated worker (`kvfleet worker --sim-device ... --target-itl-ms T
   --max-running M`, which warms its pace fit up before its first request: a sweep of 4-token
   prompts) and a gateway on an embedded Redis, loaded with a closed loop of the workload's
   requests (`--prompt-tokens` P + `--answer-tokens` A, half again more streams than the
   roofline runs at pace) for `--fit-duration` seconds, so that its fit sees the workload's
   contexts and prompts, not only the warm-up's. Its heartbeat when the load ends is copied
   under another key prefix (the requests cancelled then keep refitting the live one), so that
   both plan calls read one curve.
2. The plan: `kvfleet plan --step-cost redis://... --key-prefix ... --worker <id>
   --target-itl-ms T --context P+A --prompt-tokens P --output-tokens A --demand D --json` (a
   subprocess, as an operator runs it; it counts the prompts a worker at pace prefills).
   The worker ran at time scale k (`--fit-time-scale`, default the fleet's): its curve is k
   times slower than the modelled device, so the target goes in k times longer and the demand k
   times smaller, and the plan's tokens/s come back k times larger. Read: workers, and a
   worker's streams and output tokens/s at pace. Without `--demand`, the demand is `--load`
   workers' worth of the plan's own rate a worker (read from a first call), so that the fleet
   it sizes is nearly full and the check is not won by rounding up.
3. The run: a fresh fleet of exactly that many simulated workers (one `kvfleet worker
   --sim-workers N` process, the same flags) and a gateway, at `--time-scale` k, offered the
   demand as an open loop: Poisson arrivals of non-streamed completions at D / A requests a
   modelled second (D / A / k a real one). After `--warmup` seconds the workers' counters are
   read, and again `--duration` seconds later: the tokens they generated in that window and the
   worst worker's ITL p99 (its own window, the last 60 real seconds), in modelled time; their
   running streams are sampled every second. Each run's lag (the heartbeats' played and lagged
   steps, benchmarks/sim_fleet.py's StepCounts) over 5% of its steps makes the run INVALID and
   the benchmark exit 1 (as a failed request does); a plan NOT met exits 0.

Printed: plan against simulation side by side, with ratios, and the verdict. The plan counts a
worker's prompts (each step prefilling the n / A prompts that replace its n streams); this
benchmark's own count of them on the same curve is printed beside it, a check of the plan's.
The time scale matters twice: at 1 on a small host the curve is the host's (its loop's
milliseconds beside a 7 ms modelled step: a plan of a few streams a worker), and a fleet's lag
rises with its workers and streams.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from benchmarks.sim_fleet import SimFleet, StepCounts, kvfleet, step_counts
from benchmarks.sim_pace import load, streams_at_pace
from benchmarks.sim_scale import prompt_text
from kvfleet.shared.model_shapes import is_random_model, shape_config, shape_name
from kvfleet.shared.pace import StepCostCurve, StepFeatures
from kvfleet.shared.redis_server import free_port
from kvfleet.shared.wire import Heartbeat, Keys
from kvfleet.worker.engine.core.pace import LATENCY_WINDOW_S
from kvfleet.worker.sim.accelerators import accelerator
from kvfleet.worker.sim.cost import RooflineCost

THROUGHPUT_SHARE = 0.9  # the fleet serves at least this share of the demand
# the worst worker's ITL p99 within this of the target: the largest of N workers' p99s, each
# over some thousand gaps, runs a little above one worker's (the pace's own promise is
# benchmarks/sim_pace.py's to check; this one checks the plan's arithmetic)
ITL_TOLERANCE = 1.05
PREFIX = "simplan:"
# the curve's worker's heartbeat as it was when its load ended, copied under this prefix: both
# plan calls read that curve, not the one its last cancelled requests keep refitting
SNAPSHOT_PREFIX = "simplan-at-load:"
SNAPSHOT_TTL_S = 600


@dataclass(frozen=True)
class PlannedFleet:
    """What `kvfleet plan` said, in modelled time."""

    workers: int
    streams: int  # a worker's at pace
    tokens_per_s: float  # a worker's at pace, modelled
    demand_tokens_per_s: float  # modelled
    target_itl_s: float  # modelled
    context_tokens: float
    curve_steps: int

    @property
    def capacity_tokens_per_s(self) -> float:
        return self.workers * self.tokens_per_s

    @property
    def utilisation(self) -> float:
        """The demand's share of the planned fleet's rate at pace (1: full)."""
        capacity = self.capacity_tokens_per_s
        return self.demand_tokens_per_s / capacity if capacity else 0.0

    @property
    def streams_at_demand(self) -> float:
        """The streams a worker runs at the demand, by the plan (its streams at pace x the
        utilisation)."""
        return self.streams * self.utilisation


def planned_fleet(document: dict, demand_tokens_per_s: float, k: float) -> PlannedFleet:
    """`kvfleet plan --json`'s figures brought back to modelled time: the curve of a worker at
    time scale k is k times slower (its tokens/s k times fewer, its target k times longer)."""
    pace = document["measured_pace"]
    throughput = document["throughput"]
    return PlannedFleet(throughput["workers_needed"], pace["streams"], pace["tokens_per_s"] * k,
                        demand_tokens_per_s, pace["target_itl_ms"] / 1000 / k,
                        pace["context_tokens"], pace["curve_steps"])


def with_prompts(curve: StepCostCurve, target_s: float, context: float, prompt_tokens: int,
                 answer_tokens: int, limit: int = 4096) -> tuple[int, float]:
    """What the plan's arithmetic gives with the prompts counted: the most streams n whose steady
    step, n decode rows and the prefill of the prompts that replace them (n / A of a prompt of
    P tokens a step, attending to P / 2 positions on average), keeps the turn within the target
    on `curve`; (n, output tokens a second at n), in the curve's time."""
    def work(n: int) -> StepFeatures:
        tokens = math.ceil(n * prompt_tokens / answer_tokens)
        return StepFeatures.of_decode(n, context).plus(
            StepFeatures(prefill_tokens=tokens, prefill_context=tokens * prompt_tokens // 2))

    n = 0
    while n < limit and curve.turn_seconds(work(n + 1)) <= target_s:
        n += 1
    return n, (n / curve.turn_seconds(work(n)) if n else 0.0)


@dataclass(frozen=True)
class Fit:
    """The curve's run: its lag, the curve (at the fit's time scale) and the worker's group when
    its load ended."""

    counts: StepCounts
    curve: StepCostCurve
    running: int
    pace_streams: int  # its own figure of the streams it runs at pace


def describe_curve(curve: StepCostCurve, k: float) -> str:
    """The curve in modelled units (a curve at time scale k is k times slower)."""
    return (f"base {curve.base_s / k * 1e3:.2f} ms + {curve.decode_row_s / k * 1e6:.1f} µs a "
            f"decode row + {curve.context_token_s / k * 1e9:.2f} ns a context token + "
            f"{curve.prefill_token_s / k * 1e6:.1f} µs a prompt token; loop overhead "
            f"{curve.overhead_s / k * 1e3:.2f} ms, margin {curve.margin:.2f}")


@dataclass(frozen=True)
class Served:
    """What the simulated fleet did in the measured window, in modelled time."""

    workers: int
    tokens_per_s: float
    itl_p99_s: float  # the worst worker's
    offered_tokens_per_s: float  # the requests that arrived in the window x their answers
    streams_mean: float  # running streams a worker, mean over the samples and the workers
    streams_max: float  # the busiest worker's mean
    pace_streams_mean: float  # the workers' own figure of streams at pace (heartbeat)
    room_mean: float  # more streams a worker would take at pace, mean (heartbeat pace_room)
    waiting_mean: float  # requests a worker holds unstarted (its engine's and its own queue)
    sent: int
    answered: int
    failed: int  # in the window (requests cut when it ended are not failures)
    backlog: int  # requests sent and not running on a worker at the window's end (queued)
    counts: StepCounts


def _ratio(a: float, b: float) -> float:
    return a / b if b else 0.0


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def summarise(before: list[Heartbeat], after: list[Heartbeat],
              samples: list[dict[str, Heartbeat]], seconds: float, k: float, sent: int = 0,
              answered: int = 0, failed: int = 0, in_flight: int = 0,
              offered_tokens: int = 0) -> Served:
    """The window's figures from heartbeat deltas (tokens), the last beats (ITL p99) and the
    samples (streams; each the beats by worker id), brought back to modelled time (x k for
    rates, / k for latencies)."""
    tokens = sum(b.generated_tokens for b in after) - sum(b.generated_tokens for b in before)
    itl = max((b.itl_p99_ms for b in after), default=0.0) / 1000 / k
    per_worker: dict[str, list[float]] = {}
    for beats in samples:
        for worker_id, beat in beats.items():
            per_worker.setdefault(worker_id, []).append(beat.running)
    running = [b.running for beats in samples for b in beats.values()]
    pace = [b.pace_streams for beats in samples for b in beats.values()]
    room = [max(b.pace_room, 0) for beats in samples for b in beats.values()]
    waiting = [b.waiting + b.own_queue for beats in samples for b in beats.values()]
    held = sum(b.running + b.waiting for b in after)
    rate = k / seconds if seconds > 0 else 0.0
    return Served(len(after), tokens * rate, itl, offered_tokens * rate, _mean(running),
                  max((_mean(v) for v in per_worker.values()), default=0.0), _mean(pace),
                  _mean(room), _mean(waiting), sent,
                  answered, failed, max(in_flight - held, 0),
                  step_counts(after).since(step_counts(before)))


@dataclass(frozen=True)
class Check:
    throughput_ratio: float  # served / demand
    itl_ratio: float  # worst ITL p99 / target
    streams_ratio: float  # streams a worker measured / the plan's at this demand
    valid: bool  # both runs' lag within 5%
    met: bool
    reasons: list[str] = field(default_factory=list)


def check(planned: PlannedFleet, served: Served, fit_counts: StepCounts) -> Check:
    """The verdict: the planned fleet serves at least THROUGHPUT_SHARE of the demand with its
    worst worker's ITL p99 within ITL_TOLERANCE of the target; valid when both runs played
    their steps in time (lag within 5%) and an ITL was measured."""
    throughput = served.tokens_per_s / planned.demand_tokens_per_s \
        if planned.demand_tokens_per_s else 0.0
    itl = served.itl_p99_s / planned.target_itl_s if planned.target_itl_s else math.inf
    streams = served.streams_mean / planned.streams_at_demand if planned.streams_at_demand else 0.0
    reasons = []
    if not fit_counts.valid:
        reasons.append(f"the curve's run lagged {fit_counts.share:.1%} of its steps")
    if not served.counts.valid:
        reasons.append(f"the fleet's run lagged {served.counts.share:.1%} of its steps")
    if served.itl_p99_s <= 0:
        reasons.append("no ITL measured")
    valid = fit_counts.valid and served.counts.valid and served.itl_p99_s > 0
    met = throughput >= THROUGHPUT_SHARE and itl <= ITL_TOLERANCE
    return Check(throughput, itl, streams, valid, met, reasons)


def report(planned: PlannedFleet, served: Served, result: Check, fit: Fit,
           prompted: tuple[int, float], args) -> str:
    """`prompted`: a worker's streams and modelled tokens/s on the same curve with the prompts
    counted (`with_prompts`)."""
    n, fit_counts = planned.workers, fit.counts
    at_demand = planned.demand_tokens_per_s / n if n else 0.0
    lines = [
        f"{args.device} x TP {args.tensor_parallel}, {args.model}; {args.prompt_tokens} + "
        f"{args.answer_tokens}-token requests, target ITL {planned.target_itl_s * 1000:g} ms; "
        f"demand {planned.demand_tokens_per_s:,.0f} modelled out tok/s "
        f"({planned.demand_tokens_per_s / args.answer_tokens:,.1f} requests/s); curve from one "
        f"worker at time scale {args.fit_time_scale:g} ({planned.curve_steps:,} steps fitted), "
        f"streams counted at {planned.context_tokens:,.0f} tokens of context "
        f"({args.plan_context}), the fleet at {args.time_scale:g}, {args.duration:g} s measured "
        f"after {args.warmup:g} s",
        "| | plan | simulated | simulated / plan |",
        "|---|---:|---:|---:|",
        f"| workers | {n} | {served.workers} | |",
        f"| fleet out tok/s (demand) | {planned.demand_tokens_per_s:,.0f} | "
        f"{served.tokens_per_s:,.0f} | **{result.throughput_ratio:.2f}** |",
        f"| fleet out tok/s offered (arrivals in the window) | "
        f"{planned.demand_tokens_per_s:,.0f} | {served.offered_tokens_per_s:,.0f} | "
        f"{_ratio(served.offered_tokens_per_s, planned.demand_tokens_per_s):.2f} |",
        f"| fleet out tok/s at pace (capacity) | {planned.capacity_tokens_per_s:,.0f} | | |",
        f"| out tok/s a worker (at the demand) | {at_demand:,.0f} | "
        f"{served.tokens_per_s / max(served.workers, 1):,.0f} | {result.throughput_ratio:.2f} |",
        f"| streams a worker at pace | {planned.streams} | {served.pace_streams_mean:,.1f} "
        f"(its own, heartbeat) | "
        f"{served.pace_streams_mean / planned.streams if planned.streams else 0:.2f} |",
        f"| streams a worker at the demand | {planned.streams_at_demand:,.1f} | "
        f"{served.streams_mean:,.1f} (busiest {served.streams_max:,.1f}) | "
        f"{result.streams_ratio:.2f} |",
        f"| ITL p99 ms (worst worker) | {planned.target_itl_s * 1000:g} (target) | "
        f"{served.itl_p99_s * 1000:,.1f} | **{result.itl_ratio:.2f}** |",
        *([f"(the workers' ITL p99 is over the last {LATENCY_WINDOW_S:g} real s: "
           f"{LATENCY_WINDOW_S - args.duration:g} s of the warm-up in it)"]
          if args.duration < LATENCY_WINDOW_S else []),
        f"curve: {describe_curve(fit.curve, args.fit_time_scale)}; its worker ran "
        f"{fit.running} streams when its load ended (its own figure at pace: "
        f"{fit.pace_streams})",
        f"utilisation planned: {planned.utilisation:.2f} of the fleet's rate at pace",
        f"the plan counts the prompts; this benchmark's own count on its curve (each step "
        f"prefills the prompts that replace its streams): a worker runs {prompted[0]} streams, "
        f"{prompted[1]:,.0f} out tok/s ({_ratio(prompted[1], planned.tokens_per_s):.2f} of the "
        f"plan's; the fleet delivered {served.tokens_per_s / max(served.workers, 1):,.0f} a "
        f"worker)",
        f"requests: {served.sent} sent, {served.answered} answered, {served.failed} failed, "
        f"{served.backlog} queued at the window's end; a worker in the window: room for "
        f"{served.room_mean:,.1f} more streams at pace, {served.waiting_mean:,.1f} requests "
        f"held unstarted (means)",
        f"lag: curve's run {fit_counts.share:.1%} of {fit_counts.steps:,} steps, fleet's run "
        f"{served.counts.share:.1%} of {served.counts.steps:,} steps"
        + ("" if result.valid else f" -> INVALID ({'; '.join(result.reasons)})"),
        f"plan vs simulated: {result.throughput_ratio:.2f} of the demand served (target at least "
        f"{THROUGHPUT_SHARE}), ITL p99 {result.itl_ratio:.2f} of the target (at most "
        f"{ITL_TOLERANCE}): "
        + ("INVALID" if not result.valid else "met" if result.met else "NOT met"),
    ]
    return "\n".join(lines)


# ---- the runs ----------------------------------------------------------------------------


def worker_flags(args, k: float) -> list[str]:
    return ["--sim-device", args.device, "--sim-time-scale", str(k), "--metrics-port", "-1",
            "--tensor-parallel-size", str(args.tensor_parallel),
            "--target-itl-ms", f"{args.target_itl_ms:g}", "--max-running", str(args.max_running)]


def fleet_env(args) -> dict[str, str]:
    return {"KVFLEET_MODEL": args.model,
            "KVFLEET_PUBLISH_INTERVAL_MS": str(args.publish_interval_ms)}


def plan_context(args) -> int:
    """The context the plan counts streams at: a stream's longest (its prompt and whole answer:
    the plan's rule, the pace must hold for it too) or its mean over its life."""
    if args.plan_context == "mean":
        return args.prompt_tokens + args.answer_tokens // 2
    return args.prompt_tokens + args.answer_tokens


def plan_command(args, redis_url: str, worker_id: str, demand_tokens_per_s: float) -> list[str]:
    """`kvfleet plan` for the workload on the worker's live curve; at the fit's time scale k the
    target is k times longer and the demand (real tokens/s) k times smaller."""
    k = args.fit_time_scale
    command = kvfleet("plan", "--step-cost", redis_url, "--worker", worker_id, "--key-prefix",
                      SNAPSHOT_PREFIX, "--target-itl-ms", f"{args.target_itl_ms * k:g}",
                      "--context", str(plan_context(args)),
                      "--prompt-tokens", str(args.prompt_tokens),
                      "--output-tokens", str(args.answer_tokens),
                      "--demand", f"{demand_tokens_per_s / k:.6g}",
                      "--requests-per-s", f"{demand_tokens_per_s / args.answer_tokens / k:.6g}",
                      "--tensor-parallel-size", str(args.tensor_parallel),
                      "--gpu-memory", str(accelerator(args.device).memory_bytes), "--json")
    if is_random_model(args.model):  # the shape's config, inline: the memory section's
        config = shape_config(shape_name(args.model)).to_dict()
        command[-1:-1] = ["--from-model", json.dumps(config)]
    return command


def beats_by_id(fleet: SimFleet) -> dict[str, Heartbeat]:
    return {fleet.keys.worker_id(name.decode()): Heartbeat.decode(fleet.client.hgetall(name))
            for name in fleet.client.scan_iter(fleet.keys.worker("*"))}


def snapshot(fleet: SimFleet) -> tuple[str, Heartbeat]:
    """The curve's worker's heartbeat now, also copied under SNAPSHOT_PREFIX for the plan."""
    [name] = list(fleet.client.scan_iter(fleet.keys.worker("*")))
    raw = fleet.client.hgetall(name)
    worker_id = fleet.keys.worker_id(name.decode())
    copy = Keys(SNAPSHOT_PREFIX).worker(worker_id)
    fleet.client.hset(copy, mapping=raw)
    fleet.client.expire(copy, SNAPSHOT_TTL_S)
    return worker_id, Heartbeat.decode(raw)


def run_plan(command: list[str], log_dir: Path) -> dict:
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    with open(log_dir / "plan.log", "a") as log:
        log.write(" ".join(command[:3] + ["..."]) + "\n" + result.stdout + result.stderr + "\n")
    if result.returncode != 0:
        raise SystemExit(f"kvfleet plan failed ({result.returncode}): {result.stderr.strip()}")
    return json.loads(result.stdout)


def fit_streams(args) -> int:
    """The closed loop that fills the curve's worker: half again the streams the roofline runs
    within the target, so that the pace, not the load, sizes its group."""
    cost = RooflineCost(args.device, args.model, args.tensor_parallel)
    context = args.prompt_tokens + args.answer_tokens
    streams = streams_at_pace(cost, args.target_itl_ms / 1000, context, limit=args.max_running)
    return min(max(math.ceil(1.5 * streams) + 8, 16), 2 * args.max_running)


def fit_and_plan(args, log_dir: Path) -> tuple[PlannedFleet, Fit]:
    """Step 1 and 2: one worker's curve under the workload, and the plan it gives."""
    k = args.fit_time_scale
    port = free_port()
    commands = {"fit-gateway": kvfleet("gateway", "--port", str(port), "--max-queue-wait-s", "0",
                                       "--max-queue-depth", "0"),
                "fit-worker": kvfleet("worker", "--worker-id", "plan-curve",
                                      *worker_flags(args, k))}
    with SimFleet(commands, fleet_env(args), log_dir, prefix=PREFIX) as fleet:
        url, ended = f"http://127.0.0.1:{port}", {}
        fleet.wait_ready(1, [url])
        before = step_counts(fleet.beats())
        streams = fit_streams(args)
        print(f"fitting: 1 worker, {streams} streams for {args.fit_duration:g} s", flush=True)
        asyncio.run(load(url, args.model, streams, args.fit_duration, args.prompt_tokens,
                         args.answer_tokens, args.seed,
                         lambda: ended.setdefault("snapshot", snapshot(fleet))))
        worker_id, last = ended["snapshot"]
        counts = step_counts([last]).since(before)
        curve = StepCostCurve.from_json(last.step_cost)
        redis_url = fleet.redis_server.url
        demand = args.demand
        if demand is None:  # --load workers' worth of the plan's own rate a worker
            probe = run_plan(plan_command(args, redis_url, worker_id, 1.0), log_dir)
            demand = args.load * probe["measured_pace"]["tokens_per_s"] * k
        document = run_plan(plan_command(args, redis_url, worker_id, demand), log_dir)
    return planned_fleet(document, demand, k), Fit(counts, curve, last.running,
                                                    last.pace_streams)


async def open_loop(url: str, model: str, rate_per_s: float, duration_s: float,
                    prompt_tokens: int, output_tokens: int, seed: int, marks=(),
                    sample=None, sample_from_s: float = 0.0) -> tuple[list[float], int, int, int]:
    """Poisson arrivals at `rate_per_s` (real) of non-streamed completions for `duration_s`;
    each `(seconds, callback)` of `marks` is called that long into it (the last at the end,
    before the requests still running are cancelled), `sample()` every second from
    `sample_from_s`; (when each request was sent, seconds into the load; answered, failed before
    the end, in flight at the end)."""
    rng = random.Random(seed)
    sent: list[float] = []
    answered = failed = 0
    ended = False
    tasks: set[asyncio.Task] = set()
    async with httpx.AsyncClient(base_url=url, timeout=3600,
                                 limits=httpx.Limits(max_connections=4096)) as client:
        async def one(body: dict) -> None:
            nonlocal answered, failed
            try:
                response = await client.post("/v1/completions", json=body)
                ok = response.status_code == 200
            except httpx.HTTPError:
                ok = False
            if not ended:
                answered += ok
                failed += not ok

        async def arrivals() -> None:  # at their own times, however late the loop runs
            at = 0.0
            while True:
                at += rng.expovariate(rate_per_s)
                await asyncio.sleep(max(at - (time.perf_counter() - started), 0.0))
                body = {"model": model, "prompt": prompt_text(prompt_tokens, rng),
                        "max_tokens": output_tokens, "ignore_eos": True}
                task = asyncio.create_task(one(body))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                sent.append(time.perf_counter() - started)

        async def sampler() -> None:
            await asyncio.sleep(sample_from_s)
            while True:
                await asyncio.to_thread(sample)
                await asyncio.sleep(1.0)

        started, waited = time.perf_counter(), 0.0
        background = [asyncio.create_task(arrivals())]
        if sample is not None:
            background.append(asyncio.create_task(sampler()))
        for at_s, callback in sorted(marks, key=lambda m: m[0]):
            await asyncio.sleep(max(at_s - (time.perf_counter() - started), 0.0))
            waited = at_s
            await asyncio.to_thread(callback)
        await asyncio.sleep(max(duration_s - waited, 0.0))
        ended = True
        in_flight = len(tasks)
        for task in [*background, *tasks]:
            task.cancel()
        await asyncio.gather(*background, *tasks, return_exceptions=True)
    return sent, answered, failed, in_flight


def run_fleet(args, planned: PlannedFleet, log_dir: Path) -> Served:
    """Step 3: a fleet of the planned size offered the demand."""
    k = args.time_scale
    port = free_port()
    commands = {"fleet-gateway": kvfleet("gateway", "--port", str(port), "--max-queue-wait-s",
                                         "0", "--max-queue-depth", "0"),
                "fleet-workers": kvfleet("worker", "--sim-workers", str(planned.workers),
                                         "--worker-id", "plan-fleet", *worker_flags(args, k))}
    rate = planned.demand_tokens_per_s / args.answer_tokens / k  # requests a real second
    with SimFleet(commands, fleet_env(args), log_dir, prefix=PREFIX) as fleet:
        url, marks, samples = f"http://127.0.0.1:{port}", {}, []
        fleet.wait_ready(planned.workers, [url])
        print(f"serving: {planned.workers} workers, {rate * k:,.1f} requests/s modelled "
              f"({rate:,.2f} real) for {args.warmup + args.duration:g} s", flush=True)

        def mark(name: str) -> None:
            marks[name] = (fleet.beats(), time.perf_counter())

        def sample() -> None:
            if "start" in marks:
                samples.append(beats_by_id(fleet))

        end = args.warmup + args.duration
        sent, answered, failed, in_flight = asyncio.run(open_loop(
            url, args.model, rate, end, args.prompt_tokens, args.answer_tokens, args.seed,
            [(args.warmup, lambda: mark("start")), (end, lambda: mark("end"))], sample,
            args.warmup))
    (before, started), (after, ended) = marks["start"], marks["end"]
    window = [t for t in sent if args.warmup <= t < end]
    return summarise(before, after, samples, ended - started, k, len(sent), answered, failed,
                     in_flight, len(window) * args.answer_tokens)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="h100")
    parser.add_argument("--model", default="random:llama-3.1-8b")
    parser.add_argument("--tensor-parallel", type=int, default=1)
    parser.add_argument("--target-itl-ms", type=float, default=12.0,
                        help="the promised ITL p99, modelled (every worker's --target-itl-ms)")
    parser.add_argument("--max-running", type=int, default=256,
                        help="every worker's --max-running: above the streams at pace")
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--answer-tokens", type=int, default=256)
    parser.add_argument("--plan-context", choices=("longest", "mean"), default="longest",
                        help="the plan's --context: prompt + answer, or prompt + half of it")
    parser.add_argument("--demand", type=float, default=None,
                        help="output tok/s the fleet must serve, modelled (default: --load "
                             "workers' worth of the plan's rate a worker)")
    parser.add_argument("--load", type=float, default=3.8,
                        help="without --demand: the demand in workers at the plan's rate")
    parser.add_argument("--fit-duration", type=float, default=60.0,
                        help="seconds of load on the curve's worker, real")
    parser.add_argument("--fit-time-scale", type=float, default=None,
                        help="the curve's worker's time scale (default: --time-scale)")
    parser.add_argument("--warmup", type=float, default=40.0,
                        help="seconds of load on the fleet before the measured window, real")
    parser.add_argument("--duration", type=float, default=90.0,
                        help="seconds of the measured window, real")
    parser.add_argument("--time-scale", type=float, default=10.0)
    parser.add_argument("--publish-interval-ms", type=float, default=200.0,
                        help="token events coalesced over this many modelled ms")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.fit_time_scale is None:
        args.fit_time_scale = args.time_scale
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    log_dir = Path(tempfile.mkdtemp(prefix="sim-plan-"))
    planned, fit = fit_and_plan(args, log_dir)
    k = args.fit_time_scale
    streams, tokens_per_s = with_prompts(fit.curve, args.target_itl_ms / 1000 * k,
                                         plan_context(args), args.prompt_tokens,
                                         args.answer_tokens, limit=args.max_running * 4)
    prompted = (streams, tokens_per_s * k)
    print(f"plan: {planned.workers} workers of {planned.streams} streams, "
          f"{planned.tokens_per_s:,.0f} modelled out tok/s each at "
          f"{planned.target_itl_s * 1000:g} ms, for {planned.demand_tokens_per_s:,.0f} "
          f"(curve's lag {fit.counts.share:.1%})", flush=True)
    served = run_fleet(args, planned, log_dir)
    result = check(planned, served, fit.counts)
    print(report(planned, served, result, fit, prompted, args))
    print(f"logs: {log_dir}")
    return 1 if not result.valid or served.failed else 0


if __name__ == "__main__":
    sys.exit(main())
