"""KV handoff (issue 38), three measures in one run on the default model at the default settings:

    .venv/bin/python -m benchmarks.handoff                     # drain, transfer, prefill apart
    .venv/bin/python -m benchmarks.handoff --skip-split        # drain and transfer only
    .venv/bin/python -m benchmarks.handoff --streams 4 --skip-split   # a quick try

1. **Drain against today's stop-and-resume.** `--streams` (16) streams with 1-2k tokens of context
   (token-id prompts of 1,000-1,800 tokens, `--max-tokens` 200 each, the last 4 seeded sampling,
   the rest greedy) run on one worker ("victim"); a second one ("peer", `--role decode`: it
   takes no new request, only streams handed over and orphans) waits. Once every stream has `--signal-after` (24) tokens, the victim gets
   - SIGTERM: it drains, handing every stream with its KV to the peer (this issue), or
   - SIGINT: it stops at once, as SIGTERM did before: the peer resumes every stream from its
     checkpoint once the victim's heartbeat has expired (the default TTL, 5 s), re-prefilling it.
   Reported per mode: the longest gap between two tokens of any stream (and the median over
   streams of each stream's longest), the prompt tokens the peer computed (0 = no recompute),
   and whether every answer equals the reference (the same streams on one worker, undisturbed).
2. **Transfer.** The handoffs' payload bytes per second on the peer's transfer plane (from its
   metrics: bytes over their seconds on the wire) beside `measure_wire_rate`, a raw TCP transfer
   of 256 MiB over loopback with the same socket options, measured in the same run.
3. **Prefill apart from decode.** 16 streams decode (prompts of ~100 tokens, `--split-decode-
   tokens` each); after a 6 s window without a burst, 16 prompts of 1.5k tokens (16 tokens each)
   arrive at once. The decoding streams' ITL p99 in the burst window (from its start until every
   burst request finished) over their ITL p99 in the window before; with 1 `--role prefill` + 1
   `--role decode` worker, and with 2 workers that do both; and each fleet's total output
   tokens/s over the whole run.

Workers: `kvfleet worker` processes (`--num-threads 1` each: two workers on a 2-core host,
`--kv-memory 1GiB`), one gateway, an embedded Redis; OMP_WAIT_POLICY=PASSIVE as `kvfleet up`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import re
import signal
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import torch

from kvfleet.shared.cpu_features import cpu_features
from kvfleet.shared.models import DEFAULT_MODEL
from kvfleet.shared.redis_connect import connect
from kvfleet.shared.redis_server import EmbeddedRedis
from kvfleet.shared.wire import Heartbeat, RequestRecord
from kvfleet.shared.wire.checkpoint import TOKEN_BYTES
from tests.helpers.processes import ProcessFleet
from kvfleet.worker.handoff.transfer import Outgoing, TcpTransferPlane, measure_wire_rate

WORKER_FLAGS = ["--kv-memory", "1GiB", "--num-threads", "1", "--dtype", "auto",
                "--handoff-advertise-host", "127.0.0.1"]
VOCAB = (200, 48_000)  # token ids drawn from here (SmolLM2's vocabulary is 49,152)


@dataclass
class Stream:
    """One streamed completion as its client saw it."""

    body: dict
    req_id: str = ""
    text: str = ""
    times: list[float] = field(default_factory=list)  # monotonic arrival of content chunks
    tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None

    def gaps(self, t0: float = 0.0, t1: float = float("inf")) -> list[float]:
        """Gaps between consecutive chunks that ended within [t0, t1)."""
        return [b - a for a, b in zip(self.times, self.times[1:]) if t0 <= b < t1]


def stream(url: str, s: Stream) -> None:
    pieces = []
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=s.body, timeout=900) as response:
            if response.status_code != 200:
                s.error = f"HTTP {response.status_code}: {response.read()[:300]!r}"
                return
            for line in response.iter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    s.error = str(chunk["error"])
                    continue
                s.req_id = s.req_id or chunk.get("id", "")
                if chunk.get("usage"):
                    s.tokens = chunk["usage"]["completion_tokens"]
                for choice in chunk.get("choices", []):
                    if choice.get("text"):
                        pieces.append(choice["text"])
                        s.times.append(time.monotonic())
                    if choice.get("finish_reason"):
                        s.finish_reason = choice["finish_reason"]
    except httpx.HTTPError as exc:
        s.error = f"{type(exc).__name__}: {exc}"
    s.text = "".join(pieces)


def body(prompt: list[int], max_tokens: int, seed: int | None) -> dict:
    body = {"model": DEFAULT_MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    if seed is None:
        body["temperature"] = 0
    else:
        body.update(temperature=0.8, top_p=0.95, seed=seed)
    return body


def prompts(n: int, low: int, high: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(*VOCAB) for _ in range(rng.randrange(low, high + 1))] for _ in range(n)]


def start(url: str, bodies: list[dict]) -> tuple[list[Stream], list[threading.Thread]]:
    streams = [Stream(b) for b in bodies]
    threads = [threading.Thread(target=stream, args=(url, s), daemon=True) for s in streams]
    for thread in threads:
        thread.start()
    return streams, threads


def join(threads: list[threading.Thread]) -> None:
    for thread in threads:
        thread.join(timeout=1200)


def metric(url: str, name: str) -> float:
    total = 0.0
    for line in httpx.get(url, timeout=10).text.splitlines():
        if line.startswith(name + "{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def beat(client, fleet: ProcessFleet, worker_id: str) -> Heartbeat:
    return Heartbeat.decode(client.hgetall(fleet.keys.worker(worker_id)))


def wait_until(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.05)


# ---- 1. and 2.: drain --------------------------------------------------------------------------

def drain_run(redis_url: str, log_dir: Path, bodies: list[dict], mode: str | None,
              signal_after: int) -> dict:
    """The victim takes every stream (the peer, `--role decode`, takes no new request, only
    streams handed over and orphans); `mode` sigterm / sigint / None (undisturbed, no peer: the
    reference)."""
    fleet = ProcessFleet(redis_url, log_dir, worker_flags=WORKER_FLAGS)
    client = connect(redis_url)
    keys = fleet.keys
    try:
        (victim,) = fleet.start("victim")
        if mode is not None:
            fleet.worker_flags = [*WORKER_FLAGS, "--role", "decode"]
            fleet.start_worker("peer")
        streams, threads = start(fleet.url, bodies)
        wait_until(lambda: all(s.req_id for s in streams) and all(
            client.hget(keys.request(s.req_id), RequestRecord.WORKER) == b"victim"
            for s in streams), 600, "the victim to take every stream")
        if mode is None:
            join(threads)
            return {"streams": streams}
        peer_metrics = beat(client, fleet, "peer").metrics_url
        prompt_before = metric(peer_metrics, "kvfleet_worker_prompt_tokens_total")
        wait_until(lambda: min(client.strlen(keys.checkpoint(s.req_id)) // TOKEN_BYTES
                               for s in streams) >= signal_after, 900,
                   f"{signal_after} tokens in every stream")
        signalled = time.monotonic()
        victim.popen.send_signal(signal.SIGTERM if mode == "sigterm" else signal.SIGINT)
        join(threads)
        victim.wait_exit(timeout_s=120)
        peer = beat(client, fleet, "peer")
        return {
            "streams": streams, "signalled": signalled, "victim_exit": victim.popen.returncode,
            "peer_prompt_tokens": metric(peer.metrics_url, "kvfleet_worker_prompt_tokens_total")
            - prompt_before,
            "handoffs_in": peer.handoffs_in,
            "fallbacks": metric(peer.metrics_url, "kvfleet_worker_handoff_fallbacks_total"),
            "payload_bytes": metric(peer.metrics_url,
                                    "kvfleet_worker_handoff_received_payload_bytes"),
            "payload_seconds": metric(peer.metrics_url,
                                      "kvfleet_worker_handoff_received_payload_seconds"),
            "handoff_s": handoff_seconds(peer.metrics_url),
        }
    finally:
        fleet.stop()
        client.close()


def handoff_seconds(url: str) -> tuple[float, float]:
    """(sum, count) of the taker's handoff_seconds histogram."""
    text = httpx.get(url, timeout=10).text
    total = re.search(r"^kvfleet_worker_handoff_seconds_sum\{.*\} (\S+)$", text, re.M)
    count = re.search(r"^kvfleet_worker_handoff_seconds_count\{.*\} (\S+)$", text, re.M)
    return (float(total[1]) if total else 0.0, float(count[1]) if count else 0.0)


def drain_bench(redis_url: str, log_dir: Path, args) -> dict:
    contexts = prompts(args.streams, 1000, 1800, seed=38)
    n = len(contexts)
    bodies = [body(p, args.max_tokens, None if i < n - min(4, n // 4) else 3800 + i)
              for i, p in enumerate(contexts)]
    print(f"# drain: {n} streams, prompts {min(map(len, contexts))}-{max(map(len, contexts))} "
          f"tokens + {args.max_tokens} generated", flush=True)
    reference = drain_run(redis_url, log_dir, bodies, None, args.signal_after)["streams"]
    bad = [s.error for s in reference if s.error or s.finish_reason != "length"]
    if bad:
        raise SystemExit(f"reference run failed: {bad[:3]}")
    results = {}
    for mode in ("sigterm", "sigint"):
        run = drain_run(redis_url, log_dir, bodies, mode, args.signal_after)
        streams = run["streams"]
        longest = [max(s.gaps(), default=0.0) for s in streams]
        run.update(
            identical=sum(s.text == r.text for s, r in zip(streams, reference)),
            lost=sum(1 for s in streams if s.error or s.finish_reason != "length"),
            max_gap=max(longest), median_gap=statistics.median(longest))
        results[mode] = run
        print(f"  {mode}: longest gap {run['max_gap']:.2f} s (median of streams' longest "
              f"{run['median_gap']:.2f} s); identical {run['identical']}/{n}; lost {run['lost']}; "
              f"peer prompt tokens computed {run['peer_prompt_tokens']:.0f}; handoffs in "
              f"{run['handoffs_in']}; fallbacks {run['fallbacks']:.0f}; victim exit "
              f"{run['victim_exit']}", flush=True)
    return results


def plane_rate(num_bytes: int, count: int) -> float:
    """Bytes per second of `count` whole fetches (connection, request, reply) of a `num_bytes`
    payload between two planes over loopback, one at a time: the median fetch."""
    payload = torch.zeros(num_bytes, dtype=torch.uint8)
    source = TcpTransferPlane("127.0.0.1", 0, "127.0.0.1")
    taker = TcpTransferPlane("127.0.0.1", 0, "127.0.0.1")
    addr = source.start(lambda handoff_id: Outgoing(b"{}", [payload.numpy()]))
    try:
        rates = []
        for i in range(count):
            started = time.perf_counter()
            _, got = taker.fetch(addr, f"bench-{i}", 60)
            rates.append(got.nbytes / (time.perf_counter() - started))
        return statistics.median(rates)
    finally:
        source.close()
        taker.close()


# ---- 3.: prefill apart -------------------------------------------------------------------------

def split_run(redis_url: str, log_dir: Path, roles: list[str], args) -> dict:
    fleet = ProcessFleet(redis_url, log_dir, worker_flags=WORKER_FLAGS)
    try:
        fleet.start_gateway(wait=False)
        for i, role in enumerate(roles):
            fleet.worker_flags = [*WORKER_FLAGS, "--role", role]
            fleet.start_worker(f"{role}-{i}", wait=False)
        fleet.wait_gateway()
        for worker_id in fleet.workers:
            fleet.wait_worker(worker_id)
        decoding = [body(p, args.split_decode_tokens, None)
                    for p in prompts(16, 90, 110, seed=39)]
        burst = [body(p, args.burst_tokens, None) for p in prompts(16, 1500, 1500, seed=40)]
        client = connect(redis_url)
        # the decode steps' own pace: the steps of the workers that decode the 16 streams
        decoders = [beat(client, fleet, w).metrics_url for w in fleet.workers
                    if not w.startswith("prefill")]
        client.close()
        t0 = time.monotonic()
        streams, threads = start(fleet.url, decoding)
        wait_until(lambda: all(len(s.times) >= 8 for s in streams), 600, "decoding streams")
        calm_start = time.monotonic()
        steps_calm = step_buckets(decoders)
        time.sleep(args.calm_s)
        burst_start = time.monotonic()
        steps_burst = step_buckets(decoders)
        bursts, burst_threads = start(fleet.url, burst)
        join(burst_threads)
        burst_end = time.monotonic()
        steps_end = step_buckets(decoders)
        join(threads)
        t1 = time.monotonic()
        calm = [g for s in streams for g in s.gaps(calm_start, burst_start)]
        during = [g for s in streams for g in s.gaps(burst_start, burst_end)]
        tokens = sum(s.tokens for s in streams + bursts)
        errors = [s.error for s in streams + bursts if s.error]
        if errors:
            raise SystemExit(f"split run {roles}: {errors[:3]}")
        return {"calm_p99": percentile(calm, 99), "burst_p99": percentile(during, 99),
                "calm_p90": percentile(calm, 90), "burst_p90": percentile(during, 90),
                "burst_max": max(during, default=float("nan")),
                "step_calm_p99": bucket_quantile(steps_calm, steps_burst, 99),
                "step_burst_p99": bucket_quantile(steps_burst, steps_end, 99),
                "calm_p50": percentile(calm, 50), "burst_p50": percentile(during, 50),
                "burst_s": burst_end - burst_start, "tokens_per_s": tokens / (t1 - t0),
                "burst_ttft": statistics.median(s.times[0] - burst_start for s in bursts)}
    finally:
        fleet.stop()


def step_buckets(urls: list[str]) -> dict[float, float]:
    """Cumulative counts of the workers' step_duration_seconds buckets, summed, by upper bound."""
    counts: dict[float, float] = {}
    for url in urls:
        for line in httpx.get(url, timeout=10).text.splitlines():
            found = re.match(r'kvfleet_worker_step_duration_seconds_bucket\{.*le="([^"]+)".*\} (\S+)$',
                             line)
            if found:
                bound = float(found[1])
                counts[bound] = counts.get(bound, 0.0) + float(found[2])
    return counts


def bucket_quantile(before: dict[float, float], after: dict[float, float], q: float) -> float:
    """The q-quantile of the steps between two scrapes, interpolated within its bucket as
    Prometheus' histogram_quantile does."""
    bounds = sorted(after)
    counts = [after[b] - before.get(b, 0.0) for b in bounds]
    total = counts[-1]
    if total <= 0:
        return float("nan")
    rank = q / 100 * total
    lower, below = 0.0, 0.0
    for bound, count in zip(bounds, counts):
        if count >= rank:
            if bound == float("inf"):
                return lower
            return lower + (bound - lower) * (rank - below) / max(count - below, 1e-9)
        lower, below = bound, count
    return bounds[-1]


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def split_bench(redis_url: str, log_dir: Path, args) -> dict:
    print("# prefill apart: 16 decoding streams, then a burst of 16 x 1.5k-token prompts",
          flush=True)
    results = {}
    configs = {"split": ("1 prefill + 1 decode", ["prefill", "decode"]),
               "both": ("2 both", ["both", "both"])}
    for key in args.split_configs.split(","):
        name, roles = configs[key]
        run = split_run(redis_url, log_dir, roles, args)
        results[name] = run
        print(f"  {name}: decoding streams' ITL p99 {run['calm_p99'] * 1000:.0f} ms without a "
              f"burst, {run['burst_p99'] * 1000:.0f} ms during it ({run['burst_p99'] / run['calm_p99']:.2f}x); "
              f"p50 {run['calm_p50'] * 1000:.0f} -> {run['burst_p50'] * 1000:.0f} ms, p90 "
              f"{run['calm_p90'] * 1000:.0f} -> {run['burst_p90'] * 1000:.0f} ms, max "
              f"{run['burst_max'] * 1000:.0f} ms; the decoding workers' steps p99 "
              f"{run['step_calm_p99'] * 1000:.0f} -> {run['step_burst_p99'] * 1000:.0f} ms "
              f"({run['step_burst_p99'] / run['step_calm_p99']:.2f}x); burst "
              f"{run['burst_s']:.1f} s, its TTFT median {run['burst_ttft']:.1f} s; total "
              f"{run['tokens_per_s']:.1f} tok/s", flush=True)
    return results


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--signal-after", type=int, default=24)
    parser.add_argument("--split-decode-tokens", type=int, default=400)
    parser.add_argument("--calm-s", type=float, default=6.0)
    parser.add_argument("--burst-tokens", type=int, default=16,
                        help="tokens each burst request generates")
    parser.add_argument("--split-configs", default="split,both",
                        help="which fleets: split (1 prefill + 1 decode), both (2 both)")
    parser.add_argument("--skip-drain", action="store_true")
    parser.add_argument("--skip-split", action="store_true")
    parser.add_argument("--json", type=Path, help="write the results here")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    os.environ.setdefault("GOMP_SPINCOUNT", "10000")
    print(f"# {datetime.date.today()}; CPU {cpu_features().describe()}; {os.cpu_count()} cores; "
          f"model {DEFAULT_MODEL}, --dtype auto", flush=True)
    report: dict = {}
    with tempfile.TemporaryDirectory() as tmp, EmbeddedRedis() as server:
        log_dir = Path(tmp)
        if not args.skip_drain:
            drain = drain_bench(server.url, log_dir, args)
            run = drain["sigterm"]
            size = int(run["payload_bytes"] / max(run["handoffs_in"], 1))
            wire = statistics.median(measure_wire_rate(256 << 20) for _ in range(3))
            alone = plane_rate(size, 16) if size else 0.0
            during = run["payload_bytes"] / run["payload_seconds"] if run["payload_seconds"] else 0
            print(f"# transfer: the plane alone {alone / 1e9:.2f} GB/s (16 fetches of a handoff's "
                  f"{size / 1e6:.1f} MB, whole fetches, median), wire (raw TCP, loopback, 256 MiB, "
                  f"median of 3) {wire / 1e9:.2f} GB/s: {alone / wire:.2f}x; during the drain "
                  f"(both workers stepping on {os.cpu_count()} cores) {during / 1e9:.2f} GB/s "
                  f"over {run['payload_bytes'] / 1e6:.0f} MB; taker's handoff time (export + "
                  f"transfer + fence) mean "
                  f"{run['handoff_s'][0] / max(run['handoff_s'][1], 1) * 1000:.0f} ms", flush=True)
            gap_ratio = drain["sigint"]["max_gap"] / drain["sigterm"]["max_gap"]
            print(f"# drain vs stop-and-resume: longest gap {gap_ratio:.1f}x shorter "
                  f"(target >= 5x)", flush=True)
            report["drain"] = {mode: {k: v for k, v in run.items() if k != "streams"}
                               for mode, run in drain.items()}
            report["transfer"] = {"plane_alone_bytes_per_s": alone, "wire_bytes_per_s": wire,
                                  "plane_during_drain_bytes_per_s": during}
        if not args.skip_split:
            report["split"] = split_bench(server.url, log_dir, args)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
