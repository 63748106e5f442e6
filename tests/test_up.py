"""`kvfleet up`'s worker processes: the environment they are started with (roles included), the
checks of the workers' mix, which ones are restarted, and how the fleet stops them."""

from __future__ import annotations

import subprocess
import sys

import pytest

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
    from kvfleet.shared.settings import UpSettings
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
    from kvfleet.shared.settings import UpSettings, WorkerSettings

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


def test_prefill_and_decode_workers_get_their_role_and_a_local_handoff_address(monkeypatch):
    for name in ("KVFLEET_ROLE", "KVFLEET_HANDOFF_ADVERTISE_HOST", "KVFLEET_HANDOFF_PORT"):
        monkeypatch.delenv(name, raising=False)
    fleet = LocalFleet(1, {}, ["m1", "m2"], prefill_workers=1, decode_workers=2)
    spawned = []
    monkeypatch.setattr(fleet, "_spawn", lambda role, extra: spawned.append(extra))
    for index in range(fleet.num_workers):
        fleet.start_worker(index)
    # the --workers one takes --role as the child reads it (`both` by default)
    assert [(extra["KVFLEET_MODEL"], extra.get("KVFLEET_ROLE")) for extra in spawned] == [
        ("m1", None), ("m1", "prefill"), ("m1", "decode"), ("m1", "decode"),
        ("m2", None), ("m2", "prefill"), ("m2", "decode"), ("m2", "decode")]
    # peers on this host reach each other's transfer plane, each on a free port of its own
    assert {extra["KVFLEET_HANDOFF_ADVERTISE_HOST"] for extra in spawned} == {"127.0.0.1"}
    assert not any("KVFLEET_HANDOFF_PORT" in extra for extra in spawned)
    monkeypatch.setenv("KVFLEET_HANDOFF_ADVERTISE_HOST", "10.0.0.5")  # the user's is kept
    spawned.clear()
    fleet.start_worker(0)
    assert "KVFLEET_HANDOFF_ADVERTISE_HOST" not in spawned[0]


def test_the_workers_mix_is_checked_before_anything_starts(monkeypatch):
    from kvfleet.up import fleet_workers
    from kvfleet.shared.settings import UpSettings

    for name in ("KVFLEET_ROLE", "KVFLEET_HANDOFF_PORT", "KVFLEET_PREFILL_WORKERS",
                 "KVFLEET_DECODE_WORKERS"):
        monkeypatch.delenv(name, raising=False)
    assert fleet_workers(None, UpSettings()) == 1
    assert fleet_workers(2, UpSettings()) == 2
    split = UpSettings(prefill_workers=1, decode_workers=2)
    assert fleet_workers(None, split) == 0  # --workers defaults to none beside them
    assert fleet_workers(1, split) == 1
    with pytest.raises(SystemExit, match="--workers must be at least 1"):
        fleet_workers(0, UpSettings())
    with pytest.raises(SystemExit, match="prefill workers need --decode-workers"):
        fleet_workers(None, UpSettings(prefill_workers=2))
    with pytest.raises(SystemExit, match="decode workers take no new requests"):
        fleet_workers(None, UpSettings(decode_workers=2))
    assert fleet_workers(1, UpSettings(decode_workers=2)) == 1  # a `both` worker takes them
    monkeypatch.setenv("KVFLEET_ROLE", "prefill")  # --role of the --workers ones
    with pytest.raises(SystemExit, match="prefill workers need --decode-workers"):
        fleet_workers(2, UpSettings())
    monkeypatch.setenv("KVFLEET_ROLE", "decode")
    with pytest.raises(SystemExit, match="decode workers take no new requests"):
        fleet_workers(2, UpSettings())
    monkeypatch.delenv("KVFLEET_ROLE")
    monkeypatch.setenv("KVFLEET_HANDOFF_PORT", "8101")
    with pytest.raises(SystemExit, match="--handoff-port must be 0"):
        fleet_workers(2, UpSettings())
    assert fleet_workers(1, UpSettings()) == 1


def child(code: str) -> subprocess.Popen:
    """A child process running `code` after it installed its signal handlers (it prints
    `ready` then): exit 2 on SIGINT, 15 on SIGTERM."""
    proc = subprocess.Popen([sys.executable, "-c", (
        "import signal, sys, time\n"
        "signal.signal(signal.SIGINT, lambda *_: sys.exit(2))\n"
        "signal.signal(signal.SIGTERM, lambda *_: sys.exit(15))\n"
        "print('ready', flush=True)\n" + code)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "ready\n"
    return proc


class Ticks:
    """A stop event that is set after `n` periods."""

    def __init__(self, n: int):
        self.n = n

    def wait(self, _timeout: float) -> bool:
        self.n -= 1
        return self.n < 0


def test_a_drained_worker_is_not_restarted_a_dead_one_is(monkeypatch):
    fleet = LocalFleet(3, {})
    fleet.gateway, fleet.batch = child("time.sleep(60)"), child("time.sleep(60)")
    drained, crashed, alive = child("sys.exit(0)"), child("sys.exit(3)"), child("time.sleep(60)")
    fleet.workers = [drained, crashed, alive]
    drained.wait()
    crashed.wait()
    restarted = []
    monkeypatch.setattr(fleet, "start_worker", restarted.append)
    try:
        assert fleet.supervise(Ticks(1)) == 0
        assert restarted == [1]
        assert fleet.workers[0] is None and fleet.workers[2] is alive  # the fleet scaled in
    finally:
        fleet.stop()


def test_the_fleet_stops_workers_at_once_and_the_rest_gracefully():
    fleet = LocalFleet(2, {})
    fleet.gateway, fleet.batch = child("time.sleep(60)"), child("time.sleep(60)")
    fleet.workers = [child("time.sleep(60)"), None]  # a drained slot is empty
    fleet.stop(timeout_s=30)
    # SIGINT: a worker leaves at once, no drain (its peers stop too)
    assert fleet.workers[0].returncode == 2
    assert (fleet.gateway.returncode, fleet.batch.returncode) == (15, 15)
