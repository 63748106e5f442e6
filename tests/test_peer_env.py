"""Every process a benchmark starts to compare against (vLLM's server and offline run, SGLang's
router, `kvfleet up` beside them) gets this shell's environment less its OpenMP, math-library
and allocator variables (benchmarks/peer_env.py), and keeps what it needs: PATH, HOME, its own
VLLM_*/KVFLEET_* settings, and the setup the benchmark gives it."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from benchmarks import affinity_servers, http_peers, lora, speculation, vllm_peer
from benchmarks.peer_env import dropped_line, dropped_names, peer_env

DIRTY = {
    "OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "10000", "OMP_NUM_THREADS": "1",
    "KMP_BLOCKTIME": "0", "KMP_AFFINITY": "compact", "MKL_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1", "ONEDNN_MAX_CPU_ISA": "AVX2", "DNNL_VERBOSE": "1",
    "LD_PRELOAD": "/caller/libjemalloc.so", "MALLOC_ARENA_MAX": "2",
    "MALLOC_CONF": "background_thread:true", "_RJEM_MALLOC_CONF": "narenas:1",
    "JEMALLOC_SYS_WITH_MALLOC_CONF": "x", "TCMALLOC_RELEASE_RATE": "10",
    "MIMALLOC_ARENA_EAGER_COMMIT": "1", "GLIBC_TUNABLES": "glibc.malloc.arena_max=1",
}
KEPT = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/home/someone", "LANG": "C.UTF-8",
        "HF_HOME": "/cache/hf", "VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_CPU_OMP_THREADS_BIND": "0",
        "KVFLEET_LOG_LEVEL": "info", "LD_LIBRARY_PATH": "/opt/lib", "TOKENIZERS_PARALLELISM": "0"}


def assert_clean(env: dict[str, str]) -> None:
    leaked = {name: env[name] for name in DIRTY if env.get(name) == DIRTY[name]}
    assert not leaked, f"the caller's variables reached the peer: {leaked}"
    assert not any(name.startswith(("OMP_", "GOMP_", "KMP_", "MKL_", "MALLOC_")) for name in env)
    for name, value in KEPT.items():
        assert env[name] == value, name


@pytest.fixture
def dirty(monkeypatch):
    for name, value in {**DIRTY, **KEPT}.items():
        monkeypatch.setenv(name, value)


def test_peer_env_drops_openmp_and_allocator_variables_and_keeps_the_rest():
    env = peer_env(base={**DIRTY, **KEPT})
    assert_clean(env)
    assert set(env) == set(KEPT)
    assert dropped_names({**DIRTY, **KEPT}) == sorted(DIRTY)


def test_the_peers_own_settings_go_on_top_whatever_their_names():
    env = peer_env({"LD_PRELOAD": "/peer/libtcmalloc.so", "KVFLEET_MAX_QUEUE_WAIT_S": "0"},
                   base={**DIRTY, **KEPT})
    assert env["LD_PRELOAD"] == "/peer/libtcmalloc.so"
    assert env["KVFLEET_MAX_QUEUE_WAIT_S"] == "0"


def test_the_header_names_what_was_dropped():
    assert dropped_line({"PATH": "/bin"}) is None
    line = dropped_line({"PATH": "/bin", "OMP_WAIT_POLICY": "PASSIVE", "LD_PRELOAD": "x"})
    assert "LD_PRELOAD, OMP_WAIT_POLICY" in line and "PATH" not in line
    assert dropped_line({"KMP_BLOCKTIME": "0"}, peers="vLLM").startswith(
        "# not passed to vLLM: KMP_BLOCKTIME")


@pytest.mark.parametrize("setup", ["tuned", "defaults"])
def test_vllm_gets_its_own_setup_and_none_of_the_callers(dirty, monkeypatch, tmp_path, setup):
    (tmp_path / "bin").mkdir()
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "libiomp5.so").write_bytes(b"")
    monkeypatch.setattr(vllm_peer, "TCMALLOC", tmp_path / "absent.so")
    env = vllm_peer.vllm_env(tmp_path / "bin" / "python", setup)
    assert_clean(env)
    if setup == "tuned":  # its CPU guide's preload, not the caller's jemalloc
        assert env["LD_PRELOAD"] == str(tmp_path / "lib" / "libiomp5.so")
    else:
        assert "LD_PRELOAD" not in env


class Launches:
    """subprocess.Popen and subprocess.run as the benchmarks call them: each call's env kept,
    nothing started (run_offline's result file written as vllm_offline would)."""

    def __init__(self):
        self.envs: list[dict[str, str]] = []

    def popen(self, command, **kwargs):
        self.envs.append(kwargs.get("env"))

        class Process:
            pid, returncode = 0, None

            def poll(self):
                return None

        return Process()

    def run(self, command, **kwargs):
        self.envs.append(kwargs.get("env"))
        if "--out" in command:
            Path(command[command.index("--out") + 1]).write_text(json.dumps(
                {"startup_s": 1.0, "seconds": 1.0, "outputs": [[1]], "vllm_version": "x"}))
        return subprocess.CompletedProcess(command, 0, stdout="1.0\n", stderr="")


LAUNCHES = {
    "http_peers kvfleet up": lambda tmp: http_peers.kvfleet_server(1, "auto", tmp / "log"),
    "speculation kvfleet up": lambda tmp: speculation.kvfleet_up(1, None, tmp / "log"),
    "lora kvfleet up": lambda tmp: lora.kvfleet_up(1, {"a": "/a"}, 8, tmp / "log"),
    "vLLM server": lambda tmp: vllm_peer.VllmServer(tmp / "python", "/m", 1, "bfloat16",
                                                    tmp / "log"),
    "vLLM offline": lambda tmp: vllm_peer.run_offline(tmp / "python", "/m", [[1]], [1],
                                                      "bfloat16", 1),
    "fleet_affinity kvfleet up": lambda tmp: affinity_servers.KvfleetServer(
        2, "affinity", "auto", tmp / "log", num_threads=1),
    "SGLang router": lambda tmp: affinity_servers.SglangRouter(tmp / "python", ["http://x"],
                                                               "cache_aware", tmp / "log"),
    "SGLang router version": lambda tmp: affinity_servers.sglang_router_version(tmp / "python"),
}


@pytest.mark.parametrize("launch", sorted(LAUNCHES))
def test_every_peer_launch_gets_a_clean_environment(dirty, monkeypatch, tmp_path, launch):
    launches = Launches()
    monkeypatch.setattr(subprocess, "Popen", launches.popen)
    monkeypatch.setattr(subprocess, "run", launches.run)
    LAUNCHES[launch](tmp_path)
    assert launches.envs and all(env is not None for env in launches.envs), \
        "started with the caller's whole environment"
    for env in launches.envs:
        assert_clean(env)
