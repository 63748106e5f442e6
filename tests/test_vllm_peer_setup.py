"""The environment the benchmarks give vLLM: its defaults, or its CPU guide's tuned setup."""

from __future__ import annotations

import os

from benchmarks import vllm_peer
from benchmarks.vllm_peer import describe_setup, vllm_env


def test_defaults_leave_vllm_threads_and_allocator_alone(monkeypatch):
    for name in ("LD_PRELOAD", "VLLM_CPU_OMP_THREADS_BIND"):
        monkeypatch.delenv(name, raising=False)
    env = vllm_env(None, "defaults")
    assert "LD_PRELOAD" not in env and "VLLM_CPU_OMP_THREADS_BIND" not in env
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "1"


def test_tuned_binds_every_allowed_cpu_and_preloads_what_is_installed(monkeypatch, tmp_path):
    for name in ("LD_PRELOAD", "VLLM_CPU_OMP_THREADS_BIND"):
        monkeypatch.delenv(name, raising=False)
    (tmp_path / "bin").mkdir()
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "libiomp5.so").write_bytes(b"")
    tcmalloc = tmp_path / "libtcmalloc_minimal.so.4"
    monkeypatch.setattr(vllm_peer, "TCMALLOC", tcmalloc)  # not installed: left out
    env = vllm_env(tmp_path / "bin" / "python", "tuned")
    assert env["LD_PRELOAD"] == str(tmp_path / "lib" / "libiomp5.so")
    cpus = sorted(os.sched_getaffinity(0))
    bound = env["VLLM_CPU_OMP_THREADS_BIND"]
    listed = (list(range(int(bound.split("-")[0]), int(bound.split("-")[1]) + 1)) if "-" in bound
              else [int(c) for c in bound.split(",")])
    assert listed == cpus
    tcmalloc.write_bytes(b"")
    env = vllm_env(tmp_path / "bin" / "python", "tuned")
    assert env["LD_PRELOAD"].split(":") == [str(tcmalloc), str(tmp_path / "lib" / "libiomp5.so")]
    assert "libtcmalloc_minimal + libiomp5 preloaded" in describe_setup(tmp_path / "bin" / "python", "tuned")


def test_its_own_values_already_set_are_kept_the_callers_preload_is_not(monkeypatch, tmp_path):
    """VLLM_* variables set by the caller are vLLM's own settings; an LD_PRELOAD of the caller's
    shell is not (benchmarks/peer_env.py): vLLM gets its CPU guide's, or none."""
    monkeypatch.setattr(vllm_peer, "TCMALLOC", tmp_path / "libtcmalloc_minimal.so.4")
    monkeypatch.setenv("LD_PRELOAD", "/elsewhere/libjemalloc.so")
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "8")
    env = vllm_env(tmp_path / "bin" / "python", "tuned")
    assert "LD_PRELOAD" not in env  # nothing of its setup is installed here
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0" and env["VLLM_CPU_KVCACHE_SPACE"] == "8"
