"""llm-d's precise-prefix benchmark, reshaped for kvfleet's simulated workers (issue 51, item 6):
prefix-affinity routing against shared and random routing on 8 simulated Qwen3-32B workers at
tensor parallel 2 on H100s, beside llm-d's published table (theirs, measured on real GPUs).

    .venv/bin/python -m benchmarks.fleet_sim --rates 10 --duration 10 --output-tokens 200 \\
        --time-scale 10                                              # a brief check
    # the full run (a quiet machine; llm-d's shape, the ends of its ladder of rates; hours:
    # every modelled second is 20 on the host; raise --time-scale if a row says INVALID):
    .venv/bin/python -m benchmarks.fleet_sim --rates 3,10,30,60 --duration 25 --warmup \\
        --output-tokens 1000 --time-scale 20 --dynamo-venv DIR   # DIR: see fleet_sim_dynamo.py

**The trace** (benchmarks/fleet_sim_trace.py, from `--seed`): 150 tenants, each with a
6,000-token shared prefix, 5 users per tenant sending 1,200-token queries (a new query every
request; `--queries per-user` repeats each user's, as llm-d's data does), Poisson arrivals at
each of `--rates` requests/s for `--duration` modelled seconds. Prompts are token ids sent to
/v1/completions (the gateway accepts them; no tokeniser decides their length: every answer's
`usage.prompt_tokens` is checked to be 7,200). Answers: `--output-tokens` tokens exactly
(ignore_eos; llm-d's inference-perf runs used output_len 1,000 with ignore_eos, so 1,000 is the
default; a brief run takes fewer so that it ends in minutes). Streamed; the repo's client
(kvfleet/bench/client.py) times TTFT and the inter-token gaps of each request.

**The fleets.** For each of `--routings` a fresh `kvfleet up --sim-workers 8 --sim-device h100
--model random:qwen3-32b --tensor-parallel-size 2 --sim-time-scale K --routing R` on one
embedded Redis with a fresh key prefix; every rate runs on it in turn (as llm-d's ladder ran on
one deployment), after an optional `--warmup` (one request per tenant at 15 requests/s, as
llm-d's warm-up stage seats the prefixes). The gateway's queue-wait admission limit is off and
its timeouts long (the trace is served whole, as llm-d's random scheduler served it, with 100 s
TTFTs). The simulated workers scale the fleet's own timings by K themselves (heartbeats, the
steal delays, the token publish interval: worker/sim/host.py's SCALED_TIMINGS).

**The time scale** `--time-scale K`: the simulated workers play every step K times longer; the
client sends at K x the modelled arrivals; TTFT and ITL are divided by K, tok/s multiplied.

**Per routing and rate** (modelled time): requests sent and answered, output tok/s (all output
tokens of the answered requests / first send to last answer), TTFT p50/p90, ITL p99, the cached
share (the workers' prefix hits / prompt tokens looked up, heartbeat deltas over the run), the
load per worker (requests: the worker named in each request's hash in Redis; prompt tokens:
heartbeat deltas; min-max over the 8), and the lag share (lagged / played steps, heartbeat
deltas): a run whose lag exceeds 5% is INVALID: the host, not the model, set its numbers.

**Peer: NVIDIA Dynamo's mocker and KV router** (`ai-dynamo` on PyPI; benchmarks/fleet_sim_dynamo.py
says how to install it and what differs): with `--dynamo-venv DIR` the routings `dynamo-kv` (its
KV router) and `dynamo-random` run too, 8 mockers with kvfleet's KV pool behind Dynamo's
frontend, the same trace and client. Without it, or where it does not import, the script says
why.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx
import redis

from benchmarks.fleet_sim_trace import (QUERY_MODES, BeatCounters, RunRow, TimeScale,
                                        TraceShape, deltas, generate, prefixes,
                                        published_table, summarise, table, target_lines,
                                        trace_requests, warmup_requests)
from benchmarks.fleet_sim_dynamo import ROUTER_MODES, SERVED_NAME, DynamoFleet, dynamo_python
from benchmarks.sim_fleet import stop_fleets_on_sigterm
from benchmarks.http_peers import stop_session, wait_first_answer
from benchmarks.peer_env import dropped_line, peer_env
from kvfleet.bench.client import BenchTarget, RequestRecord
from kvfleet.bench.loadgen import LoadSpec, replay
from kvfleet.shared.models import resolve_model_path
from kvfleet.shared.redis_server import EmbeddedRedis, free_port
from kvfleet.shared.settings import WorkerSettings
from kvfleet.shared.wire import Heartbeat, Keys
from kvfleet.shared.wire import RequestRecord as StoredRequest
from kvfleet.worker.sim.cost import RooflineCost

ROUTINGS = ("affinity", "shared", "random")
PEER_ROUTINGS = tuple(ROUTER_MODES)  # Dynamo's KV and random routers
MODEL = "random:qwen3-32b"
WARMUP_RATE = 15.0  # llm-d's warm-up stage: 15 requests/s
DYNAMO_NOTE = (
    "its mockers time steps with Dynamo's default model (hardcoded polynomials), not an H100 "
    "pair's roofline for Qwen3-32B (that needs `aisimulate`, on NVIDIA's index only): compare "
    "its KV router with its random router, not its absolute numbers with kvfleet's; no lag "
    "counter (verdict unchecked), no load per worker read")


class SimFleet:
    """`kvfleet up --sim-workers N ... --routing R` on a shared Redis under a key prefix of its
    own, in a session of its own (stopping it reaches its children)."""

    def __init__(self, args, routing: str, redis_url: str, log_path: Path):
        self.routing, self.workers = routing, args.workers
        self.port = free_port()
        self.keys = Keys(f"fsim-{routing}-{uuid.uuid4().hex[:6]}:")
        k = args.time_scale
        command = [sys.executable, "-m", "kvfleet", "up", "--sim-workers", str(args.workers),
                   "--sim-device", args.device, "--model", MODEL, "--tensor-parallel-size",
                   str(args.tensor_parallel), "--sim-time-scale", f"{k:g}", "--routing",
                   routing, "--port", str(self.port), "--metrics-port", "-1"]
        env = peer_env({"KVFLEET_REDIS_URL": redis_url, "KVFLEET_KEY_PREFIX": self.keys.prefix,
                        "KVFLEET_MAX_QUEUE_WAIT_S": "0",
                        "KVFLEET_REQUEST_TIMEOUT_S": str(args.request_timeout_s),
                        "KVFLEET_FIRST_EVENT_TIMEOUT_S": str(args.request_timeout_s),
                        "KVFLEET_PUBLISH_INTERVAL_MS": str(args.publish_interval_ms)})
        self.log = open(log_path, "w")
        self.process = subprocess.Popen(command, env=env, stdout=self.log,
                                        stderr=subprocess.STDOUT, start_new_session=True)
        self.redis = redis.Redis.from_url(redis_url)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def beats(self) -> dict[str, Heartbeat]:
        names = [n.decode() for n in self.redis.scan_iter(match=self.keys.worker_pattern(),
                                                            count=1000)]
        pipe = self.redis.pipeline(transaction=False)
        for name in names:
            pipe.hgetall(name)
        return {self.keys.worker_id(n): Heartbeat.decode(raw)
                for n, raw in zip(names, pipe.execute()) if raw}

    def counters(self) -> dict[str, BeatCounters]:
        return {w: BeatCounters(b.sim_steps, b.sim_lagged_steps, b.prefix_hit_tokens,
                                b.prefix_queried_tokens, b.generated_tokens)
                for w, b in self.beats().items()}

    def wait_ready(self, timeout_s: float) -> None:
        wait_first_answer(self.url, MODEL, self.process, timeout_s)
        deadline = time.monotonic() + timeout_s
        while len(self.beats()) < self.workers:
            if time.monotonic() > deadline or self.process.poll() is not None:
                raise RuntimeError(f"{self.url}: fewer than {self.workers} workers heartbeat")
            time.sleep(0.5)

    def requests_by_worker(self, response_ids: list[str]) -> dict[str, int]:
        """How many of these requests each worker finished (its id in the request's hash)."""
        pipe = self.redis.pipeline(transaction=False)
        for response_id in response_ids:
            pipe.hget(self.keys.request(response_id), StoredRequest.WORKER)
        counts: dict[str, int] = {}
        for worker in pipe.execute():
            if worker:
                counts[worker.decode()] = counts.get(worker.decode(), 0) + 1
        return counts

    def stop(self) -> None:
        stop_session(self.process)
        self.redis.close()
        self.log.close()


async def replay_trace(url: str, requests, scale: TimeScale, timeout_s: float,
                       model: str = MODEL) -> list[RequestRecord]:
    target = BenchTarget(model=model, endpoint="completions", timeout_s=timeout_s)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=200)
    async with httpx.AsyncClient(base_url=url, timeout=timeout_s, limits=limits) as client:
        result = await replay(client, target, requests, LoadSpec(rate=scale.replay_rate))
    return result.records


def run_rate(fleet: SimFleet, args, shape: TraceShape, rate: float,
             tenant_prefixes) -> RunRow:
    scale = TimeScale(args.time_scale)
    requests = trace_requests(generate(shape, rate, args.duration, args.seed, tenant_prefixes),
                              shape)
    before = fleet.counters()
    records = asyncio.run(replay_trace(fleet.url, requests, scale, args.request_timeout_s))
    time.sleep(2.5)  # the workers' next heartbeat carries the run's last steps
    by_worker = fleet.requests_by_worker([r.response_id for r in records if r.response_id])
    return summarise(fleet.routing, rate, records, scale, deltas(before, fleet.counters()),
                     by_worker, args.workers, shape.prompt_tokens)


def warm_up(fleet: SimFleet, args, shape: TraceShape, tenant_prefixes) -> None:
    """One request per tenant (its prefix and a query of its own, one answer token), at
    WARMUP_RATE modelled requests/s: every routing meets the sweep with the prefixes seated."""
    warm = TraceShape(shape.tenants, 1, shape.prefix_tokens, shape.query_tokens, 1)
    requests = warmup_requests(warm, WARMUP_RATE, args.seed, tenant_prefixes)
    asyncio.run(replay_trace(fleet.url, trace_requests(requests, warm),
                             TimeScale(args.time_scale), args.request_timeout_s))


def run_routing(routing: str, args, shape: TraceShape, redis_url: str, log_dir: Path,
                tenant_prefixes) -> list[RunRow]:
    fleet = SimFleet(args, routing, redis_url, log_dir / f"up-{routing}.log")
    rows = []
    try:
        fleet.wait_ready(args.startup_timeout_s)
        if args.warmup:
            warm_up(fleet, args, shape, tenant_prefixes)
        for rate in args.rates:
            row = run_rate(fleet, args, shape, rate, tenant_prefixes)
            rows.append(row)
            print("\n".join(table([row])[2:]), flush=True)
    finally:
        fleet.stop()
    return rows


def kv_tokens(args) -> int:
    """A simulated worker's KV pool in tokens (worker/sim: the device's memory x the utilisation
    less the weights and activations), for Dynamo's mockers."""
    settings = WorkerSettings(model=MODEL, tensor_parallel_size=args.tensor_parallel,
                              sim_device=args.device)
    config = settings.engine_config()
    cost = RooflineCost(args.device, MODEL.split(":", 1)[1], args.tensor_parallel,
                        kv_bytes=2, block_size=16)
    return 16 * cost.kv_blocks(16, config.gpu_memory_utilization, config.max_batched_tokens)


def run_dynamo(config: str, python: Path, args, shape: TraceShape, log_dir: Path,
               tenant_prefixes) -> list[RunRow]:
    """Dynamo's frontend (router `kv` or `random`) and 8 mockers, the same trace and client."""
    scale = TimeScale(args.time_scale)
    fleet = DynamoFleet(python, config, resolve_model_path(MODEL, weights=False), args.workers,
                        args.time_scale, kv_tokens(args), log_dir)
    rows = []
    try:
        fleet.wait_ready(args.startup_timeout_s)
        for rate in args.rates:
            requests = trace_requests(generate(shape, rate, args.duration, args.seed,
                                               tenant_prefixes), shape)
            records = asyncio.run(replay_trace(fleet.url, requests, scale,
                                               args.request_timeout_s, SERVED_NAME))
            rows.append(summarise(config, rate, records, scale, None, {}, args.workers,
                                  shape.prompt_tokens))
            print("\n".join(table(rows[-1:])[2:]), flush=True)
    finally:
        fleet.stop()
    return rows


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--routings", default=None, help=(
        "comma-separated, of affinity, shared, random, dynamo-kv, dynamo-random (default: the "
        "first three, and Dynamo's two with --dynamo-venv)"))
    p.add_argument("--rates", default="3,10,30,60", help="requests/s (modelled), comma-separated")
    p.add_argument("--duration", type=float, default=25.0,
                   help="modelled seconds of arrivals per rate (llm-d's 60/s stage: 25)")
    p.add_argument("--output-tokens", type=int, default=1000,
                   help="every answer's length (ignore_eos); llm-d's runs: 1,000")
    p.add_argument("--queries", choices=QUERY_MODES, default="per-request")
    p.add_argument("--tenants", type=int, default=150)
    p.add_argument("--users", type=int, default=5, help="per tenant")
    p.add_argument("--prefix-tokens", type=int, default=6000)
    p.add_argument("--query-tokens", type=int, default=1200)
    p.add_argument("--time-scale", type=float, default=10.0,
                   help="--sim-time-scale: every modelled duration K times longer")
    p.add_argument("--warmup", action="store_true",
                   help="one request per tenant before the sweep (llm-d's warm-up stage)")
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--device", default="h100")
    p.add_argument("--tensor-parallel", type=int, default=2)
    p.add_argument("--publish-interval-ms", type=float, default=5.0,
                   help="token events batched this long (modelled ms; x K on the fleet)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--request-timeout-s", type=float, default=7200.0)
    p.add_argument("--startup-timeout-s", type=float, default=600.0)
    p.add_argument("--dynamo-venv", default=None,
                   help="a virtualenv with ai-dynamo (NVIDIA Dynamo's mocker and KV router)")
    args = p.parse_args(argv)
    if args.routings is None:
        args.routings = ",".join(ROUTINGS + (PEER_ROUTINGS if args.dynamo_venv else ()))
    args.routings = [r for r in args.routings.split(",") if r]
    if not args.routings or any(r not in ROUTINGS + PEER_ROUTINGS for r in args.routings):
        p.error(f"--routings: of {', '.join(ROUTINGS + PEER_ROUTINGS)}")
    try:
        args.rates = [float(r) for r in args.rates.split(",") if r]
    except ValueError:
        p.error("--rates: numbers, comma-separated")
    if not args.rates or min(args.rates) <= 0 or args.time_scale <= 0:
        p.error("--rates and --time-scale must be positive")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    shape = TraceShape(args.tenants, args.users, args.prefix_tokens, args.query_tokens,
                       args.output_tokens, args.queries)
    print(f"# {args.workers} simulated {args.device} workers x TP {args.tensor_parallel} "
          f"({MODEL}); {shape.tenants} tenants x {shape.users} users, prompts of "
          f"{shape.prefix_tokens:,} shared + {shape.query_tokens:,} ({shape.queries}) tokens, "
          f"answers of {shape.output_tokens} (ignore_eos); Poisson at {args.rates} req/s for "
          f"{args.duration:g} s each; time scale {args.time_scale:g}; seed {args.seed}"
          f"{'; warm-up' if args.warmup else ''}")
    if (line := dropped_line()) is not None:
        print(line)
    tenant_prefixes = prefixes(shape, args.seed)
    log_dir = Path(tempfile.mkdtemp(prefix="kvfleet-fleet-sim-"))
    print(f"# logs: {log_dir}", flush=True)
    python, found = dynamo_python(args.dynamo_venv)
    dynamo = (f"{found}: {DYNAMO_NOTE}" if python is not None else
              f"not run: {found}. Installing it here: benchmarks/fleet_sim_dynamo.py")
    print(f"# NVIDIA Dynamo (mocker + KV router): {dynamo}", flush=True)
    stop_fleets_on_sigterm()  # a killed run stops its fleets (run_routing's finally)
    redis_server = EmbeddedRedis(port=free_port()).start()
    rows: list[RunRow] = []
    try:
        print("\n".join(table([])[:2]), flush=True)
        for routing in args.routings:
            if routing in ROUTINGS:
                rows += run_routing(routing, args, shape, redis_server.url, log_dir,
                                    tenant_prefixes)
            elif python is not None:
                rows += run_dynamo(routing, python, args, shape, log_dir, tenant_prefixes)
    finally:
        redis_server.stop()
    print("\nSimulated (modelled time; dynamo-*: Dynamo's mockers and router):")
    print("\n".join(table(rows)))
    for row in rows:
        if row.errors or row.wrong_prompt_lengths:
            print(f"  {row.routing} {row.rate:g}/s: errors {row.errors}, "
                  f"prompt lengths not {shape.prompt_tokens}: {row.wrong_prompt_lengths}")
    if lines := target_lines(rows):
        print("\nissue 51's targets (llm-d's shape at 60 requests/s):")
        print("\n".join(lines))
    print()
    print("\n".join(published_table()))
    print(f"\nNVIDIA Dynamo (mocker + KV router): {dynamo}")
    return 0 if all(r.verdict != "INVALID" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
