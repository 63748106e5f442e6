"""`kvfleet up`'s worker processes: the environment they are started with."""

from __future__ import annotations

from kvfleet.up import LocalFleet


def spawned_worker_env(monkeypatch, fleet_env: dict[str, str]) -> dict[str, str]:
    fleet = LocalFleet(2, fleet_env)
    spawned = []
    monkeypatch.setattr(fleet, "_spawn", lambda role, extra: spawned.append((role, extra)))
    fleet.start_worker(0)
    (role, extra), = spawned
    assert role == "worker"
    return extra


def test_workers_wait_passively_for_their_openmp_threads(monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("KVFLEET_NUM_THREADS", raising=False)
    extra = spawned_worker_env(monkeypatch, {})
    assert extra["OMP_WAIT_POLICY"] == "PASSIVE"
    assert int(extra["KVFLEET_NUM_THREADS"]) >= 1


def test_a_wait_policy_the_user_set_is_kept(monkeypatch):
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert "OMP_WAIT_POLICY" not in spawned_worker_env(monkeypatch, {})
    monkeypatch.delenv("OMP_WAIT_POLICY")
    assert "OMP_WAIT_POLICY" not in spawned_worker_env(monkeypatch, {"OMP_WAIT_POLICY": "ACTIVE"})
