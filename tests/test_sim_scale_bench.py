"""benchmarks/sim_scale.py's arithmetic: the lag verdict from the workers' heartbeats, and the
client's figures brought back to modelled time."""

from __future__ import annotations

import pytest

from benchmarks.sim_scale import StepCounts, modelled, step_counts
from kvfleet.bench.client import RequestRecord
from kvfleet.shared.wire import Heartbeat


def beat(steps: int, lagged: int, simulated: str = "roofline") -> Heartbeat:
    return Heartbeat(model="m", ts=0.0, simulated=simulated, sim_steps=steps,
                     sim_lagged_steps=lagged)


def test_the_lag_share_counts_the_load_only_and_only_simulated_workers():
    before = step_counts([beat(100, 50), beat(10, 0), beat(7, 7, simulated="")])
    after = step_counts([beat(1100, 80), beat(1010, 20), beat(99, 99, simulated="")])
    assert before.workers == 2 and after.workers == 2
    during = after.since(before)
    assert (during.steps, during.lagged) == (2000, 50)
    assert during.share == pytest.approx(0.025) and during.valid
    assert not StepCounts(2, 2000, 101).valid  # over 5%: the host could not play it
    assert StepCounts(2, 2000, 100).valid
    assert not StepCounts(2, 0, 0).valid  # no step played: nothing was shown


def record(index: int, ttft: float, offsets: list[float], tokens: int, done=True) -> RequestRecord:
    r = RequestRecord(index, 0.0, tokens)
    r.ttft_s, r.chunk_offsets_s, r.output_tokens, r.done = ttft, offsets, tokens, done
    return r


def test_the_clients_figures_are_divided_back_by_the_time_scale():
    records = [record(0, 2.0, [2.0, 3.0, 4.0], 3), record(1, 4.0, [4.0, 5.0, 7.0], 3),
               record(2, 1.0, [], 0, done=False)]
    result = modelled(records, duration_s=10.0, k=10.0, workers=4,
                      counts=StepCounts(4, 100, 0), load_average=1.0)
    assert result.requests == 2 and result.failed == 1
    assert result.errors == {"not done": 1}
    # 6 tokens in 10 real seconds at k = 10: 6 modelled tokens a modelled second
    assert result.output_tokens_per_s == pytest.approx(6.0)
    assert result.ttft_p50_s is not None and 0.2 <= result.ttft_p50_s <= 0.4
    assert result.itl_p99_s == pytest.approx(0.2, rel=0.1) and result.itl_p50_s == pytest.approx(0.1)
