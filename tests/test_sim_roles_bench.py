"""benchmarks/sim_roles.py's arithmetic: the steady streams' gaps split into calm and burst by
when they ended, and the verdict of prefill and decode apart."""

from __future__ import annotations

import pytest

from benchmarks.sim_roles import RolesResult, parse_args, report, split_gaps
from benchmarks.sim_scale import StepCounts
from kvfleet.bench.client import RequestRecord


def stream(sent: float, offsets: list[float]) -> RequestRecord:
    r = RequestRecord(0, 0.0, 100)
    r.sent_at_s, r.chunk_offsets_s = sent, offsets
    return r


def test_gaps_are_split_by_when_they_ended():
    records = [stream(1.0, [0.5, 1.0, 1.5, 3.0, 3.2]),  # chunks at 1.5, 2, 2.5, 4, 4.2
               stream(2.0, [0.1, 0.6]), stream(None, [1.0, 2.0])]
    calm, burst = split_gaps(records, burst_start_s=3.0, burst_end_s=4.1, calm_from_s=1.8)
    assert calm == pytest.approx([0.5, 0.5, 0.5])  # ended at 2.0, 2.5 (first), 2.6 (second)
    assert burst == pytest.approx([1.5])  # ended at 4.0; 4.2 is after the burst


def result(fleet: str, calm: float, burst: float) -> RolesResult:
    return RolesResult(fleet, calm, burst, 0.5, 0.9, 0, StepCounts(8, 1000, 3))


def test_the_verdict_is_the_apart_fleets_burst_over_calm():
    args = parse_args([])
    met = report([result("both", 0.010, 0.040), result("prefill+decode", 0.010, 0.014)], args)
    assert "| both | 10.0 | 40.0 | 4.00 |" in met
    assert "apart: burst / calm 1.40 (target at most 1.5: met)" in met
    missed = report([result("prefill+decode", 0.010, 0.016)], args)
    assert "1.60 (target at most 1.5: NOT met)" in missed
