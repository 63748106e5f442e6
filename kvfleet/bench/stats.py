"""Statistics of one benchmark run: the seed's four numbers (TTFT, tokens/s per stream, tokens/s
per accelerator, cost per token), latency percentiles, and goodput — the share of requests that
met the service-level objective (first token soon enough, and a stream pace fast enough)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np

from kvfleet.bench.client import RequestRecord
from kvfleet.bench.loadgen import RunResult
from kvfleet.plan.capacity import cost_per_million_tokens

PERCENTILES = (50, 90, 99)
_MAX_ERROR_KINDS = 5


@dataclass(frozen=True)
class Slo:
    ttft_s: float = 2.0  # first token within this
    tokens_per_s: float = 20.0  # stream pace at least this (the seed's reading pace)


@dataclass(frozen=True)
class Distribution:
    count: int
    mean: float | None
    min: float | None
    p50: float | None
    p90: float | None
    p99: float | None
    max: float | None


@dataclass(frozen=True)
class Summary:
    load: str
    num_requests: int  # sent
    num_ok: int
    num_errors: int
    errors: dict[str, int]  # the most common error messages
    num_without_usage: int  # ok requests whose tokens were counted from chunks
    duration_s: float
    total_output_tokens: int
    output_tokens_per_s: float
    num_workers: int
    tokens_per_s_per_accelerator: float
    cost_per_hour: float | None  # per accelerator
    cost_per_million_output_tokens: float | None
    requests_per_s: float  # completed requests per second
    ttft_s: Distribution
    itl_s: Distribution
    e2e_s: Distribution
    tokens_per_s_per_stream: Distribution
    slo: Slo
    num_good: int
    goodput_fraction: float  # of requests sent
    goodput_requests_per_s: float


def distribution(values: list[float]) -> Distribution:
    if not values:
        return Distribution(0, None, None, None, None, None, None)
    array = np.asarray(values, dtype=float)
    p50, p90, p99 = (float(v) for v in np.percentile(array, PERCENTILES))
    return Distribution(len(values), float(array.mean()), float(array.min()), p50, p90, p99,
                        float(array.max()))


def meets_slo(record: RequestRecord, slo: Slo) -> bool:
    """Good = completed, first token within the TTFT objective, and (when the answer had more
    than one chunk, so a pace exists) a stream pace at or above the objective."""
    if not record.ok or record.ttft_s is None or record.ttft_s > slo.ttft_s:
        return False
    pace = record.tokens_per_s
    return pace is None or pace >= slo.tokens_per_s


def summarise(result: RunResult, slo: Slo, num_workers: int,
              cost_per_hour: float | None) -> Summary:
    records, duration_s = result.records, max(result.duration_s, 1e-9)
    ok = [r for r in records if r.ok]
    total_output_tokens = sum(r.output_tokens or 0 for r in ok)
    output_tokens_per_s = total_output_tokens / duration_s
    num_good = sum(meets_slo(r, slo) for r in records)
    return Summary(
        load=result.load.label(),
        num_requests=len(records), num_ok=len(ok), num_errors=len(records) - len(ok),
        errors=_error_counts(records),
        num_without_usage=sum(not r.usage_reported for r in ok),
        duration_s=result.duration_s,
        total_output_tokens=total_output_tokens,
        output_tokens_per_s=output_tokens_per_s,
        num_workers=num_workers,
        tokens_per_s_per_accelerator=output_tokens_per_s / num_workers,
        cost_per_hour=cost_per_hour,
        cost_per_million_output_tokens=_cost(cost_per_hour, num_workers, output_tokens_per_s),
        requests_per_s=len(ok) / duration_s,
        ttft_s=distribution([r.ttft_s for r in ok if r.ttft_s is not None]),
        itl_s=distribution([gap for r in ok for gap in r.itl_s]),
        e2e_s=distribution([r.e2e_s for r in ok if r.e2e_s is not None]),
        tokens_per_s_per_stream=distribution(
            [r.tokens_per_s for r in ok if r.tokens_per_s is not None]),
        slo=slo,
        num_good=num_good,
        goodput_fraction=num_good / len(records) if records else 0.0,
        goodput_requests_per_s=num_good / duration_s,
    )


def _cost(cost_per_hour: float | None, num_workers: int,
          output_tokens_per_s: float) -> float | None:
    if cost_per_hour is None or output_tokens_per_s <= 0:
        return None
    return cost_per_million_tokens(cost_per_hour * num_workers, output_tokens_per_s)


def _error_counts(records: list[RequestRecord]) -> dict[str, int]:
    counts = Counter(r.error for r in records if r.error is not None)
    return dict(counts.most_common(_MAX_ERROR_KINDS))
