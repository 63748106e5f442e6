"""The `kvfleet` command line: help texts, flags, and settings from the environment."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from kvfleet.cli import build_parser
from kvfleet.flags import given_flags, settings_from_args
from kvfleet.shared.byte_size import parse_bytes
from kvfleet.shared.settings import GatewaySettings, WorkerSettings
from kvfleet.shared.wire import Heartbeat, Keys


@pytest.mark.parametrize("command", ["up", "gateway", "worker", "plan", "bench", "batch-worker",
                                     "keys", "drain", "timelines"])
def test_every_command_has_help(command):
    result = subprocess.run([sys.executable, "-m", "kvfleet", command, "--help"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "usage: kvfleet " + command in result.stdout


def test_up_accepts_every_worker_option():
    parser = build_parser()
    args = parser.parse_args(["up", "--workers", "2", "--kv-memory", "2GiB",
                              "--max-batched-tokens", "256", "--no-enable-prefix-caching"])
    env = given_flags(WorkerSettings, args)
    assert env["KVFLEET_KV_MEMORY"] == "2GiB"
    assert env["KVFLEET_MAX_BATCHED_TOKENS"] == "256"
    assert env["KVFLEET_ENABLE_PREFIX_CACHING"] == "false"
    assert "KVFLEET_DTYPE" not in env  # not given: the child reads env or defaults


def test_flags_override_environment_which_overrides_defaults(monkeypatch):
    monkeypatch.setenv("KVFLEET_MODEL", "from-env")
    monkeypatch.setenv("KVFLEET_REDIS_URL", "redis://example:1/0")
    args = build_parser().parse_args(["gateway", "--model", "from-flag"])
    settings = settings_from_args(GatewaySettings, args)
    assert settings.model == "from-flag"
    assert settings.redis_url == "redis://example:1/0"
    assert settings.port == 8000


def test_a_bad_setting_is_a_clear_error_not_a_traceback():
    result = subprocess.run([sys.executable, "-m", "kvfleet", "worker", "--kv-memory", "lots"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    assert "--kv-memory" in result.stderr and "not a size" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_bad_variable_is_named_with_its_flag_and_the_choices(monkeypatch):
    monkeypatch.setenv("KVFLEET_KV_DTYPE", "int4")
    with pytest.raises(SystemExit) as failed:
        settings_from_args(WorkerSettings, build_parser().parse_args(["worker"]))
    message = str(failed.value)
    assert "--kv-dtype (KVFLEET_KV_DTYPE)" in message and "'fp8'" in message and "'int8'" in message


def test_up_refuses_a_bad_worker_setting_before_starting_anything(monkeypatch):
    from kvfleet import cli, up

    started = []
    monkeypatch.setattr(up, "run_fleet", lambda *args: started.append(args) or 0)
    with pytest.raises(SystemExit, match="--block-size"):
        cli.main(["up", "--block-size", "0"])
    assert cli.main(["up", "--block-size", "32"]) == 0
    assert started[0][1]["KVFLEET_BLOCK_SIZE"] == "32"


def test_the_help_shows_each_settings_text_and_default():
    result = subprocess.run([sys.executable, "-m", "kvfleet", "worker", "--help"],
                            capture_output=True, text=True, timeout=60)
    text = " ".join(result.stdout.split("WorkerSettings (env KVFLEET_<NAME>)")[1].split())
    backend = text[text.index("--attention-backend"):text.index("--cuda-graphs")]
    assert "auto: triton (the Triton paged-attention kernel) on CUDA" in backend
    assert backend.rstrip().endswith("(default: auto)")
    memory = text[text.index("--kv-memory"):text.index("--gpu-memory-utilization")]
    assert memory.rstrip().endswith("(default: 1GiB)")


def test_drain_asks_a_live_worker_and_names_the_live_ones_otherwise(redis_url, redis_client,
                                                                    capsys):
    from kvfleet.gateway.admin import DRAIN_REQUEST_TTL_S
    from kvfleet import cli

    keys = Keys("kvdrain:")
    beat = Heartbeat(model="m", ts=time.time(), running=2, role="prefill")
    redis_client.hset(keys.worker("w-a"), mapping=beat.encode())
    flags = ["--redis-url", redis_url, "--key-prefix", "kvdrain:"]
    assert cli.main(["drain", "w-a", *flags]) == 0
    assert "asked worker w-a (m, role prefill, 2 running) to drain" in capsys.readouterr().out
    assert 0 < redis_client.ttl(keys.drain("w-a")) <= DRAIN_REQUEST_TTL_S
    assert cli.main(["drain", "w-b", *flags]) == 1
    assert "no live worker w-b (no heartbeat); live workers: w-a" in capsys.readouterr().err
    assert not redis_client.exists(keys.drain("w-b"))
