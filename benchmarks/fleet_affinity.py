"""Prefix-affinity routing (issue #34) against shared routing, one worker and SGLang's router.

One multi-tenant, multi-turn chat trace, the same client, against 1 worker, N workers with
`--routing shared`, N workers with `--routing affinity`, and SGLang's router (`sglang-router`,
policy `cache_aware`) in front of N independent one-worker kvfleet servers; and N workers with
affinity but without prefixes fetched from peers (`affinity-nofetch`: `--no-kv-peer-fetch`,
issue 52's case (b): the prompt tokens the fleet computes against one worker's, the ideal).

    .venv/bin/python -m benchmarks.fleet_affinity                   # all four, N = 3
    .venv/bin/python -m benchmarks.fleet_affinity --skew            # tenant 0: 80% of requests
    .venv/bin/python -m benchmarks.fleet_affinity --configs affinity --kill-worker-at 20
    .venv/bin/python -m benchmarks.fleet_affinity --configs shared,sglang --tenants 2 --turns 2

The trace (benchmarks/affinity_trace.py, from `--seed`): 24 conversations of 4 tenants with
~600-token system prompts, 5 turns each resending the whole history, greedy, `--max-tokens` per
answer, streamed from /v1/chat/completions (`--conversations 8` is the issue's first
observation). Each configuration starts its own servers (`kvfleet up`, an embedded Redis each)
and stops them afterwards. SGLang's router comes from its own virtualenv
(benchmarks/sglang_router_env.sh; skipped with a message without it). On one host the N workers
share its cores (cores / N torch threads each, as `kvfleet up` gives them): N workers against 1
measures the routing, not N machines' capacity.

Per configuration: the fleet-wide share of prompt tokens served from the prefix cache (the
responses' usage.prompt_tokens_details.cached_tokens; all turns, and turns 2.. whose history a
worker may hold), TTFT p50/p90, output tokens/s and requests/s (trace start to last answer), and
requests per worker (the worker each request's hash in the fleet's Redis names: the one that
finished it). Then the ratios of the issue's targets. `--kill-worker-at S` SIGKILLs the busiest
worker of the affinity fleet S seconds into its run; lost requests (any not answered in full)
must be 0.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from benchmarks.affinity_servers import (SGLANG_ROUTER_HINT, KvfleetServer, SglangRouter,
                                         sglang_router_python, sglang_router_version)
from benchmarks.affinity_trace import Conversation, TraceShape, generate_trace, history
from benchmarks.peer_env import dropped_line
from kvfleet.bench.client import BenchTarget, RequestRecord, stream_request
from kvfleet.bench.stats import Distribution, distribution
from kvfleet.bench.trace import TraceRequest
from kvfleet.shared.models import DEFAULT_MODEL

CONFIGS = ("single", "shared", "affinity", "affinity-nofetch", "sglang")


@dataclass
class Turn:
    """One request of the trace: turn `turn` (1-based) of a conversation."""
    conversation: int
    tenant: int
    turn: int
    record: RequestRecord
    worker: str | None = None  # filled in after the run, from the fleet's Redis


# ---- the client ------------------------------------------------------------------------------

@dataclass(frozen=True)
class ChatTarget(BenchTarget):
    max_tokens: int = 32  # per answer


async def chat(client: httpx.AsyncClient, target: ChatTarget, conversation: Conversation,
               run_start: float, turns: list[Turn]) -> int:
    """Every turn of one conversation, each sent `think_s` after the previous answer, with the
    answers the server gave in its history; stops at a failed turn. Returns the turns not sent."""
    await asyncio.sleep(max(0.0, run_start + conversation.start_s - time.perf_counter()))
    answers: list[str] = []
    for number, question in enumerate(conversation.questions):
        if number:
            await asyncio.sleep(conversation.think_s[number - 1])
        request = TraceRequest(time.perf_counter() - run_start, question, target.max_tokens,
                               messages=history(conversation, answers))
        record = RequestRecord(len(turns), request.arrival_s, request.max_tokens)
        turns.append(Turn(conversation.index, conversation.tenant, number + 1, record))
        await stream_request(client, target, request, record, run_start)
        if not record.ok:
            return len(conversation.questions) - number - 1
        answers.append(record.text)
    return 0


async def run_trace(url: str, target: ChatTarget, trace: list[Conversation],
                    during: Callable[[float], Awaitable[None]] | None = None
                    ) -> tuple[list[Turn], int, float]:
    """Every conversation at once from its start time; `during(run_start)` runs beside them.
    Returns the turns sent, the turns never sent (after a failed one), and the duration."""
    turns: list[Turn] = []
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=len(trace) + 4)
    timeout = httpx.Timeout(target.timeout_s, connect=30.0)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=timeout) as client:
        run_start = time.perf_counter()
        side = asyncio.create_task(during(run_start)) if during else None
        unsent = await asyncio.gather(*(chat(client, target, c, run_start, turns) for c in trace))
        if side is not None:
            await side
    finished = [t.record.finished_at_s for t in turns if t.record.finished_at_s is not None]
    return turns, sum(unsent), max(finished, default=0.0)


# ---- the summary -----------------------------------------------------------------------------

@dataclass(frozen=True)
class ConfigSummary:
    config: str  # a name of CONFIGS
    name: str  # as printed
    num_workers: int
    num_sent: int
    num_ok: int
    num_unsent: int  # turns not sent because an earlier turn of their conversation failed
    prompt_tokens: int  # of the answered requests
    cached_tokens: int  # of those, served from a prefix cache (usage.cached_tokens)
    cached_share: float | None  # cached / prompt tokens, every turn
    cached_share_later: float | None  # turns 2..
    ttft_s: Distribution
    output_tokens: int
    duration_s: float
    output_tokens_per_s: float
    requests_per_s: float
    loads: dict[str, int]  # answered requests per worker, every worker of the fleet listed
    num_unattributed: int  # answered requests whose worker was not found
    load_skew: float | None  # max / mean of loads
    events: list[str] = field(default_factory=list)  # e.g. the kill
    # requests the workers admitted by the stream they took them from (own / shared / other),
    # from their /metrics; {} where they do not count it (the sglang peer: not read)
    taken: dict[str, int] = field(default_factory=dict)
    # admitted requests whose prompt opening another worker held, by outcome (fetched, joined,
    # slower, failed, late, incompatible), from the workers' /metrics; {} where none or not read
    fetches: dict[str, int] = field(default_factory=dict)
    # answered requests' text by "conversation-turn": configurations of one run are compared
    # (the history a turn resends holds the earlier answers, so one difference spreads)
    answers: dict[str, str] = field(default_factory=dict)
    # prompt tokens computed (not cached) by turn number, answered requests: where a fleet's
    # excess over one worker is (first turns: tenants' prompts; later: conversations' history)
    computed_by_turn: dict[int, int] = field(default_factory=dict)
    # every sent turn (in the JSON output only): which worker answered, when it was sent, what it
    # found cached: where an excess over one worker comes from, request by request
    turns: list[dict] = field(default_factory=list)

    @property
    def computed_tokens(self) -> int:
        """Prompt tokens the fleet computed (not served from a prefix cache)."""
        return self.prompt_tokens - self.cached_tokens

    @property
    def num_lost(self) -> int:
        """Requests of the trace not answered in full: failed ones and those never sent."""
        return self.num_sent - self.num_ok + self.num_unsent


def computed_by_turn(turns: list[Turn]) -> dict[int, int]:
    """Prompt tokens computed (prompt less cached) per turn number, over the answered turns."""
    computed: dict[int, int] = {}
    for t in turns:
        if t.record.ok:
            spent = (t.record.prompt_tokens or 0) - (t.record.cached_tokens or 0)
            computed[t.turn] = computed.get(t.turn, 0) + spent
    return dict(sorted(computed.items()))


def cached_share(turns: list[Turn], min_turn: int = 1) -> float | None:
    """Prompt tokens served from the prefix cache / prompt tokens, over the answered requests of
    turn `min_turn` on; None without any prompt token reported."""
    answered = [t.record for t in turns if t.record.ok and t.turn >= min_turn]
    prompt = sum(r.prompt_tokens or 0 for r in answered)
    return sum(r.cached_tokens or 0 for r in answered) / prompt if prompt else None


def worker_loads(turns: list[Turn], worker_ids: list[str]) -> tuple[dict[str, int], int]:
    """Answered requests per worker (each of `worker_ids` listed, idle ones at 0, plus any other
    worker named), and how many answered requests name no worker."""
    loads = dict.fromkeys(worker_ids, 0)
    unattributed = 0
    for t in turns:
        if not t.record.ok:
            continue
        if t.worker is None:
            unattributed += 1
        else:
            loads[t.worker] = loads.get(t.worker, 0) + 1
    return loads, unattributed


def load_skew(loads: dict[str, int]) -> float | None:
    """The busiest worker's requests / the mean over the workers (1.0: perfectly even)."""
    total = sum(loads.values())
    return max(loads.values()) / (total / len(loads)) if total else None


def summarise(config: str, name: str, turns: list[Turn], num_unsent: int, duration_s: float,
              worker_ids: list[str], events: list[str] | None = None,
              taken: dict[str, int] | None = None,
              fetches: dict[str, int] | None = None) -> ConfigSummary:
    answered = [t.record for t in turns if t.record.ok]
    output_tokens = sum(r.output_tokens or 0 for r in answered)
    seconds = max(duration_s, 1e-9)
    loads, unattributed = worker_loads(turns, worker_ids)
    return ConfigSummary(
        config=config, name=name, num_workers=len(worker_ids), num_sent=len(turns),
        num_ok=len(answered), num_unsent=num_unsent,
        prompt_tokens=sum(r.prompt_tokens or 0 for r in answered),
        cached_tokens=sum(r.cached_tokens or 0 for r in answered),
        cached_share=cached_share(turns), cached_share_later=cached_share(turns, min_turn=2),
        ttft_s=distribution([r.ttft_s for r in answered if r.ttft_s is not None]),
        output_tokens=output_tokens, duration_s=duration_s,
        output_tokens_per_s=output_tokens / seconds, requests_per_s=len(answered) / seconds,
        loads=loads, num_unattributed=unattributed, load_skew=load_skew(loads),
        events=list(events or []), taken=dict(taken or {}), fetches=dict(fetches or {}),
        answers={f"{t.conversation}-{t.turn}": t.record.text for t in turns if t.record.ok},
        computed_by_turn=computed_by_turn(turns), turns=[turn_row(t) for t in turns])


def turn_row(t: Turn) -> dict:
    """One sent turn as the JSON output lists it."""
    r = t.record
    return {"conversation": t.conversation, "tenant": t.tenant, "turn": t.turn,
            "worker": t.worker, "response_id": r.response_id, "ok": r.ok,
            "sent_at_s": r.sent_at_s, "ttft_s": r.ttft_s,
            "prompt_tokens": r.prompt_tokens, "cached_tokens": r.cached_tokens}


def answers_differing(summary: ConfigSummary, reference: ConfigSummary) -> tuple[int, int]:
    """(answers of `summary` that differ from `reference`'s, answers both have)."""
    both = summary.answers.keys() & reference.answers.keys()
    return sum(summary.answers[k] != reference.answers[k] for k in both), len(both)


@dataclass(frozen=True)
class Ratio:
    label: str
    value: float | None  # None when a side is missing (configuration not run, no data)
    target: str  # e.g. ">= 0.95"; "" when the issue sets none

    @property
    def verdict(self) -> str:
        if self.value is None or not self.target:
            return ""
        op, bound = self.target.split()
        holds = self.value >= float(bound) if op == ">=" else self.value <= float(bound)
        return "met" if holds else "NOT met"


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def ratios(by_config: dict[str, ConfigSummary]) -> list[Ratio]:
    """The issue's targets, from whichever configurations ran."""
    def get(config: str, read: Callable[[ConfigSummary], float | None]) -> float | None:
        return read(by_config[config]) if config in by_config else None

    def share(s): return s.cached_share
    def later(s): return s.cached_share_later
    def p90(s): return s.ttft_s.p90
    def tps(s): return s.output_tokens_per_s
    def computed(s): return s.computed_tokens
    return [
        # issue 52 (b): with prefixes fetched from peers, the fleet computes each distinct
        # prefix about once, as one worker whose cache holds the whole trace does
        Ratio("prompt tokens computed, affinity / 1 worker (the ideal)",
              _ratio(get("affinity", computed), get("single", computed)), "<= 1.05"),
        Ratio("cached share, affinity / 1 worker (all turns; issue 52)",
              _ratio(get("affinity", share), get("single", share)), ">= 0.99"),
        Ratio("prompt tokens computed, affinity without / with peer fetch",
              _ratio(get("affinity-nofetch", computed), get("affinity", computed)), ""),
        Ratio("prompt tokens computed, affinity without peer fetch / 1 worker",
              _ratio(get("affinity-nofetch", computed), get("single", computed)), ""),
        Ratio("cached share, affinity / 1 worker (all turns)",
              _ratio(get("affinity", share), get("single", share)), ">= 0.95"),
        Ratio("cached share, affinity / 1 worker (turns 2..)",
              _ratio(get("affinity", later), get("single", later)), ">= 0.95"),
        Ratio("TTFT p90, shared / affinity", _ratio(get("shared", p90), get("affinity", p90)),
              ">= 3"),
        Ratio("output tok/s, affinity / shared", _ratio(get("affinity", tps), get("shared", tps)),
              ">= 1.2"),
        Ratio("requests per worker, max / mean, affinity (target with --skew)",
              get("affinity", lambda s: s.load_skew), "<= 1.5"),
        Ratio("cached share (turns 2..), affinity / sglang-router",
              _ratio(get("affinity", later), get("sglang", later)), ""),
        Ratio("TTFT p90, sglang-router / affinity",
              _ratio(get("sglang", p90), get("affinity", p90)), ""),
        Ratio("requests per worker, max / mean, sglang-router",
              get("sglang", lambda s: s.load_skew), ""),
    ]


def _num(value: float | None, digits: int = 2, scale: float = 1.0) -> str:
    return "-" if value is None or math.isnan(value) else f"{value * scale:.{digits}f}"


def print_report(summaries: list[ConfigSummary]) -> None:
    print("\n| configuration | answered / sent | lost | prompt tokens | computed | "
          "cached share, all | turns 2.. | TTFT p50 (s) | TTFT p90 (s) | output tok/s | "
          "requests/s | requests per worker | max / mean |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|")
    for s in summaries:
        loads = " / ".join(str(n) for n in s.loads.values())
        if s.num_unattributed:
            loads += f" (+{s.num_unattributed} unknown)"
        print(f"| {s.name} | {s.num_ok} / {s.num_sent} | {s.num_lost} | {s.prompt_tokens} | "
              f"{s.computed_tokens} | {_num(s.cached_share, 1, 100)}% | "
              f"{_num(s.cached_share_later, 1, 100)}% | "
              f"{_num(s.ttft_s.p50)} | {_num(s.ttft_s.p90)} | {_num(s.output_tokens_per_s, 1)} | "
              f"{_num(s.requests_per_s)} | {loads} | {_num(s.load_skew)} |")
    for s in summaries:
        for event in s.events:
            print(f"# {s.name}: {event}")
        if s is not summaries[0]:
            differ, both = answers_differing(s, summaries[0])
            print(f"# {s.name}: {differ} of {both} answers differ from {summaries[0].name}'s")
        if s.taken:
            print(f"# {s.name}: requests taken from (worker metrics): "
                  + ", ".join(f"{source} {count}" for source, count in sorted(s.taken.items())))
        if s.computed_by_turn:
            print(f"# {s.name}: prompt tokens computed by turn: "
                  + ", ".join(f"{turn}: {n}" for turn, n in s.computed_by_turn.items()))
        if s.fetches:
            print(f"# {s.name}: prompt openings a peer held (worker metrics): "
                  + ", ".join(f"{outcome} {n}" for outcome, n in sorted(s.fetches.items())))
    print("\n| ratio | value | target (issue 34; 52 where it says) | |")
    print("|---|---:|---|---|")
    for r in ratios({s.config: s for s in summaries}):
        print(f"| {r.label} | {_num(r.value)} | {r.target or '-'} | {r.verdict} |")


# ---- the configurations ----------------------------------------------------------------------

def config_label(config: str, workers: int) -> str:
    return {"single": "1 worker", "shared": f"shared x{workers}",
            "affinity": f"affinity x{workers}",
            "affinity-nofetch": f"affinity x{workers}, no peer fetch",
            "sglang": f"sglang-router cache_aware x{workers}"}[config]


def run_kvfleet(config: str, args, trace: list[Conversation], log_dir: Path) -> ConfigSummary:
    """One `kvfleet up` fleet: 1 worker (routing affinity, the default), or N shared/affinity."""
    workers = 1 if config == "single" else args.workers
    routing = "shared" if config == "shared" else "affinity"
    label = config_label(config, workers)
    extra = ("--no-kv-peer-fetch",) if config == "affinity-nofetch" else ()
    server = KvfleetServer(workers, routing, args.dtype, log_dir / f"{config}.log",
                           extra_args=extra)
    events: list[str] = []
    try:
        server.wait_ready(DEFAULT_MODEL, args.startup_timeout_s)
        worker_ids = server.worker_ids()
        print(f"  {label}: ready {time.perf_counter() - server.started:.0f} s after start",
              flush=True)
        kill = args.kill_worker_at if config == "affinity" else None
        during = killer(server, kill, events) if kill is not None else None
        turns, unsent, duration_s = asyncio.run(run_trace(server.url, target(args), trace, during))
        attribute(turns, [server])
        taken, fetches = server.requests_taken(), server.peer_fetches()
    finally:
        server.stop()
    return summarise(config, label, turns, unsent, duration_s, worker_ids, events, taken,
                     fetches)


def killer(server: KvfleetServer, at_s: float,
           events: list[str]) -> Callable[[float], Awaitable[None]]:
    """What runs beside the trace: SIGKILL the fleet's busiest worker `at_s` into the run."""
    async def kill(run_start: float) -> None:
        await asyncio.sleep(max(0.0, run_start + at_s - time.perf_counter()))
        killed = await asyncio.to_thread(server.kill_busiest_worker)
        events.append(f"SIGKILLed {killed} at {time.perf_counter() - run_start:.1f} s")
    return kill


def run_sglang(args, trace: list[Conversation], log_dir: Path, python: Path) -> ConfigSummary:
    """SGLang's router, `--policy cache_aware`, before N one-worker kvfleet servers; each worker
    gets the torch threads a worker of `kvfleet up --workers N` gets (cores / N), so that the N
    servers do not oversubscribe the cores."""
    label = config_label("sglang", args.workers)
    threads = max(1, (os.cpu_count() or 1) // args.workers)
    servers = [KvfleetServer(1, "affinity", args.dtype, log_dir / f"sglang-server-{i}.log",
                             num_threads=threads) for i in range(args.workers)]
    router = None
    try:
        for server in servers:
            server.wait_ready(DEFAULT_MODEL, args.startup_timeout_s)
        worker_ids = [w for server in servers for w in server.worker_ids()]
        router = SglangRouter(python, [s.url for s in servers], "cache_aware",
                              log_dir / "sglang-router.log")
        router.wait_ready(DEFAULT_MODEL, args.startup_timeout_s)
        print(f"  {label}: ready", flush=True)
        turns, unsent, duration_s = asyncio.run(run_trace(router.url, target(args), trace))
        attribute(turns, servers)
    finally:
        if router is not None:
            router.stop()
        for server in servers:
            server.stop()
    return summarise("sglang", label, turns, unsent, duration_s, worker_ids)


def attribute(turns: list[Turn], servers: list[KvfleetServer]) -> None:
    """Name each answered turn's worker, from whichever server's Redis holds its request."""
    ids = [t.record.response_id for t in turns if t.record.response_id]
    owners: dict[str, str] = {}
    for server in servers:
        owners.update(server.owners(ids))
    for t in turns:
        t.worker = owners.get(t.record.response_id) if t.record.response_id else None


def target(args) -> ChatTarget:
    return ChatTarget(model=DEFAULT_MODEL, endpoint="chat", timeout_s=args.request_timeout_s,
                      temperature=0.0, max_tokens=args.max_tokens)


# ---- the command -----------------------------------------------------------------------------

def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--configs", default=",".join(CONFIGS),
                   help=f"comma-separated, run in the order given, of: {','.join(CONFIGS)}")
    p.add_argument("--workers", type=int, default=3, help="N of the multi-worker configurations")
    p.add_argument("--conversations", type=int, default=TraceShape.conversations,
                   help="concurrent chats, spread over the tenants")
    p.add_argument("--tenants", type=int, default=TraceShape.tenants)
    p.add_argument("--turns", type=int, default=TraceShape.turns)
    p.add_argument("--system-words", type=int, default=TraceShape.system_words,
                   help="corpus words in each tenant's system prompt (~1.2 tokens a word)")
    p.add_argument("--max-tokens", type=int, default=32, help="per answer")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skew", type=float, nargs="?", const=0.8, default=None,
                   help="tenant 0's share of the conversations (default 0.8 when given)")
    p.add_argument("--kill-worker-at", type=float, default=None, metavar="S",
                   help="SIGKILL the busiest worker of the affinity fleet S seconds into its run")
    p.add_argument("--dtype", default="auto", help="passed to `kvfleet up`")
    p.add_argument("--sglang-router-venv", default=None)
    p.add_argument("--startup-timeout-s", type=float, default=600)
    p.add_argument("--request-timeout-s", type=float, default=600)
    p.add_argument("--log-dir", default=None,
                   help="keep the servers' logs here (default: a temporary directory, removed)")
    p.add_argument("--json-out", default=None,
                   help="write every configuration (each turn: worker, response id, tokens) "
                        "and the ratios as JSON")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    configs = [c for c in args.configs.split(",") if c]
    if unknown := set(configs) - set(CONFIGS):
        raise SystemExit(f"--configs: unknown {sorted(unknown)}; choose from {CONFIGS}")
    shape = TraceShape(conversations=args.conversations, tenants=args.tenants, turns=args.turns,
                       system_words=args.system_words, skew=args.skew)
    trace = generate_trace(shape, seed=args.seed)
    heavy = sum(c.tenant == 0 for c in trace) / len(trace)
    print(f"# {len(trace)} conversations x {args.turns} turns, {args.tenants} tenants (tenant 0: "
          f"{heavy:.0%} of requests), seed {args.seed}, max_tokens {args.max_tokens}, greedy; "
          f"N = {args.workers}, --dtype {args.dtype}", flush=True)
    if dropped := dropped_line():
        print(dropped, flush=True)
    python = sglang_router_python(args.sglang_router_venv) if "sglang" in configs else None
    if "sglang" in configs:
        if python is None:
            print(f"# sglang-router skipped: no virtualenv with it found; {SGLANG_ROUTER_HINT}")
            configs.remove("sglang")
        else:
            print(f"# sglang-router {sglang_router_version(python)} ({python})", flush=True)
    summaries = []
    with tempfile.TemporaryDirectory(prefix="kvfleet-affinity-") as tmp:
        log_dir = Path(args.log_dir or tmp)
        log_dir.mkdir(parents=True, exist_ok=True)
        for config in configs:
            print(f"# {config_label(config, args.workers)}", flush=True)
            summary = (run_sglang(args, trace, log_dir, python) if config == "sglang"
                       else run_kvfleet(config, args, trace, log_dir))
            print(f"  {summary.num_ok} / {summary.num_sent} answered in "
                  f"{summary.duration_s:.1f} s", flush=True)
            summaries.append(summary)
    print_report(summaries)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(
            {"args": vars(args), "configurations": [asdict(s) for s in summaries],
             "ratios": [asdict(r) for r in ratios({s.config: s for s in summaries})]},
            indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
