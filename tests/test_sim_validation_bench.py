"""benchmarks/sim_validation.py's pure parts: the trace, the averaged curve, the verdicts."""

from __future__ import annotations

import pytest

from benchmarks.sim_validation import compare, make_trace, mean_curve
from kvfleet.bench.stats import Distribution
from kvfleet.shared.pace import StepCostCurve


def test_the_trace_is_seeded_poisson_with_prompts_in_range():
    trace = make_trace(400, 2.0, (10, 20), 32, seed=3)
    assert trace == make_trace(400, 2.0, (10, 20), 32, seed=3)
    assert trace != make_trace(400, 2.0, (10, 20), 32, seed=4)
    gaps = [b.arrival_s - a.arrival_s for a, b in zip(trace, trace[1:])]
    assert all(g >= 0 for g in gaps) and sum(gaps) / len(gaps) == pytest.approx(0.5, rel=0.15)
    assert all(10 <= len(r.prompt.split()) <= 20 and r.ignore_eos and r.max_tokens == 32
               for r in trace)


def test_the_workers_curves_are_averaged_coefficient_by_coefficient():
    a = StepCostCurve(base_s=0.01, decode_row_s=0.002, prefill_token_s=1e-4, steps=50)
    b = StepCostCurve(base_s=0.03, decode_row_s=0.004, prefill_token_s=3e-4, steps=80)
    mean = mean_curve([a, b])
    assert (mean.base_s, mean.decode_row_s, mean.prefill_token_s) == pytest.approx(
        (0.02, 0.003, 2e-4))
    assert mean.steps == 50 and mean.fitted
    with pytest.raises(ValueError, match="no worker has a fitted step cost"):
        mean_curve([])


class FakeSummary:
    def __init__(self, tps, ttft, itl):
        self.output_tokens_per_s = tps
        self.ttft_s = Distribution(1, None, None, ttft[0], ttft[1], None, None)
        self.itl_s = Distribution(1, None, None, itl[0], None, itl[1], None)


def test_the_verdicts_apply_the_issues_tolerances():
    real = FakeSummary(100.0, (1.0, 2.0), (0.02, 0.2))
    sim = FakeSummary(109.0, (1.19, 2.5), (0.02, None))
    rows = {name: (ratio, ok) for name, _, _, ratio, ok in compare(real, sim)}
    assert rows["output tok/s"] == (pytest.approx(1.09), True)  # within 10%
    assert rows["TTFT p50 s"] == (pytest.approx(1.19), True)  # within 20%
    assert rows["TTFT p90 s"] == (pytest.approx(1.25), False)
    assert rows["ITL p99 s"] == (None, None)  # no figure: no verdict
    assert compare(real, FakeSummary(89.0, (1, 2), (0.02, 0.2)))[0][4] is False
