"""Where one request's time went on the worker that finished it: its timeline, an entry of the
model's timelines stream (`Keys.timelines`), and the summary of many (`kvfleet timelines`,
benchmarks/bench_serve.py).

A timeline's instants are unix times: `created` is the gateway's (when it enqueued the request),
the others the worker's, so the queue phase also holds the two hosts' clock difference (none on
one host; NTP keeps it to milliseconds across hosts). Token instants are when the worker's
tokens were *published* (what a client can see), not when the step computed them. Phases:

    queue    created -> pulled     waiting in a stream until a worker took it
    admit    pulled -> started     the worker's start (fencing, the engine's add)
    prefill  started -> first      the engine's wait, the prompt's chunks and the first token
    ttft     created -> first      the first token, as far as the fleet is concerned
    tpot     first -> last, per token after the first
    gap max  the longest wait between two publications of its tokens (a stall)

A request resumed here from another worker's checkpoint has `resumed` tokens (its prefill phase
then computes its prompt and those again).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from dataclasses import asdict, dataclass, fields
from typing import ClassVar

from kvfleet.shared.wire.records import RawFields, field_value, text


@dataclass(frozen=True)
class RequestTimeline:
    """One request on one worker: the stream entry's fields are its attribute names."""

    KINDS: ClassVar[dict[str, type]] = {}  # filled below: field name -> its type

    req_id: str
    worker: str
    created: float  # unix time the gateway enqueued it (0: unknown)
    pulled: float  # this worker took it from its stream
    started: float  # in the engine
    first: float  # its first token here was published (0: none was)
    last: float  # its last token here was published (0: none was)
    end: float  # its final event was published
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens found in the prefix cache
    output_tokens: int = 0  # published by this worker
    resumed: int = 0  # output tokens it already had when this worker started it
    deliveries: int = 1  # times its stream entry was delivered (a resume counts one more)
    gaps: int = 0  # waits between two publications of its tokens
    gap_sum_ms: float = 0.0
    gap_max_ms: float = 0.0
    finish: str = ""  # its finish reason

    def encode(self) -> dict[str, str]:
        return {name: (f"{value:.6f}" if isinstance(value, float) else str(value))
                for name, value in asdict(self).items()}

    @classmethod
    def decode(cls, raw: RawFields) -> RequestTimeline:
        values = {}
        for name, kind in cls.KINDS.items():
            value = field_value(raw, name)
            if value is not None:
                values[name] = kind(text(value))
        return cls(**values)

    def phases_ms(self) -> dict[str, float]:
        """Its phases in milliseconds (those it has: no first token, no prefill or ttft)."""
        phases = {"admit": (self.started - self.pulled) * 1000}
        if self.created:
            phases["queue"] = (self.pulled - self.created) * 1000
        if self.first:
            phases["prefill"] = (self.first - self.started) * 1000
            if self.created:
                phases["ttft"] = (self.first - self.created) * 1000
        if self.output_tokens > 1 and self.last > self.first:
            phases["tpot"] = (self.last - self.first) * 1000 / (self.output_tokens - 1)
        if self.gaps:
            phases["gap max"] = self.gap_max_ms
        return phases


RequestTimeline.KINDS.update({f.name: {"str": str, "float": float, "int": int}[f.type]
                              for f in fields(RequestTimeline)})

PHASES = ("queue", "admit", "prefill", "ttft", "tpot", "gap max")


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100) by linear interpolation between the closest ranks."""
    ordered = sorted(values)
    if len(ordered) == 1:
        return ordered[0]
    rank = (len(ordered) - 1) * q / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summarize(timelines: Iterable[RequestTimeline]) -> dict:
    """Count, per-phase p50 / p99 / max in ms, and the token and request totals."""
    timelines = list(timelines)
    by_phase: dict[str, list[float]] = {phase: [] for phase in PHASES}
    for timeline in timelines:
        for phase, value in timeline.phases_ms().items():
            by_phase[phase].append(value)
    phases = {phase: {"p50_ms": percentile(values, 50), "p99_ms": percentile(values, 99),
                      "max_ms": max(values), "mean_ms": statistics.fmean(values)}
              for phase, values in by_phase.items() if values}
    return {"count": len(timelines),
            "workers": sorted({t.worker for t in timelines}),
            "output_tokens": sum(t.output_tokens for t in timelines),
            "prompt_tokens": sum(t.prompt_tokens for t in timelines),
            "cached_tokens": sum(t.cached_tokens for t in timelines),
            "resumed": sum(1 for t in timelines if t.resumed or t.deliveries > 1),
            "phases": phases}
