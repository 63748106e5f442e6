"""The peer of benchmarks/fleet_sim.py: NVIDIA Dynamo's mocker engines behind its frontend and
router (the `ai-dynamo` package), on the same trace through the same client.

Dynamo's mocker simulates an engine as kvfleet's simulated worker does (a KV block manager with
a prefix cache, a scheduler, a timing model; no weights), and its frontend's `--router-mode kv`
routes by the blocks the mockers announce (its KV router; `random` is its cache-blind baseline).
Started here: one `python -m dynamo.frontend` and one `python -m dynamo.mocker --num-workers N`,
discovery through files (`--discovery-backend file`, in a temporary directory), requests over
TCP, KV events over ZMQ: no etcd or NATS. The mockers get kvfleet's simulated KV pool (the same
tokens per worker, in blocks of BLOCK_SIZE; the frontend hashes blocks of the same size) and the
time scale as `--speedup-ratio 1/K`.

What differs, and is said beside its rows: the mocker's timing is its own default model
("hardcoded polynomials", not a roofline of an H100 pair for Qwen3-32B; Dynamo's accelerator-
and model-specific timings come from the `aisimulate` package, which is on NVIDIA's own index
only); it counts no late steps (no lag verdict); the load per worker is not read.

Installing it (in a virtualenv of its own, never the repository's):

    python3.11 -m venv DIR && DIR/bin/pip install --no-deps ai-dynamo==1.6.1 && \\
      DIR/bin/pip install ai-dynamo-runtime==1.6.1 uvloop 'aiohttp>=3.14.3,<4' msgspec \\
        prometheus-client pyzmq 'redis>=6.2,<9' tqdm 'transformers>=4.56' typing-extensions \\
        'zstandard>=0.23,<1' 'kubernetes>=32.0.1,<33' certifi

`--no-deps` because ai-dynamo requires `aisimulate==0.13.0`, whose PyPI release is a stub that
downloads the real wheel from pypi.nvidia.com while installing; the mocker without
`--ais-perf-model` does not import it.
"""

from __future__ import annotations

import subprocess
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks.http_peers import free_port, stop_session
from benchmarks.peer_env import peer_env

BLOCK_SIZE = 16  # kvfleet's default block size; the frontend's --kv-cache-block-size
SERVED_NAME = "qwen3-32b-mocker"
ROUTER_MODES = {"dynamo-kv": "kv", "dynamo-random": "random"}


def dynamo_python(venv: str | None) -> tuple[Path | None, str]:
    """The virtualenv's python if it imports the mocker and the frontend's router, and why not
    otherwise."""
    if not venv:
        return None, "no --dynamo-venv given"
    python = Path(venv) / "bin" / "python"
    if not python.exists():
        return None, f"no virtualenv python at {python}"
    probe = subprocess.run([str(python), "-c", "import dynamo.mocker, dynamo.frontend, "
                            "dynamo.llm; from importlib.metadata import version; "
                            "print(version('ai-dynamo'))"],
                           capture_output=True, text=True, env=peer_env(), timeout=300)
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["no output"])[-1]
        return None, f"{python} cannot import dynamo.mocker / dynamo.frontend ({last})"
    return python, f"ai-dynamo {probe.stdout.strip()}"


class DynamoFleet:
    """Dynamo's frontend (router mode `kv` or `random`) in front of `workers` mockers."""

    def __init__(self, python: Path, config: str, model_path: str, workers: int,
                 time_scale: float, kv_tokens: int, log_dir: Path):
        self.routing, self.workers = config, workers
        self.port = free_port()
        store = Path(tempfile.mkdtemp(prefix=f"{config}-", dir=log_dir))
        env = peer_env({"DYN_FILE_KV": str(store / "kv"), "TMPDIR": str(store),
                        "DYN_LOG": "warn"})
        common = ["--discovery-backend", "file", "--request-plane", "tcp",
                  "--event-plane", "zmq"]
        frontend = [str(python), "-m", "dynamo.frontend", "--http-host", "127.0.0.1",
                    "--http-port", str(self.port), "--router-mode", ROUTER_MODES[config],
                    "--kv-cache-block-size", str(BLOCK_SIZE), *common]
        mocker = [str(python), "-m", "dynamo.mocker", "--model-path", model_path,
                  "--model-name", SERVED_NAME, "--num-workers", str(workers),
                  "--block-size", str(BLOCK_SIZE),
                  "--num-gpu-blocks-override", str(max(kv_tokens // BLOCK_SIZE, 1)),
                  "--speedup-ratio", f"{1.0 / time_scale:g}", *common]
        self.logs = [open(log_dir / f"{config}-{name}.log", "w") for name in ("frontend",
                                                                              "mocker")]
        self.processes = [subprocess.Popen(command, env=env, stdout=log,
                                           stderr=subprocess.STDOUT, start_new_session=True)
                          for command, log in zip((frontend, mocker), self.logs)]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout_s: float) -> None:
        """Until a one-token completion comes back through the router."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if any(p.poll() is not None for p in self.processes):
                raise RuntimeError(f"{self.routing}: a Dynamo process exited (see its log)")
            try:
                reply = httpx.post(f"{self.url}/v1/completions", timeout=30, json={
                    "model": SERVED_NAME, "prompt": [1000, 1001], "max_tokens": 1})
                if reply.status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        raise TimeoutError(f"{self.routing}: no answer within {timeout_s:g} s")

    def stop(self) -> None:
        for process in reversed(self.processes):
            stop_session(process)
        for log in self.logs:
            log.close()
