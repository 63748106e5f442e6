"""Gateway load benchmark: thousands of concurrent SSE streams through the real gateway (uvicorn in
a subprocess) and a real Redis, fed by a fast synthetic worker; compared with clients that read
the workers' pub/sub channels directly.

    .venv/bin/python -m benchmarks.gateway_load --streams 2000 --tokens 64 --interval-ms 250
    .venv/bin/python -m benchmarks.gateway_load --streams 2000 --tokens 30 --interval-ms 2000 \
        --ramp-s 20    # issue #6's target: docs/BENCHMARKS.md, "Gateway under load"

Processes: EmbeddedRedis; the gateway (`create_app` + uvicorn); a synthetic worker that
XREADGROUPs requests and publishes one token event per stream every `interval`, the streams'
phases spread by their arrival (one pipeline per 10 ms tick); this process, which opens the
streams (raw asyncio HTTP/1.1, ramped over `--ramp-s`) and measures.

Reported:
- events/s delivered: tokens received by all gateway clients ÷ (last token − first token);
- added latency per event: (client receive time − worker publish time) of every token, p50/p99,
  through the gateway and, in a second phase with as many streams, for clients subscribed to
  `kvf:tok:{id}` directly on one pub/sub connection; the difference is what the gateway adds.
  CLOCK_MONOTONIC is system-wide on Linux, so times compare across processes;
- an upper bound on the added p99 (p99 through the gateway − the baseline's p50), which a
  baseline tail disturbed by other load cannot make negative;
- the same per phase, by the event's publish time: `ramp` (before the last stream opened: request
  admissions compete with streaming), `steady` (every stream open, none finished yet), `tail`
  (streams finishing), and `overall`;
- memory per stream: (gateway RSS at peak concurrency − RSS before the load) ÷ streams;
- gateway CPU per event: overall (request admissions included) and in the steady state (none).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PREFIX = "kvb:"
TICK_MS = 10  # the synthetic worker's clock; each stream gets a token every `interval` of ticks


def raise_fd_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)] if ordered else float("nan")


# ---- role: gateway ------------------------------------------------------------------------------

def run_gateway(args: argparse.Namespace) -> None:
    import uvicorn

    from kvfleet.gateway.app import create_app, tune_gc_for_serving
    from kvfleet.shared.models import DEFAULT_MODEL
    from kvfleet.shared.settings import GatewaySettings

    raise_fd_limit()
    settings = GatewaySettings(redis_url=args.redis_url, model=DEFAULT_MODEL, key_prefix=PREFIX,
                               max_queue_depth=0, max_queue_wait_s=0, request_timeout_s=600,
                               first_event_timeout_s=120, log_level="WARNING")
    app = create_app(settings)
    tune_gc_for_serving()  # as `serve()` does
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning", backlog=8192,
                timeout_keep_alive=60)


# ---- role: synthetic worker ---------------------------------------------------------------------

async def worker_loop(args: argparse.Namespace) -> None:
    from redis.asyncio import Redis
    from redis.exceptions import ResponseError

    from kvfleet.shared.wire import Keys, QueueEntry, TokenEvent, Usage

    keys = Keys(PREFIX)
    redis = Redis.from_url(args.redis_url)
    stream = keys.queue(args.model)
    try:
        await redis.xgroup_create(stream, keys.group, id="0", mkstream=True)
    except ResponseError:
        pass
    tick_s = TICK_MS / 1000
    period = max(round(args.interval_ms / TICK_MS), 1)  # ticks between two tokens of a stream
    active: dict[str, list] = {}  # req_id -> [entry id, next seq, max_tokens, prompt tokens]
    starts: dict[str, int] = {}  # req_id -> tick of its token 0; token k leaves at start + k·period
    tick_times: list[float] = []
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    next_tick = time.monotonic()
    while not stop.is_set():
        tick = len(tick_times)
        batches = await redis.xreadgroup(keys.group, "synthetic", {stream: ">"}, count=5000)
        for _name, entries in batches or []:
            for entry_id, fields in entries:
                request = QueueEntry.decode(fields).request
                active[request.req_id] = [entry_id, 0, request.params.max_tokens,
                                          len(request.prompt_token_ids),
                                          request.reply_to or keys.tokens(request.req_id)]
                starts[request.req_id] = tick  # streams' phases spread as they arrive
        pipe = redis.pipeline(transaction=False)
        done = []
        messages: dict[str, list[bytes]] = {}  # reply channel -> this tick's events, as a worker
        for req_id, state in active.items():
            if (tick - starts[req_id]) % period:
                continue
            entry_id, seq, max_tokens, prompt_tokens, channel = state
            if seq < max_tokens:
                event = TokenEvent(seq=seq, attempt=0, token_ids=[args.token_id])
                state[1] += 1
            else:
                event = TokenEvent(seq=seq, attempt=0, finish_reason="length",
                                   usage=Usage(prompt_tokens, seq))
                pipe.xack(stream, keys.group, entry_id)
                done.append(req_id)
            messages.setdefault(channel, []).append(event.pack(req_id))
        for channel, parts in messages.items():
            pipe.publish(channel, b"".join(parts))
        tick_times.append(time.monotonic())  # the publishes leave now
        if len(pipe):
            await pipe.execute()
        for req_id in done:
            del active[req_id]
        next_tick += tick_s
        await asyncio.sleep(max(next_tick - time.monotonic(), 0))
    Path(args.out).write_text(json.dumps({"tick_times": tick_times, "starts": starts,
                                          "period": period}))
    await redis.aclose()


# ---- role: load generator (this process) --------------------------------------------------------

class Recorder:
    def __init__(self) -> None:
        self.received: dict[str, list[float]] = {}  # req_id -> receive time of token k
        self.open = 0
        self.max_open = 0
        self.errors = 0
        self.opened_at: list[float] = []  # when each stream started (response headers / XADD)
        self.closed_at: list[float] = []  # when each stream got its last event

    def phases(self, streams: int) -> tuple[float, float]:
        """(all open, first closed): the steady state is in between. With a stream that never
        opened, or one that closed before the last opened, there is none (both are +inf)."""
        if len(self.opened_at) < streams or not self.closed_at:
            return float("inf"), float("inf")
        all_open, first_closed = max(self.opened_at), min(self.closed_at)
        if first_closed <= all_open:
            return float("inf"), float("inf")
        return all_open, first_closed


async def gateway_stream(host: str, port: int, model: str, tokens: int,
                         recorder: Recorder) -> None:
    """One SSE stream over a raw asyncio connection: httpx costs the client more CPU than the
    gateway spends, and on 2 cores the client would be what is measured."""
    body = json.dumps({"model": model, "prompt": "Hello", "max_tokens": tokens,
                       "stream": True}).encode()
    times: list[float] = []
    req_id = None
    opened = False
    try:
        reader, writer = await asyncio.open_connection(host, port, limit=2**20)
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\n"
                     b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                     % (len(body), body))
        status = await reader.readline()
        if b" 200 " not in status:
            recorder.errors += 1
            return
        while (await reader.readline()) not in (b"\r\n", b""):
            pass  # headers (uvicorn sends chunked transfer encoding)
        opened = True
        recorder.opened_at.append(time.monotonic())
        recorder.open += 1
        recorder.max_open = max(recorder.max_open, recorder.open)
        buffer = b""
        while True:
            size = int((await reader.readline()).strip() or b"0", 16)
            if size == 0:
                recorder.closed_at.append(time.monotonic())
                break
            buffer += (await reader.readexactly(size + 2))[:-2]
            now = time.monotonic()
            *events, buffer = buffer.split(b"\n\n")
            for event in events:
                if not event.startswith(b"data: {"):
                    continue
                chunk = json.loads(event[6:])
                req_id = chunk["id"]
                if chunk["choices"] and chunk["choices"][0]["text"]:
                    times.append(now)
        writer.close()
    except Exception:  # noqa: BLE001 - counted, the benchmark goes on
        recorder.errors += 1
        return
    finally:
        if opened:
            recorder.open -= 1
    if req_id is not None:
        recorder.received[req_id] = times


async def sample_process(pid: int, samples: list[int], cpu: list[tuple[float, float]],
                         stop: asyncio.Event) -> None:
    """RSS, and (time, CPU seconds) of the gateway every 0.2 s."""
    while not stop.is_set():
        samples.append(rss_bytes(pid))
        cpu.append((time.monotonic(), cpu_s(pid)))
        await asyncio.sleep(0.2)


def cpu_at(cpu: list[tuple[float, float]], at: float) -> float:
    """The gateway's CPU seconds at time `at`, interpolated between samples."""
    for (t0, c0), (t1, c1) in zip(cpu, cpu[1:]):
        if t0 <= at <= t1:
            return c0 + (c1 - c0) * (at - t0) / max(t1 - t0, 1e-9)
    return cpu[-1][1] if cpu and at > cpu[-1][0] else (cpu[0][1] if cpu else 0.0)


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far."""
    return sum(cpu_split_s(pid))


def cpu_split_s(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of a process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


async def through_gateway(args, url: str, gateway_pid: int) -> tuple[Recorder, dict]:
    import httpx

    recorder = Recorder()
    host, port = url.removeprefix("http://").split(":")
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        await http.post("/v1/completions", json={"model": args.model, "prompt": "warm",
                                                 "max_tokens": 2})
    base_rss = rss_bytes(gateway_pid)
    base_cpu = cpu_s(gateway_pid), time.process_time()
    base_system_s = cpu_split_s(gateway_pid)[1]
    samples: list[int] = []
    cpu: list[tuple[float, float]] = []
    stop = asyncio.Event()
    sampler = asyncio.create_task(sample_process(gateway_pid, samples, cpu, stop))
    start = time.monotonic()
    tasks = []
    for _ in range(args.streams):
        tasks.append(asyncio.create_task(gateway_stream(host, int(port), args.model,
                                                        args.tokens, recorder)))
        await asyncio.sleep(args.ramp_s / args.streams)
    await asyncio.gather(*tasks)
    stop.set()
    await sampler
    all_open, first_closed = recorder.phases(args.streams)
    steady_cpu_s = (cpu_at(cpu, first_closed) - cpu_at(cpu, all_open)
                    if first_closed < float("inf") else float("nan"))
    return recorder, {"base_rss": base_rss, "peak_rss": max(samples),
                      "wall_s": time.monotonic() - start,
                      "gateway_cpu_s": cpu_s(gateway_pid) - base_cpu[0],
                      "gateway_system_cpu_s": cpu_split_s(gateway_pid)[1] - base_system_s,
                      "steady_gateway_cpu_s": steady_cpu_s,
                      "client_cpu_s": time.process_time() - base_cpu[1]}


async def direct_pubsub(args) -> Recorder:
    """The baseline: subscribe each request's channel on one connection, XADD, read."""
    from redis.asyncio import Redis

    from kvfleet.shared.wire import GenerationRequest, Keys, QueueEntry, SamplingParams, TokenEvent

    keys = Keys(PREFIX)
    redis = Redis.from_url(args.redis_url)
    pubsub = redis.pubsub()
    ids = [f"direct-{i}" for i in range(args.streams)]
    recorder = Recorder()
    for i in range(0, len(ids), 500):
        await pubsub.subscribe(*[keys.tokens(r) for r in ids[i:i + 500]])
    for _ in range(len(ids)):  # the confirmations
        while (await pubsub.get_message(timeout=5)) is None:
            pass
    prefix = len(keys.tokens(""))

    async def enqueue() -> None:  # ramped like the gateway phase, so phases spread the same way
        for req_id in ids:
            request = GenerationRequest(req_id, args.model, [1, 2, 3],
                                        SamplingParams(max_tokens=args.tokens))
            await redis.xadd(keys.queue(args.model), QueueEntry(request).encode())
            recorder.opened_at.append(time.monotonic())
            await asyncio.sleep(args.ramp_s / len(ids))

    adding = asyncio.create_task(enqueue())
    finished = 0
    while finished < len(ids):
        message = await pubsub.get_message(timeout=30)
        if message is None:
            break
        now = time.monotonic()
        if message["type"] != "message":
            continue
        event = TokenEvent.unpack(message["data"])
        req_id = message["channel"].decode()[prefix - 1:-1]  # inside the {id} tag
        times = recorder.received.setdefault(req_id, [])
        times.extend([now] * len(event.token_ids))
        if event.is_final:
            finished += 1
            recorder.closed_at.append(now)
    await adding
    await pubsub.aclose()
    await redis.aclose()
    return recorder


def latencies(recorder: Recorder, worker_log: dict) -> list[tuple[float, float]]:
    """(publish time, receive − publish) of every token received."""
    ticks, starts, period = worker_log["tick_times"], worker_log["starts"], worker_log["period"]
    out = []
    for req_id, times in recorder.received.items():
        start = starts.get(req_id)
        if start is None:
            continue
        out.extend((ticks[start + k * period], t - ticks[start + k * period])
                   for k, t in enumerate(times) if start + k * period < len(ticks))
    return out


def by_phase(samples: list[tuple[float, float]], all_open: float, first_closed: float
             ) -> dict[str, list[float]]:
    """Latencies by the phase their event was published in (see the module's docstring)."""
    phases: dict[str, list[float]] = {"overall": [], "ramp": [], "steady": [], "tail": []}
    for published, latency in samples:
        phases["overall"].append(latency)
        phase = "ramp" if published < all_open else "steady" if published < first_closed else "tail"
        phases[phase].append(latency)
    return phases


def ms(value: float) -> float:
    return round(value * 1e3, 2)


def wait_http(url: str, timeout_s: float = 120) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.2)
    raise RuntimeError("the gateway did not start")


def main_run(args: argparse.Namespace) -> None:
    from kvfleet.shared.models import DEFAULT_MODEL, load_tokenizer, resolve_model_path
    from kvfleet.shared.redis_server import EmbeddedRedis, free_port

    raise_fd_limit()
    args.model = DEFAULT_MODEL
    tokenizer = load_tokenizer(resolve_model_path(DEFAULT_MODEL))
    token_id = tokenizer.encode(" the")[0]
    me = [sys.executable, "-m", "benchmarks.gateway_load"]  # the roles below, this checkout
    root = Path(__file__).resolve().parents[1]
    with EmbeddedRedis() as server, tempfile.TemporaryDirectory() as tmp:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        worker_out = str(Path(tmp) / "worker.json")
        gateway = subprocess.Popen(me + ["gateway", "--port", str(port), "--redis-url",
                                         server.url], cwd=root)
        worker = subprocess.Popen(me + ["worker", "--redis-url", server.url, "--model",
                                        args.model, "--interval-ms", str(args.interval_ms),
                                        "--token-id", str(token_id), "--out", worker_out], cwd=root)
        try:
            wait_http(url)
            via_gateway, mem = asyncio.run(through_gateway(args, url, gateway.pid))
            args.redis_url = server.url
            direct = asyncio.run(direct_pubsub(args))
        finally:
            worker.send_signal(signal.SIGTERM)
            gateway.send_signal(signal.SIGINT)
            for proc in (worker, gateway):
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        worker_log = json.loads(Path(worker_out).read_text())
    report(args, via_gateway, direct, mem, worker_log)


def report(args, via_gateway: Recorder, direct: Recorder, mem: dict, worker_log: dict) -> None:
    all_times = [t for times in via_gateway.received.values() for t in times]
    tokens = len(all_times)
    span_s = max(all_times) - min(all_times) if all_times else float("nan")
    gw_open, gw_closed = via_gateway.phases(args.streams)
    dr_open, dr_closed = direct.phases(args.streams)
    gw = by_phase(latencies(via_gateway, worker_log), gw_open, gw_closed)
    dr = by_phase(latencies(direct, worker_log), dr_open, dr_closed)
    steady_events = sum(gw_open <= t < gw_closed for t in all_times)

    def pct(values: list[float]) -> dict:
        return {"p50": ms(quantile(values, 0.5)), "p99": ms(quantile(values, 0.99)),
                "events": len(values)}

    def added(phase: str) -> dict:
        return {q: ms(quantile(gw[phase], v) - quantile(dr[phase], v))
                for q, v in (("p50", 0.5), ("p99", 0.99))}

    def added_bound(phase: str) -> float:
        """p99 through the gateway − p50 of the baseline: an upper bound on the added p99 that a
        baseline tail disturbed by other load on the machine cannot make negative."""
        return ms(quantile(gw[phase], 0.99) - quantile(dr[phase], 0.5))

    phases = ("overall", "ramp", "steady", "tail")
    result = {
        "streams": args.streams, "tokens_per_stream": args.tokens,
        "interval_ms": args.interval_ms,
        "offered_events_per_s": round(args.streams * 1000 / args.interval_ms),
        "max_concurrent_streams": via_gateway.max_open, "errors": via_gateway.errors,
        "complete_streams": sum(len(t) == args.tokens for t in via_gateway.received.values()),
        "events_delivered": tokens, "events_per_s": round(tokens / span_s, 1),
        "steady_state_s": round(gw_closed - gw_open, 1) if gw_closed < float("inf") else None,
        "steady_events_per_s": (round(steady_events / (gw_closed - gw_open), 1)
                                if gw_closed < float("inf") else None),
        "added_latency_ms": {phase: added(phase) for phase in phases},
        "added_p99_bound_ms": {phase: added_bound(phase) for phase in phases},
        "gateway_latency_ms": {phase: pct(gw[phase]) for phase in phases},
        "direct_pubsub_latency_ms": {phase: pct(dr[phase]) for phase in phases},
        "gateway_rss_mb": {"before": round(mem["base_rss"] / 2**20, 1),
                           "peak": round(mem["peak_rss"] / 2**20, 1)},
        "memory_per_stream_kb": round((mem["peak_rss"] - mem["base_rss"]) / args.streams / 1024,
                                      1),
        "mean_gateway_latency_ms": ms(statistics.fmean(gw["overall"])) if gw["overall"] else None,
        "phase_wall_s": round(mem["wall_s"], 1),
        "gateway_cpu_s": round(mem["gateway_cpu_s"], 1),
        "gateway_system_cpu_share": round(mem["gateway_system_cpu_s"] / mem["gateway_cpu_s"], 2),
        "gateway_cpu_us_per_event": round(mem["gateway_cpu_s"] / max(tokens, 1) * 1e6, 1),
        "steady_gateway_cpu_us_per_event": (
            round(mem["steady_gateway_cpu_s"] / steady_events * 1e6, 1) if steady_events else None),
        "client_cpu_s": round(mem["client_cpu_s"], 1),
    }
    print(json.dumps(result, indent=2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="role")
    run = sub.add_parser("run", help="the benchmark (default)")
    for p in (parser, run):
        p.add_argument("--streams", type=int, default=2000)
        p.add_argument("--tokens", type=int, default=64, help="tokens per stream")
        p.add_argument("--interval-ms", type=float, default=250,
                       help="the worker publishes one token per stream every interval")
        p.add_argument("--ramp-s", type=float, default=5.0, help="time to open all streams")
    gw = sub.add_parser("gateway")
    gw.add_argument("--port", type=int, required=True)
    gw.add_argument("--redis-url", required=True)
    wk = sub.add_parser("worker")
    wk.add_argument("--redis-url", required=True)
    wk.add_argument("--model", required=True)
    wk.add_argument("--interval-ms", type=float, required=True)
    wk.add_argument("--token-id", type=int, required=True)
    wk.add_argument("--out", required=True)
    args = parser.parse_args()
    if args.role == "gateway":
        run_gateway(args)
    elif args.role == "worker":
        asyncio.run(worker_loop(args))
    else:
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        main_run(args)


if __name__ == "__main__":
    main()
