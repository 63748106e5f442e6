"""`kvfleet up`'s worker processes: the environment they are started with."""

from __future__ import annotations

from kvfleet.up import WORKER_OPENMP_ENV, LocalFleet


def spawned_worker_env(monkeypatch, fleet_env: dict[str, str]) -> dict[str, str]:
    fleet = LocalFleet(2, fleet_env)
    spawned = []
    monkeypatch.setattr(fleet, "_spawn", lambda role, extra: spawned.append((role, extra)))
    fleet.start_worker(0)
    (role, extra), = spawned
    assert role == "worker"
    return extra


def test_workers_wait_passively_after_a_short_spin(monkeypatch):
    for name in (*WORKER_OPENMP_ENV, "KVFLEET_NUM_THREADS"):
        monkeypatch.delenv(name, raising=False)
    extra = spawned_worker_env(monkeypatch, {})
    assert extra["OMP_WAIT_POLICY"] == "PASSIVE"
    assert 0 < int(extra["GOMP_SPINCOUNT"]) <= 100_000  # at most ~1 ms of spinning per wait
    assert int(extra["KVFLEET_NUM_THREADS"]) >= 1


def test_a_wait_policy_or_spin_count_the_user_set_is_kept(monkeypatch):
    for name in WORKER_OPENMP_ENV:
        monkeypatch.delenv(name, raising=False)
    for name, value in (("OMP_WAIT_POLICY", "ACTIVE"), ("GOMP_SPINCOUNT", "0")):
        monkeypatch.setenv(name, value)
        extra = spawned_worker_env(monkeypatch, {})
        assert not set(WORKER_OPENMP_ENV) & set(extra)
        monkeypatch.delenv(name)
        extra = spawned_worker_env(monkeypatch, {name: value})
        assert not set(WORKER_OPENMP_ENV) & set(extra)
