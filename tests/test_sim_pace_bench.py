"""benchmarks/sim_pace.py's arithmetic: the streams a worker serves at pace by the roofline, the
fleet's figures from heartbeat deltas, the best fixed group and the verdict."""

from __future__ import annotations

import pytest

from benchmarks.sim_pace import PaceRow, best_fixed, parse_args, report, streams_at_pace, summarise
from benchmarks.sim_scale import StepCounts
from kvfleet.shared.pace import StepFeatures
from kvfleet.shared.wire import Heartbeat
from kvfleet.worker.sim.cost import RooflineCost


def test_the_streams_at_pace_are_the_most_whose_modelled_step_stays_within_the_target():
    cost = RooflineCost("h100", "random:llama-3.1-8b")
    target = 1.5 * cost.step_seconds(StepFeatures.of_decode(1, 4128))
    n = streams_at_pace(cost, target, 4128)
    assert cost.step_seconds(StepFeatures.of_decode(n, 4128)) <= target
    assert cost.step_seconds(StepFeatures.of_decode(n + 1, 4128)) > target
    assert 5 < n < 60
    assert streams_at_pace(cost, target, 640) > 2 * n  # short contexts: the weights bound


def beat(tokens: int, itl_ms: float, steps: int = 0) -> Heartbeat:
    return Heartbeat(model="m", ts=0.0, generated_tokens=tokens, itl_p99_ms=itl_ms,
                     simulated="x", sim_steps=steps)


def test_the_fleets_figures_are_heartbeat_deltas_in_modelled_time():
    row = summarise("pace", [beat(100, 0), beat(50, 0)], [beat(1100, 200, 10), beat(2050, 240, 10)],
                    seconds=10.0, k=20.0, done=5, failed=0)
    assert row.tokens_per_s == pytest.approx(3000 / 10 * 20)
    assert row.itl_p99_s == pytest.approx(0.240 / 20)  # the worst worker's


def row(config: str, tps: float, itl: float) -> PaceRow:
    return PaceRow(config, tps, itl, 10, 0, StepCounts(16, 1000, 0))


def test_the_best_fixed_group_meets_the_target_and_the_pace_is_judged_against_it():
    target = 0.011
    rows = [row("pace", 9500, 0.0105), row("group 8", 6000, 0.008),
            row("group 16", 10000, 0.0109), row("group 32", 14000, 0.016)]
    assert best_fixed(rows, target).config == "group 16"  # 32 is faster but misses the target
    text = report(rows, target, 576, parse_args([]))
    assert "(group 16): 0.95 of its throughput, ITL p99 within the target" in text
    assert text.endswith("met)")
    slow = report([row("pace", 8000, 0.0105), *rows[1:]], target, 576, parse_args([]))
    assert "0.80 of its throughput" in slow and slow.endswith("NOT met)")
    late = report([row("pace", 9500, 0.012), *rows[1:]], target, 576, parse_args([]))
    assert "over the target" in late and late.endswith("NOT met)")
