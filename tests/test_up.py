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


def test_workers_of_several_models_each_get_their_model(monkeypatch):
    from shared.settings import UpSettings
    from kvfleet.up import worker_models

    monkeypatch.delenv("KVFLEET_NUM_THREADS", raising=False)
    assert worker_models(UpSettings(model="m0")) == ["m0"]
    models = worker_models(UpSettings(model="m0", worker_models=" m1, m2 ,m1"))
    assert models == ["m1", "m2"]
    fleet = LocalFleet(2, {}, models)
    spawned = []
    monkeypatch.setattr(fleet, "_spawn", lambda role, extra: spawned.append(extra))
    for index in range(fleet.num_workers):
        fleet.start_worker(index)
    assert [extra["KVFLEET_MODEL"] for extra in spawned] == ["m1", "m1", "m2", "m2"]
    assert len({extra["KVFLEET_WORKER_ID"] for extra in spawned}) == 4


def test_up_takes_lora_modules_and_one_rank_limit_for_gateway_and_workers(monkeypatch):
    from kvfleet.cli import build_parser
    from kvfleet.flags import given_flags, settings_from_args
    from shared.settings import UpSettings, WorkerSettings

    args = build_parser().parse_args([
        "up", "--lora-modules", "sql=/adapters/sql", '{"name": "chat", "path": "/a b/chat"}',
        "--max-lora-rank", "32", "--worker-models", "m1,m2"])
    settings = settings_from_args(UpSettings, args)
    assert settings.lora_modules == ["sql=/adapters/sql", '{"name": "chat", "path": "/a b/chat"}']
    env = given_flags(UpSettings, args) | given_flags(WorkerSettings, args)
    assert env["KVFLEET_MAX_LORA_RANK"] == "32" and env["KVFLEET_WORKER_MODELS"] == "m1,m2"
    monkeypatch.setenv("KVFLEET_LORA_MODULES", env["KVFLEET_LORA_MODULES"])
    assert UpSettings().lora_modules == settings.lora_modules  # what a child reads back
    assert settings_from_args(WorkerSettings, args).max_lora_rank == 32
