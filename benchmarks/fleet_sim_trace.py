"""The pure parts of benchmarks/fleet_sim.py: the trace at the shape of llm-d's precise-prefix
benchmark, the time-scale arithmetic, the lag verdict, one run's numbers and the table.

**The trace.** `tenants` tenants, each with a shared prefix of `prefix_tokens` token ids (its
system prompt) and `users` users; a request belongs to a (tenant, user) drawn uniformly and is
the tenant's prefix followed by a query of `query_tokens` ids. With `queries="per-request"`
every request's query is new (only the prefix can be cached); with `queries="per-user"` each
user sends the same query every time (as llm-d's inference-perf `shared_prefix` data does: its
750 prompts repeat, so a whole prompt can be cached). Arrivals are Poisson at `rate` requests/s
(exponential gaps) over `duration_s`, all in modelled seconds. Ids are drawn from
[FIRST_ID, LAST_ID): ordinary tokens of the fleet's tokenizer (SmolLM2's; none of its special
tokens), so the gateway's `usage.prompt_tokens` is the exact prompt length. The same seed gives
the same trace, and the prefixes depend on the seed only (not the rate): every rate and every
routing of a run meet the same tenants.

**The time scale.** A simulated worker plays every modelled duration `k` times longer
(`--sim-time-scale k`) so that the host keeps up; the client sends each request at k x its
modelled arrival. Latencies measured on the client are divided by k, rates and throughputs
multiplied by k, back to the modelled accelerators' time.

**The lag verdict.** A simulated worker counts the steps that ended later than modelled
(`sim_lagged_steps` beside `sim_steps` in its heartbeat); a run whose lagged steps exceed 5% of
its steps (summed over the workers, over the run) measured the host, not the model: INVALID.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

from kvfleet.bench.client import RequestRecord
from kvfleet.bench.stats import distribution
from kvfleet.bench.trace import TraceRequest
from kvfleet.worker.sim.clock import INVALID_LAG_SHARE

FIRST_ID = 1_000  # SmolLM2's special and byte tokens are below
LAST_ID = 49_000  # its vocabulary has 49,152
MAX_LAG_SHARE = INVALID_LAG_SHARE  # issue 51: over 5% of steps late makes a run invalid
QUERY_MODES = ("per-request", "per-user")


@dataclass(frozen=True)
class TraceShape:
    """llm-d's precise-prefix benchmark (inference-perf `shared_prefix`): 150 groups of 5
    prompts, 6,000-token system prompts, 1,200-token questions, 1,000 output tokens."""

    tenants: int = 150
    users: int = 5  # per tenant
    prefix_tokens: int = 6_000
    query_tokens: int = 1_200
    output_tokens: int = 1_000  # every answer, exactly (ignore_eos)
    queries: str = "per-request"  # a key of QUERY_MODES

    @property
    def prompt_tokens(self) -> int:
        return self.prefix_tokens + self.query_tokens


@dataclass(frozen=True)
class SimRequest:
    index: int
    arrival_s: float  # modelled seconds from the run's start
    tenant: int
    user: int
    prompt_token_ids: tuple[int, ...]


def _ids(rng: random.Random, count: int) -> list[int]:
    return [rng.randrange(FIRST_ID, LAST_ID) for _ in range(count)]


def prefixes(shape: TraceShape, seed: int) -> list[tuple[int, ...]]:
    """Each tenant's shared prefix (from the seed only)."""
    rng = random.Random(f"prefixes-{seed}")
    return [tuple(_ids(rng, shape.prefix_tokens)) for _ in range(shape.tenants)]


def poisson_arrivals(rate: float, duration_s: float, rng: random.Random) -> list[float]:
    """Arrival times of a Poisson process of `rate` per second in [0, duration_s)."""
    if rate <= 0 or duration_s <= 0:
        raise ValueError("rate and duration must be positive")
    times, now = [], rng.expovariate(rate)
    while now < duration_s:
        times.append(now)
        now += rng.expovariate(rate)
    return times


def generate(shape: TraceShape, rate: float, duration_s: float, seed: int = 0,
             tenant_prefixes: list[tuple[int, ...]] | None = None) -> list[SimRequest]:
    """The requests of one rate's run, in arrival order (the same for every routing)."""
    if shape.queries not in QUERY_MODES:
        raise ValueError(f"queries must be one of {QUERY_MODES}, got {shape.queries!r}")
    if min(shape.tenants, shape.users, shape.prefix_tokens, shape.query_tokens) < 1:
        raise ValueError("tenants, users, prefix_tokens and query_tokens must be at least 1")
    tenant_prefixes = tenant_prefixes or prefixes(shape, seed)
    rng = random.Random(f"run-{seed}-{rate}-{duration_s}")
    queries_rng = random.Random(f"queries-{seed}-{rate}-{duration_s}")  # new at each rate
    user_queries: dict[tuple[int, int], tuple[int, ...]] = {}
    requests = []
    for index, arrival_s in enumerate(poisson_arrivals(rate, duration_s, rng)):
        tenant, user = rng.randrange(shape.tenants), rng.randrange(shape.users)
        if shape.queries == "per-user":
            query = user_queries.get((tenant, user))
            if query is None:  # drawn in first-use order from a seed of its own: stable
                query = user_queries[(tenant, user)] = tuple(_ids(
                    random.Random(f"user-{seed}-{tenant}-{user}"), shape.query_tokens))
        else:
            query = tuple(_ids(queries_rng, shape.query_tokens))
        requests.append(SimRequest(index, arrival_s, tenant, user,
                                   tenant_prefixes[tenant] + query))
    return requests


def warmup_requests(shape: TraceShape, rate: float, seed: int = 0,
                    tenant_prefixes: list[tuple[int, ...]] | None = None) -> list[SimRequest]:
    """One request per tenant, in a seeded order, `rate` per second (evenly spaced): its prefix
    and a query of its own (llm-d's warm-up stage seats every group's prompts before the
    ladder)."""
    tenant_prefixes = tenant_prefixes or prefixes(shape, seed)
    rng = random.Random(f"warmup-{seed}")
    order = list(range(shape.tenants))
    rng.shuffle(order)
    return [SimRequest(i, i / rate, tenant, 0,
                       tenant_prefixes[tenant] + tuple(_ids(rng, shape.query_tokens)))
            for i, tenant in enumerate(order)]


def trace_requests(requests: list[SimRequest], shape: TraceShape) -> list[TraceRequest]:
    """The client's requests: token ids to /v1/completions, `output_tokens` with ignore_eos."""
    return [TraceRequest(r.arrival_s, f"tenant {r.tenant} user {r.user}", shape.output_tokens,
                         ignore_eos=True, prompt_token_ids=r.prompt_token_ids)
            for r in requests]


@dataclass(frozen=True)
class TimeScale:
    """Modelled time x k = wall time on this host."""

    k: float = 1.0

    def __post_init__(self):
        if not self.k > 0:
            raise ValueError(f"the time scale must be positive, got {self.k}")

    @property
    def replay_rate(self) -> float:
        """kvfleet.bench.loadgen's LoadSpec.rate (a trace speed-up): 1/k stretches by k."""
        return 1.0 / self.k

    def modelled_s(self, wall_s: float | None) -> float | None:
        return None if wall_s is None else wall_s / self.k

    def modelled_rate(self, per_wall_s: float) -> float:
        return per_wall_s * self.k


@dataclass(frozen=True)
class BeatCounters:
    """One worker's cumulative heartbeat counters at one moment."""

    steps: int = 0
    lagged: int = 0
    hit_tokens: int = 0
    queried_tokens: int = 0
    generated_tokens: int = 0

    def minus(self, before: BeatCounters) -> BeatCounters:
        return BeatCounters(self.steps - before.steps, self.lagged - before.lagged,
                            self.hit_tokens - before.hit_tokens,
                            self.queried_tokens - before.queried_tokens,
                            self.generated_tokens - before.generated_tokens)


def deltas(before: dict[str, BeatCounters],
           after: dict[str, BeatCounters]) -> dict[str, BeatCounters]:
    """Each worker's counters over a run (a worker first seen after the start counts from 0)."""
    return {w: beat.minus(before.get(w, BeatCounters())) for w, beat in after.items()}


def lag_share(by_worker: dict[str, BeatCounters]) -> float | None:
    steps = sum(b.steps for b in by_worker.values())
    return sum(b.lagged for b in by_worker.values()) / steps if steps else None


def lag_verdict(share: float | None) -> str:
    """"ok", or "INVALID" when more than 5% of the steps were late (or none were played)."""
    return "ok" if share is not None and share <= MAX_LAG_SHARE else "INVALID"


@dataclass
class RunRow:
    """One routing at one rate, in modelled time."""

    routing: str
    rate: float
    sent: int
    ok: int
    output_tokens_per_s: float
    ttft_p50_s: float | None
    ttft_p90_s: float | None
    itl_p99_s: float | None
    cached_share: float | None  # prefix hits / prompt tokens looked up, by the workers
    requests_per_worker: tuple[int, int] | None  # min, max (None: not read)
    prompt_tokens_per_worker: tuple[int, int] | None  # min, max (looked up in the prefix cache)
    lag_share: float | None
    verdict: str
    wrong_prompt_lengths: int = 0  # ok requests whose usage.prompt_tokens was not the trace's
    errors: dict[str, int] = field(default_factory=dict)


def summarise(routing: str, rate: float, records: list[RequestRecord], scale: TimeScale,
              beats: dict[str, BeatCounters] | None, requests_by_worker: dict[str, int],
              num_workers: int, prompt_tokens: int) -> RunRow:
    """A run's row: client-side latencies and throughput scaled back by k; cached share, load
    and lag from the workers' heartbeat deltas. A worker that served nothing counts as 0.
    `beats` None (a peer without kvfleet's heartbeats): the cached share from the answers'
    usage.prompt_tokens_details.cached_tokens where any is reported, no load, no lag verdict
    ("unchecked")."""
    if beats is None:
        return _peer_row(routing, rate, records, scale, prompt_tokens)
    ok = [r for r in records if r.ok]
    first = min((r.sent_at_s for r in records if r.sent_at_s is not None), default=0.0)
    last = max((r.finished_at_s for r in ok if r.finished_at_s is not None), default=first)
    wall_s = max(last - first, 1e-9)
    ttft = distribution([r.ttft_s for r in ok if r.ttft_s is not None])
    itl = distribution([gap for r in ok for gap in r.itl_s])
    hits = sum(b.hit_tokens for b in beats.values())
    queried = sum(b.queried_tokens for b in beats.values())
    share = lag_share(beats)
    loads = list(requests_by_worker.values()) + [0] * (num_workers - len(requests_by_worker))
    tokens = [b.queried_tokens for b in beats.values()] + [0] * (num_workers - len(beats))
    errors: dict[str, int] = {}
    for r in records:
        if r.error is not None:
            errors[r.error] = errors.get(r.error, 0) + 1
    return RunRow(
        routing=routing, rate=rate, sent=len(records), ok=len(ok),
        output_tokens_per_s=scale.modelled_rate(sum(r.output_tokens or 0 for r in ok) / wall_s),
        ttft_p50_s=scale.modelled_s(ttft.p50), ttft_p90_s=scale.modelled_s(ttft.p90),
        itl_p99_s=scale.modelled_s(itl.p99),
        cached_share=hits / queried if queried else None,
        requests_per_worker=(min(loads, default=0), max(loads, default=0)),
        prompt_tokens_per_worker=(min(tokens, default=0), max(tokens, default=0)),
        lag_share=share, verdict=lag_verdict(share),
        wrong_prompt_lengths=sum(r.prompt_tokens != prompt_tokens for r in ok),
        errors=dict(sorted(errors.items(), key=lambda e: -e[1])[:3]))


def _peer_row(routing: str, rate: float, records: list[RequestRecord], scale: TimeScale,
              prompt_tokens: int) -> RunRow:
    row = summarise(routing, rate, records, scale, {}, {}, 0, prompt_tokens)
    ok = [r for r in records if r.ok]
    cached = sum(r.cached_tokens or 0 for r in ok)
    prompts = sum(r.prompt_tokens or 0 for r in ok)
    row.cached_share = cached / prompts if cached and prompts else None
    row.requests_per_worker = row.prompt_tokens_per_worker = None
    row.lag_share, row.verdict = None, "unchecked"
    return row


@dataclass(frozen=True)
class PublishedRow:
    scheduler: str  # llm-d's name
    ours: str  # the kvfleet routing it corresponds to
    output_tokens_per_s: float
    ttft_p90_s: float


# llm-d's published report for its precise-prefix-cache-aware guide (inference-perf, Qwen3-32B,
# 8 vLLM pods of 2 H100s each, block size 64): THEIR numbers, measured on real GPUs. The summary
# row is over their whole ladder of rates (3 to 60 requests/s after a 15 requests/s warm-up);
# the second is their 60 requests/s stage alone.
LLMD_SUMMARY = (PublishedRow("precise-scheduling", "affinity", 8730.0, 0.542),
                PublishedRow("estimated-scheduling", "(approximate)", 6944.4, 31.083),
                PublishedRow("random-scheduling", "random", 4428.7, 92.551),
                PublishedRow("load-scheduling", "(load only)", 4266.4, 94.865))
LLMD_AT_60 = (PublishedRow("precise-scheduling", "affinity", 10496.9, 0.500),
              PublishedRow("estimated-scheduling", "(approximate)", 7247.9, 50.226),
              PublishedRow("random-scheduling", "random", 4835.2, 105.988),
              PublishedRow("load-scheduling", "(load only)", 4745.1, 110.184))


def _num(value: float | None, fmt: str = "{:.2f}") -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) \
        else fmt.format(value)


def _span(span: tuple[int, int] | None, left: int, right: int) -> str:
    if span is None:
        return f"{'-':>{left}} {'':<{right}}"
    return f"{span[0]:>{left}}-{span[1]:<{right}}"


def table(rows: list[RunRow]) -> list[str]:
    """Our rows (modelled time), one line each."""
    head = (f"{'routing':<13} {'req/s':>6} {'sent':>5} {'ok':>5} {'out tok/s':>10} "
            f"{'TTFT p50':>9} {'TTFT p90':>9} {'ITL p99':>8} {'cached':>7} "
            f"{'req/worker':>11} {'prompt tok/worker':>18} {'lag':>6}  verdict")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r.routing:<13} {r.rate:>6g} {r.sent:>5} {r.ok:>5} "
            f"{_num(r.output_tokens_per_s, '{:.0f}'):>10} {_num(r.ttft_p50_s):>9} "
            f"{_num(r.ttft_p90_s):>9} {_num(r.itl_p99_s, '{:.3f}'):>8} "
            f"{_num(r.cached_share, '{:.1%}'):>7} "
            f"{_span(r.requests_per_worker, 5, 5)} {_span(r.prompt_tokens_per_worker, 8, 9)} "
            f"{_num(r.lag_share, '{:.1%}'):>6}  {r.verdict}")
    return lines


def published_table() -> list[str]:
    lines = ["llm-d's published results (THEIRS, real GPUs: 8 x 2 H100, Qwen3-32B, vLLM):",
             f"  {'scheduler':<22} {'ours':<14} {'summary tok/s':>13} {'TTFT p90':>9}   "
             f"{'at 60/s tok/s':>13} {'TTFT p90':>9}"]
    for whole, at60 in zip(LLMD_SUMMARY, LLMD_AT_60):
        lines.append(f"  {whole.scheduler:<22} {whole.ours:<14} "
                     f"{whole.output_tokens_per_s:>13,.0f} {whole.ttft_p90_s:>8.2f}s   "
                     f"{at60.output_tokens_per_s:>13,.0f} {at60.ttft_p90_s:>8.2f}s")
    return lines


def target_lines(rows: list[RunRow]) -> list[str]:
    """Issue 51's targets at each rate both ran: affinity's TTFT p90 at least 20x lower than
    random's, output tokens/s at least 1.5x random's (meaningful at 60 requests/s); affinity's
    TTFT p90 at least 3x lower than shared routing's (item 7, at 16 or more workers); the same
    ratios of Dynamo's KV router over its random one, where both ran (no target: beside them)."""
    lines = []
    for rate in sorted({r.rate for r in rows}):
        by = {r.routing: r for r in rows if r.rate == rate}
        for cache_aware, blind, targets in (("affinity", "random", (20, 1.5)),
                                            ("affinity", "shared", (3, None)),
                                            ("dynamo-kv", "dynamo-random", (None, None))):
            if cache_aware in by and blind in by:
                lines.append(_target_line(rate, by[cache_aware], by[blind], *targets))
    return lines


def _target_line(rate: float, a: RunRow, b: RunRow, ttft_target: float | None,
                 tps_target: float | None) -> str:
    ttft = b.ttft_p90_s / a.ttft_p90_s if a.ttft_p90_s and b.ttft_p90_s else None
    tps = a.output_tokens_per_s / b.output_tokens_per_s if b.output_tokens_per_s else None
    flag = "  [a run is INVALID]" if "INVALID" in (a.verdict, b.verdict) else ""
    return (f"  {rate:g} req/s: {b.routing}/{a.routing} TTFT p90 {_num(ttft, '{:.1f}x')}"
            f"{f' (target >= {ttft_target:g}x)' if ttft_target else ''}, "
            f"{a.routing}/{b.routing} tok/s {_num(tps, '{:.2f}x')}"
            f"{f' (target >= {tps_target:g}x)' if tps_target else ''}{flag}")
