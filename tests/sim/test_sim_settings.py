"""The simulation's settings: checked before anything loads (worker/sim/checks.py), and the
fleet's own timings scaled with the steps (worker/sim/host.py)."""

from __future__ import annotations

import pytest

from kvfleet.shared.settings import WorkerSettings
from kvfleet.worker.process.heartbeat_sender import LOAD_BEAT_MIN_S, LOAD_BEAT_SHARE
from kvfleet.worker.sim.checks import check_sim_settings
from kvfleet.worker.sim.host import SCALED_TIMINGS, scaled_timings


def test_the_fleets_timings_run_k_times_longer_under_a_time_scale():
    base = WorkerSettings(sim_workers=2, sim_device="h100", sim_time_scale=10,
                          publish_interval_ms=5.0)
    scaled = scaled_timings(base)
    for name in SCALED_TIMINGS:
        assert getattr(scaled, name) == pytest.approx(getattr(base, name) * 10), name
    assert scaled.heartbeat_ttl_s == 50.0 and scaled.affinity_steal_after_ms == 2500
    assert isinstance(scaled.steal_after_ms, int)
    # what is not the fleet's pace stays: a poll's timeout, the results' lifetime
    assert scaled.read_block_ms == base.read_block_ms and scaled.result_ttl_s == base.result_ttl_s
    assert scaled_timings(base.model_copy(update={"sim_time_scale": 1.0})) == \
        base.model_copy(update={"sim_time_scale": 1.0})
    # a load change beats early at most every 5% of the (scaled) interval, never under 50 ms
    assert max(LOAD_BEAT_MIN_S, LOAD_BEAT_SHARE * scaled.heartbeat_interval_s) == 0.5
    assert max(LOAD_BEAT_MIN_S, LOAD_BEAT_SHARE * base.heartbeat_interval_s) == 0.05


@pytest.mark.parametrize("settings, says", [
    (dict(sim_workers=2), "exactly one cost model"),
    (dict(sim_device="h100", sim_step_cost="x.json"), "exactly one cost model"),
    (dict(sim_device="tpu"), "unknown accelerator"),
    (dict(sim_device="h100", sim_answer_tokens="fixed:0"), "fixed:N"),
    (dict(sim_step_cost="/nonexistent.json"), "no such file"),
    (dict(sim_workers=3, sim_device="h100", handoff_port=7000), "--handoff-port must be 0"),
    (dict(sim_device="h100", speculative_config={"method": "ngram"}), "speculative decoding"),
])
def test_bad_simulation_settings_exit_naming_the_setting(settings, says):
    with pytest.raises(SystemExit, match=says):
        check_sim_settings(WorkerSettings(**settings))


def test_real_workers_and_good_simulations_pass_the_checks():
    check_sim_settings(WorkerSettings())  # no simulation: nothing checked
    check_sim_settings(WorkerSettings(sim_workers=64, sim_device="H100-SXM",
                                      sim_answer_tokens="exp:200"))
    check_sim_settings(WorkerSettings(sim_step_cost="worker:w1"))
