"""A load sweep: run the trace at increasing load until SLO goodput falls below a target, and
name the largest load that still met it — the seed's "largest group that still meets the pace
promised to users"."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace

from kvfleet.bench.loadgen import LoadSpec, RunResult
from kvfleet.bench.stats import Summary

SWEEP_BY_CHOICES = ("rate", "concurrency")
DEFAULT_RATE_LOADS = (0.25, 0.5, 1, 2, 4, 8, 16, 32, 64)
DEFAULT_CONCURRENCY_LOADS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


@dataclass(frozen=True)
class SweepStep:
    load: float
    result: RunResult
    summary: Summary


@dataclass(frozen=True)
class SweepResult:
    sweep_by: str
    goodput_target: float
    steps: list[SweepStep]  # in increasing load, up to and including the first that failed
    best_load: float | None  # the largest load whose goodput met the target


def default_loads(sweep_by: str) -> list[float]:
    return list(DEFAULT_RATE_LOADS if sweep_by == "rate" else DEFAULT_CONCURRENCY_LOADS)


def load_at(base: LoadSpec, sweep_by: str, load: float) -> LoadSpec:
    """Rate sweeps keep the base concurrency cap; concurrency sweeps keep the base rate (inf,
    a closed loop, unless the operator gave --rate)."""
    if sweep_by == "rate":
        return replace(base, rate=load)
    return replace(base, concurrency=int(load))


async def sweep(run_one: Callable[[LoadSpec], Awaitable[tuple[RunResult, Summary]]],
                base: LoadSpec, sweep_by: str, loads: list[float],
                goodput_target: float) -> SweepResult:
    steps: list[SweepStep] = []
    best_load = None
    for load in sorted(loads):
        result, summary = await run_one(load_at(base, sweep_by, load))
        steps.append(SweepStep(load, result, summary))
        if summary.goodput_fraction < goodput_target:
            break
        best_load = load
    return SweepResult(sweep_by, goodput_target, steps, best_load)
