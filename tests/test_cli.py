"""The `kvfleet` command line: help texts, flags, and settings from the environment."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvfleet.cli import build_parser
from kvfleet.flags import given_flags, settings_from_args
from shared.settings import GatewaySettings, WorkerSettings, parse_bytes


@pytest.mark.parametrize("command", ["up", "gateway", "worker", "plan", "bench", "batch-worker", "keys"])
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


@pytest.mark.parametrize("text,expected", [("2GiB", 2 * 1024**3), ("512MB", 512 * 10**6),
                                           ("1000", 1000), ("1.5k", 1500)])
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


def test_parse_bytes_rejects_nonsense():
    with pytest.raises(ValueError, match="not a size"):
        parse_bytes("two gigs")


def test_kv_format_and_preemption_settings_reach_the_engine_config(monkeypatch):
    from worker.main import engine_config

    args = build_parser().parse_args(["up", "--kv-dtype", "int8", "--preemption", "swap",
                                      "--swap-space", "2GiB"])
    env = given_flags(WorkerSettings, args)
    assert (env["KVFLEET_KV_DTYPE"], env["KVFLEET_PREEMPTION"]) == ("int8", "swap")
    for name, value in env.items():  # what a worker child of `up` sees
        monkeypatch.setenv(name, value)
    config = engine_config(WorkerSettings())
    assert (config.kv_dtype, config.preemption, config.swap_space_bytes) == ("int8", "swap", 2 << 30)
    monkeypatch.setenv("KVFLEET_KV_DTYPE", "int4")
    with pytest.raises(ValueError, match="kv_dtype"):
        WorkerSettings()
    with pytest.raises(SystemExit):  # argparse refuses what is not a choice
        build_parser().parse_args(["worker", "--preemption", "sometimes"])


def test_tensor_parallel_size_reaches_the_engine_config(monkeypatch):
    from worker.main import engine_config

    args = build_parser().parse_args(["up", "--workers", "1", "--tensor-parallel-size", "2"])
    env = given_flags(WorkerSettings, args)
    assert env["KVFLEET_TENSOR_PARALLEL_SIZE"] == "2"
    monkeypatch.setenv("KVFLEET_TENSOR_PARALLEL_SIZE", "2")
    assert engine_config(WorkerSettings()).tensor_parallel_size == 2
    monkeypatch.setenv("KVFLEET_TENSOR_PARALLEL_SIZE", "0")
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        WorkerSettings()
