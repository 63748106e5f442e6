"""Speculative decoding over HTTP (issue 36): output tokens/s per stream on the quoting workload
at 1 and 4 streams, and aggregate tokens/s on chat-mix at 64 streams, for kvfleet without
speculation, kvfleet with each speculative method, and vLLM's CPU build (which has none); whether
every answer with speculation is the one without, greedy and seeded; the acceptance rate.

    .venv/bin/python -m benchmarks.speculation                          # ngram, vLLM, 1 round
    .venv/bin/python -m benchmarks.speculation --methods ngram,suffix --rounds 3
    .venv/bin/python -m benchmarks.speculation --num-requests 4 --skip-vllm \\
        --workloads quoting --quoting-streams 1 --sampling greedy        # a quick try

The systems: `kvfleet up` (one worker, default dtype) plain, then once per method with
`--speculative-config '{"method": M, "num_speculative_tokens": K}'` (`--speculative-config JSON`
adds any other configuration), and vLLM's OpenAI server, plain (benchmarks/vllm_env.sh; skipped
with a message when its virtualenv is missing; `--dtype` what kvfleet's auto picks on this CPU).
Every run gets a server of its own, started on this machine, timed to its first answer, warmed
up with one short request unrelated to the workloads, stopped after the run: a server that had
served the same requests would hold them in its prefix cache, and suffix decoding in its tree of
recent outputs. One client for all: `kvfleet bench`'s (kvfleet/bench/client.py, loadgen.py),
streaming, closed loop: each of N streams sends its next request when its previous answer ends.

- Quoting (benchmarks/data/quoting-32.jsonl, benchmarks/quoting_trace.py): chat messages to
  /v1/chat/completions, each request's own max_tokens, answers end where the model ends them.
  Per stream: the median over requests of output tokens ÷ (last content chunk - first content
  chunk); aggregate: all output tokens ÷ first send to last finish.
- chat-mix (benchmarks/data/chat-mix-64.jsonl): raw prompts to /v1/completions, ignore_eos, as
  benchmarks/http_peers.py sends them; aggregate tokens/s.
- Greedy (temperature 0) at each stream count; seeded sampling (temperature 0.8, top_p 0.95, a
  seed per request from a hash of its body) once more at each workload's most streams, kvfleet
  only. Both give throughputs: chat-mix's greedy answers (ignore_eos, a 135M model) fall into
  loops that n-gram proposers predict, so its seeded rows are the case where little repeats.
  Identity: every request's text and token count with speculation equal the plain kvfleet run's
  of the same round, workload, streams and sampling. The control row compares plain kvfleet's
  greedy quoting answers at 1 and at 4 streams (batching alone).
- Acceptance: accepted ÷ draft tokens, and the mean accepted length (1 + accepted ÷ drafts),
  from the worker's `kvfleet_worker_spec_decode_*` counters (its /metrics, found by its heartbeat
  through the gateway's /dashboard/data) before and after each run; "n/a" without them.

`--rounds N` runs every system once per round, in the same order, N rounds; the tables give
medians, and each ratio is the median over the rounds of that round's ratio (benchmarks/
http_peers.py says why). Any failed request fails the run (exit 1, after the tables). OpenMP,
math-library and allocator variables of this shell (OMP_*, GOMP_*, KMP_*, LD_PRELOAD, MALLOC_*,
...) are dropped for the servers (benchmarks/peer_env.py): `kvfleet up` then gives its worker
its own OpenMP settings, as a user's fleet gets them, and vLLM gets its own setup.

Time: every run starts a server (kvfleet ~20 s, vLLM ~2 min on a 2-core host); the full default
run is 10 kvfleet runs and 2 vLLM runs a round.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from benchmarks.http_peers import WORKLOAD as CHAT_MIX, free_port, stop_session, wait_first_answer
from benchmarks.peer_env import dropped_line, peer_env
from benchmarks.quoting_trace import OUT as QUOTING, load_requests
from benchmarks.vllm_peer import REPO, SETUP_HINT, SETUPS, VllmServer, describe_setup, vllm_python
from kvfleet.bench.client import BenchTarget, RequestRecord
from kvfleet.bench.loadgen import LoadSpec, RunResult, replay
from kvfleet.bench.trace import TraceRequest, load_trace
from kvfleet.shared.cpu_features import cpu_features
from kvfleet.shared.models import DEFAULT_MODEL, resolve_model_path
from kvfleet.shared.settings import WorkerSettings

# the worker's counters in vLLM's names (vllm:spec_decode_*), under kvfleet_worker_ (or kvfleet_)
SPEC_COUNTERS = {"drafts": "spec_decode_num_drafts_total",
                 "draft_tokens": "spec_decode_num_draft_tokens_total",
                 "accepted": "spec_decode_num_accepted_tokens_total"}
SEEDED_TEMPERATURE = 0.8
SEEDED_EXTRA = {"top_p": 0.95}  # and a seed per request: SamplingTransport
# the worker updates its /metrics with its heartbeat (1 s by default): a run's last steps are
# counted this long after it ends
METRICS_SETTLE_S = 2.5
TARGET_QUOTING_PER_STREAM = 2.0  # issue 36: x plain kvfleet, at 1 and 4 streams
TARGET_CHAT_MIX_AGGREGATE = 0.97
METRIC_LABELS = {"per_stream_tokens_per_s": "per-stream tok/s",
                 "aggregate_tokens_per_s": "aggregate tok/s"}


@dataclass(frozen=True)
class Workload:
    name: str
    endpoint: str  # kvfleet.bench.client.ENDPOINT_PATHS key
    requests: tuple[TraceRequest, ...]


@dataclass(frozen=True)
class System:
    name: str
    speculative_config: dict | None = None  # kvfleet only
    vllm: bool = False


@dataclass(frozen=True)
class RunKey:
    workload: str
    streams: int
    sampling: str  # "greedy" | "seeded"

    def label(self) -> str:
        return f"{self.workload}, {self.streams} stream{'s' * (self.streams > 1)}, {self.sampling}"


@dataclass
class Acceptance:
    drafts: float
    draft_tokens: float
    accepted: float

    @property
    def rate(self) -> float | None:
        return self.accepted / self.draft_tokens if self.draft_tokens else None

    @property
    def mean_length(self) -> float | None:
        """Tokens per verified draft, the bonus token included (vLLM's mean acceptance length)."""
        return 1 + self.accepted / self.drafts if self.drafts else None

    def describe(self) -> str:
        if self.rate is None:
            return "no drafts"
        return f"{self.rate:.2f} ({self.mean_length:.2f}/draft)"

    @staticmethod
    def describe_total(runs: list[Measurement], speculating: bool) -> str:
        """The runs' counters summed; "n/a" where a speculating server had none, "-" for a
        server that does not speculate."""
        found = [m.acceptance for m in runs if m.acceptance is not None]
        if not found:
            return "n/a" if speculating else "-"
        return Acceptance(*(sum(getattr(a, k) for a in found) for k in SPEC_COUNTERS)).describe()


@dataclass
class Measurement:
    system: str
    round: int
    key: RunKey
    num_requests: int
    num_ok: int
    output_tokens: int
    duration_s: float
    per_stream_tokens_per_s: float | None  # median over requests
    aggregate_tokens_per_s: float
    acceptance: Acceptance | None
    outputs: list[tuple[str, int] | None] = field(repr=False)  # (text, tokens); None: failed
    first_error: str | None = None
    load_average: float = 0.0  # the host's, 1 minute, as the run ended: others' work shows here


# ---------------------------------------------------------------- the client


class SamplingTransport(httpx.AsyncBaseTransport):
    """Adds top_p and a seed of its own to every request the bench client posts (its
    BenchTarget carries only a temperature). The seed is a hash of the body before the fields
    are added, so one request gets the same seed from every system and round."""

    def __init__(self, extra: dict, limits: httpx.Limits):
        self._extra = extra
        self._inner = httpx.AsyncHTTPTransport(limits=limits)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.method == "POST" and self._extra:
            body = json.loads(request.content)
            seed = zlib.crc32(json.dumps(body, sort_keys=True).encode())
            content = json.dumps({**body, **self._extra, "seed": seed}).encode()
            headers = [(k, v) for k, v in request.headers.raw if k.lower() != b"content-length"]
            request = httpx.Request(request.method, request.url, headers=headers,
                                    content=content, extensions=request.extensions)
        return await self._inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self._inner.aclose()


async def _replay(url: str, workload: Workload, streams: int, sampling: str,
                  timeout_s: float) -> RunResult:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=max(streams, 20))
    seeded = sampling == "seeded"
    transport = SamplingTransport(SEEDED_EXTRA if seeded else {}, limits)
    temperature = SEEDED_TEMPERATURE if seeded else 0.0
    target = BenchTarget(DEFAULT_MODEL, workload.endpoint, timeout_s, temperature)
    async with httpx.AsyncClient(base_url=url, transport=transport, timeout=timeout_s) as client:
        return await replay(client, target, list(workload.requests),
                            LoadSpec(rate=math.inf, concurrency=streams))


def stream_tokens_per_s(record: RequestRecord) -> float | None:
    """Output tokens ÷ (last content chunk - first content chunk); None for a failed request or
    an answer in one chunk."""
    offsets = record.chunk_offsets_s
    if not record.ok or len(offsets) < 2 or offsets[-1] <= offsets[0]:
        return None
    return record.output_tokens / (offsets[-1] - offsets[0])


def measure(system: System, round_index: int, url: str, workload: Workload, streams: int,
            sampling: str, timeout_s: float) -> Measurement:
    before = spec_counters(url) if system.speculative_config else None
    result = asyncio.run(_replay(url, workload, streams, sampling, timeout_s))
    after = spec_counters(url) if system.speculative_config else None
    records = result.records
    paces = [p for p in map(stream_tokens_per_s, records) if p is not None]
    tokens = sum(r.output_tokens or 0 for r in records if r.ok)
    acceptance = (Acceptance(*(after[k] - before[k] for k in SPEC_COUNTERS))
                  if before is not None and after is not None else None)
    return Measurement(
        system.name, round_index, RunKey(workload.name, streams, sampling), len(records),
        sum(r.ok for r in records), tokens, result.duration_s,
        statistics.median(paces) if paces else None, tokens / max(result.duration_s, 1e-9),
        acceptance, [(r.text, r.output_tokens) if r.ok else None for r in records],
        next((r.error for r in records if r.error), None), os.getloadavg()[0])


def spec_counters(gateway_url: str) -> dict[str, float] | None:
    """The speculative decoding counters summed over the live workers' /metrics, once the last
    steps are in them; None when a worker has no metrics URL or none of the counters."""
    time.sleep(METRICS_SETTLE_S)
    rows = httpx.get(f"{gateway_url}/dashboard/data", timeout=10).json()["workers"]
    urls = [row["metrics_url"] for row in rows if row.get("metrics_url")]
    totals = {key: 0.0 for key in SPEC_COUNTERS}
    found = False
    for text in (httpx.get(u, timeout=10).text for u in urls):
        for key, name in SPEC_COUNTERS.items():
            pattern = rf"^kvfleet_(?:worker_)?{name}(?:\{{[^}}]*\}})? (\S+)$"
            for value in re.findall(pattern, text, re.M):
                totals[key] += float(value)
                found = True
    return totals if found else None


# ---------------------------------------------------------------- the servers


def kvfleet_up(port: int, speculative_config: dict | None, log_path: Path) -> subprocess.Popen:
    """`kvfleet up` with one worker at the default dtype, speculating when configured; its
    gateway's admission limit off, as benchmarks/http_peers.py runs it."""
    command = [sys.executable, "-m", "kvfleet", "up", "--port", str(port), "--workers", "1"]
    if speculative_config:
        command += ["--speculative-config", json.dumps(speculative_config)]
    env = peer_env({"KVFLEET_EMBEDDED_REDIS_PORT": str(free_port()),
                    "KVFLEET_MAX_QUEUE_WAIT_S": "0"})
    env.pop("KVFLEET_SPECULATIVE_CONFIG", None)  # the flag alone decides
    return subprocess.Popen(command, cwd=REPO, env=env, stdout=open(log_path, "w"),
                            stderr=subprocess.STDOUT, start_new_session=True)


@contextlib.contextmanager
def serving(system: System, args, vllm: Path | None, log_path: Path) -> Iterator[str]:
    """The system's server, started, answering, warmed up; its URL. Stopped on the way out."""
    port = free_port()
    started = time.perf_counter()
    if system.vllm:
        server = VllmServer(vllm, resolve_model_path(DEFAULT_MODEL), port, args.vllm_dtype,
                            log_path, served_name=DEFAULT_MODEL, setup=args.vllm_setup)
        process, url, stop = server.process, server.url, server.stop
    else:
        process = kvfleet_up(port, system.speculative_config, log_path)
        url, stop = f"http://127.0.0.1:{port}", lambda: stop_session(process)
    try:
        wait_first_answer(url, DEFAULT_MODEL, process, args.startup_timeout_s)
        print(f"  {system.name}: first answer {time.perf_counter() - started:.1f} s after start",
              flush=True)
        warm_up(url, args.timeout_s)
        yield url
    finally:
        stop()


def warm_up(url: str, timeout_s: float) -> None:
    """A short chat request, so that no measured request meets a cold path; about nothing in
    the workloads, so that it gives no proposer a head start."""
    hello = Workload("warm-up", "chat", (TraceRequest(0.0, "Say hello.", 8),))
    asyncio.run(_replay(url, hello, 1, "greedy", timeout_s))


def run_system(system: System, round_index: int, args, workloads: list[Workload],
               vllm: Path | None, log_dir: Path) -> list[Measurement]:
    """Every run of the system's plan, each on a server of its own: a worker that served the
    same requests before would hold them in its prefix cache, and suffix decoding in its tree
    of recent outputs (the 4-stream run's answers are the 1-stream run's)."""
    results = []
    for workload in workloads:
        if system.vllm and workload.name != "quoting":
            continue
        for key in plan(workload, args, with_seeded=not system.vllm):
            tag = (f"{re.sub(r'[^a-z0-9]+', '-', system.name.lower())}-{round_index + 1}-"
                   f"{key.workload}-{key.streams}-{key.sampling}")
            with serving(system, args, vllm, log_dir / f"{tag}.log") as url:
                m = measure(system, round_index, url, workload, key.streams, key.sampling,
                            args.timeout_s)
            print(f"  {system.name}, {key.label()}: {describe(m)}", flush=True)
            results.append(m)
            if args.log_dir:
                (log_dir / f"{tag}.json").write_text(json.dumps(asdict(m), indent=1))
    return results


def plan(workload: Workload, args, with_seeded: bool) -> list[RunKey]:
    """Greedy at each of the workload's stream counts; seeded at the most streams."""
    streams = args.quoting_streams if workload.name == "quoting" else args.chat_mix_streams
    keys = [RunKey(workload.name, n, "greedy") for n in streams if "greedy" in args.sampling]
    if with_seeded and "seeded" in args.sampling:
        keys.append(RunKey(workload.name, max(streams), "seeded"))
    return keys


def describe(m: Measurement) -> str:
    pace = f"{m.per_stream_tokens_per_s:.1f}" if m.per_stream_tokens_per_s else "-"
    text = (f"{m.output_tokens} tokens in {m.duration_s:.1f} s, per stream {pace} tok/s, "
            f"aggregate {m.aggregate_tokens_per_s:.1f} tok/s")
    if m.acceptance is not None:
        text += f", acceptance {m.acceptance.describe()}"
    if m.num_ok < m.num_requests:
        text += f"; {m.num_requests - m.num_ok} FAILED (first: {m.first_error})"
    return text + f"; load average {m.load_average:.1f}"


# ---------------------------------------------------------------- the report


def median_or_none(values: list[float | None]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def fmt(value: float | None, spec: str = ".1f", suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def ratio(results: list[Measurement], system: str, base: str, key: RunKey,
          metric: str) -> float | None:
    """Median over the rounds of `system`'s / `base`'s `metric` in the same round."""
    by = {(m.system, m.round): m for m in results if m.key == key}
    ratios = []
    for (name, round_index), m in by.items():
        other = by.get((base, round_index))
        if name == system and other and getattr(m, metric) and getattr(other, metric):
            ratios.append(getattr(m, metric) / getattr(other, metric))
    return statistics.median(ratios) if ratios else None


def print_throughput(results: list[Measurement], systems: list[System], rounds: int) -> None:
    plain = systems[0].name
    vllm_name = next((s.name for s in systems if s.vllm), None)
    keys = list(dict.fromkeys(m.key for m in results))
    med = "median " if rounds > 1 else ""
    for key in keys:
        print(f"\n### {key.label()}\n")
        print(f"| system | {med}per-stream tok/s | {med}aggregate tok/s | output tokens | "
              f"acceptance | per stream vs {plain} | aggregate vs {plain} | per stream vs vLLM |"
              + (" every round's per-stream tok/s |" if rounds > 1 else ""))
        print("|---|---:|---:|---:|---|---:|---:|---:|" + ("---|" if rounds > 1 else ""))
        for system in systems:
            runs = [m for m in results if m.key == key and m.system == system.name]
            if runs:
                print(throughput_row(results, runs, system, plain, vllm_name, rounds))


def throughput_row(results: list[Measurement], runs: list[Measurement], system: System,
                   plain: str, vllm_name: str | None, rounds: int) -> str:
    key = runs[0].key

    def versus(base: str | None, metric: str) -> str:
        return fmt(ratio(results, system.name, base, key, metric), ".2f", "x") if base else "-"

    cells = [system.name, fmt(median_or_none([m.per_stream_tokens_per_s for m in runs])),
             fmt(statistics.median(m.aggregate_tokens_per_s for m in runs)),
             str(runs[0].output_tokens),
             Acceptance.describe_total(runs, bool(system.speculative_config)),
             versus(plain, "per_stream_tokens_per_s"), versus(plain, "aggregate_tokens_per_s"),
             versus(vllm_name, "per_stream_tokens_per_s")]
    if rounds > 1:
        cells.append(" / ".join(fmt(m.per_stream_tokens_per_s) for m in runs))
    return "| " + " | ".join(cells) + " |"


def identical(a: Measurement, b: Measurement) -> tuple[int, int, str | None]:
    """(identical, compared, the first difference described) between two runs of the same
    requests."""
    same, first = 0, None
    for index, (x, y) in enumerate(zip(a.outputs, b.outputs)):
        if x is not None and x == y:
            same += 1
        elif first is None:
            first = describe_difference(index, x, y)
    return same, len(a.outputs), first


def describe_difference(index: int, x: tuple[str, int] | None, y: tuple[str, int] | None) -> str:
    if x is None or y is None:
        return f"request {index}: failed in {'the first' if x is None else 'the second'} run"
    at = next((i for i, (p, q) in enumerate(zip(x[0], y[0])) if p != q), min(len(x[0]), len(y[0])))
    return (f"request {index}: {x[1]} vs {y[1]} tokens, first difference at character {at}: "
            f"{x[0][max(0, at - 40):at + 40]!r} vs {y[0][max(0, at - 40):at + 40]!r}")


def print_identity(results: list[Measurement], systems: list[System]) -> list[bool]:
    """Identity rows per workload, sampling and speculating system (summed over stream counts and
    rounds), then the batching control; the verdicts of the rows with speculation."""
    plain = systems[0].name
    print(f"\n### Identical to {plain}\n")
    print("| workload | sampling | system | identical | acceptance | first difference |")
    print("|---|---|---|---:|---|---|")
    verdicts = []
    groups = dict.fromkeys((m.key.workload, m.key.sampling) for m in results)
    for workload, sampling in groups:
        for system in (s for s in systems if s.speculative_config):
            runs = [m for m in results if m.system == system.name
                    and (m.key.workload, m.key.sampling) == (workload, sampling)]
            same = total = 0
            first = None
            for m in runs:
                base = next((b for b in results if b.system == plain and b.key == m.key
                             and b.round == m.round), None)
                if base is not None:
                    run_same, run_total, run_first = identical(base, m)
                    same, total, first = same + run_same, total + run_total, first or run_first
            if total:
                verdicts.append(same == total)
                print(f"| {workload} | {sampling} | {system.name} | {same}/{total} | "
                      f"{Acceptance.describe_total(runs, True)} | {first or '-'} |")
    control = [(a, b) for a in results for b in results
               if a.system == b.system == plain and a.round == b.round
               and a.key.workload == b.key.workload == "quoting" and a.key.sampling == "greedy"
               == b.key.sampling and a.key.streams < b.key.streams]
    for a, b in control:
        same, total, first = identical(a, b)
        print(f"| quoting | greedy | {plain}, {a.key.streams} vs {b.key.streams} streams "
              f"(control, round {a.round + 1}) | {same}/{total} | - | {first or '-'} |")
    return verdicts


def print_targets(results: list[Measurement], systems: list[System], verdicts: list[bool]) -> None:
    plain = systems[0].name
    print()
    keys = dict.fromkeys(m.key for m in results)
    for system in (s for s in systems if s.speculative_config):
        for key in keys:
            quoting = key.workload == "quoting"
            metric = "per_stream_tokens_per_s" if quoting else "aggregate_tokens_per_s"
            target = TARGET_QUOTING_PER_STREAM if quoting else TARGET_CHAT_MIX_AGGREGATE
            value = ratio(results, system.name, plain, key, metric)
            verdict = "-" if value is None else ("met" if value >= target else "MISSED")
            print(f"target: {system.name}, {key.label()}: {METRIC_LABELS[metric]} "
                  f"{fmt(value, '.2f', 'x')} of {plain} (>= {target}x): {verdict}")
    if verdicts:
        print(f"target: outputs identical with speculation on every request: "
              f"{'met' if all(verdicts) else 'MISSED'}")


# ---------------------------------------------------------------- main


def names(text: str) -> list[str]:
    return [x for x in text.split(",") if x]


def ints(text: str) -> list[int]:
    return [int(x) for x in names(text)]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--methods", type=names, default=["ngram"],
                   help="speculative methods, one kvfleet server each (ngram, suffix, ...)")
    p.add_argument("--num-speculative-tokens", type=int, default=5)
    p.add_argument("--speculative-config", action="append", default=[], type=json.loads,
                   help="a whole configuration (JSON) run beside --methods; repeatable")
    p.add_argument("--workloads", type=names, default=["quoting", "chat-mix"])
    p.add_argument("--quoting", default=str(QUOTING))
    p.add_argument("--chat-mix", default=CHAT_MIX)
    p.add_argument("--num-requests", type=int, default=None,
                   help="the first N requests of each workload (default: all, 32 and 64)")
    p.add_argument("--quoting-streams", type=ints, default=[1, 4])
    p.add_argument("--chat-mix-streams", type=ints, default=[64])
    p.add_argument("--sampling", type=names, default=["greedy", "seeded"])
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--skip-vllm", action="store_true")
    p.add_argument("--vllm-venv", default=None)
    p.add_argument("--vllm-setup", default="tuned", choices=SETUPS)
    p.add_argument("--vllm-dtype", default="bfloat16" if cpu_features().native_bf16 else "float32",
                   help="default: what kvfleet's --dtype auto picks on this CPU")
    p.add_argument("--startup-timeout-s", type=float, default=600)
    p.add_argument("--timeout-s", type=float, default=3600, help="per request")
    p.add_argument("--json-out", default=None)
    p.add_argument("--log-dir", default=None,
                   help="keep the servers' logs and every run's answers here (default: a "
                        "temporary directory, removed)")
    return p.parse_args(argv)


def load_workloads(args) -> list[Workload]:
    known = {"quoting": lambda: Workload("quoting", "chat", tuple(
                 load_requests(args.quoting, args.num_requests))),
             "chat-mix": lambda: Workload("chat-mix", "completions", tuple(
                 load_trace(args.chat_mix, args.num_requests)))}
    if unknown := set(args.workloads) - set(known):
        raise SystemExit(f"--workloads: unknown {sorted(unknown)}; choose from {sorted(known)}")
    return [known[name]() for name in args.workloads]


def make_systems(args, vllm: Path | None) -> list[System]:
    configs = [{"method": m, "num_speculative_tokens": args.num_speculative_tokens}
               for m in args.methods] + args.speculative_config
    systems = [System("kvfleet")]
    if "speculative_config" not in WorkerSettings.model_fields:
        print("# kvfleet + speculation skipped: this kvfleet has no --speculative-config yet",
              flush=True)
    else:
        systems += [System(f"kvfleet + {c['method']}" + (
            f" k={c['num_speculative_tokens']}" if c in args.speculative_config else ""), c)
            for c in configs]
    if vllm is not None:
        systems.append(System("vLLM", vllm=True))
    return systems


def main(argv=None) -> int:
    args = parse_args(argv)
    # a SIGTERM unwinds like Ctrl-C, so that the server running now is stopped (it runs in a
    # session of its own, out of reach of a signal to this process group)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.rounds < 1:
        raise SystemExit("--rounds must be at least 1")
    if unknown := set(args.sampling) - {"greedy", "seeded"}:
        raise SystemExit(f"--sampling: unknown {sorted(unknown)}; choose from greedy, seeded")
    workloads = load_workloads(args)
    skip_vllm = args.skip_vllm or "quoting" not in args.workloads
    vllm = None if skip_vllm else vllm_python(args.vllm_venv)
    print(f"# {datetime.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}; CPU "
          f"{cpu_features().describe()}; {os.cpu_count()} CPUs; load average "
          f"{os.getloadavg()[0]:.1f}", flush=True)
    print("# workloads: " + "; ".join(
        f"{w.name} ({len(w.requests)} requests, /v1/{'chat/' * (w.endpoint == 'chat')}completions)"
        for w in workloads), flush=True)
    if dropped := dropped_line():
        print(dropped, flush=True)
    if vllm is None and not skip_vllm:
        print(f"# vLLM skipped: no virtualenv with vllm found; {SETUP_HINT}", flush=True)
    elif vllm is not None:
        print(f"# vLLM: --dtype {args.vllm_dtype}, {describe_setup(vllm, args.vllm_setup)}",
              flush=True)
    systems = make_systems(args, vllm)
    results: list[Measurement] = []
    with tempfile.TemporaryDirectory(prefix="kvfleet-speculation-") as tmp:
        log_dir = Path(args.log_dir or tmp)
        log_dir.mkdir(parents=True, exist_ok=True)
        for round_index in range(args.rounds):
            print(f"# round {round_index + 1} of {args.rounds}; load average "
                  f"{os.getloadavg()[0]:.1f}", flush=True)
            for system in systems:
                results += run_system(system, round_index, args, workloads, vllm, log_dir)
    print_throughput(results, systems, args.rounds)
    verdicts = print_identity(results, systems)
    print_targets(results, systems, verdicts)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps([asdict(m) for m in results], indent=1))
    return report_failures(results)


def report_failures(results: list[Measurement]) -> int:
    """1, after a line per run with failed requests, when any request failed."""
    failed = [m for m in results if m.num_ok < m.num_requests]
    for m in failed:
        print(f"FAILED: {m.system}, round {m.round + 1}, {m.key.label()}: "
              f"{m.num_requests - m.num_ok} of {m.num_requests} requests failed "
              f"({m.first_error})", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
