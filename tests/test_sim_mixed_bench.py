"""benchmarks/sim_mixed.py's verdict: the mixed fleet against the sum of each kind alone."""

from __future__ import annotations

from benchmarks.sim_mixed import parse_args, report
from benchmarks.sim_pace import PaceRow
from benchmarks.sim_scale import StepCounts


def result(tps: float, lagged: int = 0, running: int = 100) -> PaceRow:
    return PaceRow("x", tps, 0.03, 0, 0, StepCounts(4, 1000, lagged), running)


def test_the_mixed_fleet_is_judged_against_the_sum_of_each_kind_alone():
    args = parse_args(["--kinds", "h100,a100"])
    met = report({"h100": result(8000), "a100": result(5000), "h100+a100": result(11800)}, args)
    assert "mixed / sum of each alone: 0.91 (target at least 0.9: met)" in met
    missed = report({"h100": result(8000), "a100": result(5000),
                     "h100+a100": result(11000, lagged=60)}, args)
    assert "0.85 (target at least 0.9: NOT met)" in missed
    assert "6.0% INVALID" in missed  # a lagging run says so beside its figure


def test_a_fleet_that_ran_every_stream_sent_is_named_not_full():
    """The mixed fleet's room is the sum of both kinds': a client that sends fewer streams
    bounds it, not the fleet (the verdict would read low); the report says so."""
    args = parse_args(["--kinds", "h100,a100", "--streams", "768"])
    bounded = report({"h100": result(8000, running=512), "a100": result(5000, running=300),
                      "h100+a100": result(10000, running=768)}, args)
    assert "| h100+a100 | 10,000 | 30.0 | 768 |" in bounded
    assert "not full: h100+a100 ran 95% or more of the 768 streams sent" in bounded
    full = report({"h100": result(8000, running=512), "a100": result(5000, running=300),
                   "h100+a100": result(12000, running=700)}, args)
    assert "not full" not in full
