"""Real gateway and worker processes on one Redis, for end-to-end tests and benchmarks (a test
helper: `kvfleet up`'s own supervisor is kvfleet/up.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx

from kvfleet.shared.redis_server import free_port
from kvfleet.shared.wire import Keys
from tests.helpers import forkserver
from tests.helpers.forkserver import ForkServer


class Proc:
    """A `python -m kvfleet ...` process whose output goes to a log file we can show on failure:
    a child of ours, or forked by `fork_server` (tests/helpers/forkserver.py) with the same
    arguments, environment and log."""

    def __init__(self, args: list[str], env: dict[str, str], log_dir: Path, name: str,
                 fork_server: ForkServer | None = None):
        self.log_path = log_dir / f"{name}-{uuid.uuid4().hex[:6]}.log"
        self._log = None
        if fork_server is not None:
            self.popen = fork_server.spawn("kvfleet", args, {**os.environ, **env}, self.log_path)
            return
        self._log = open(self.log_path, "wb")
        self.popen = subprocess.Popen([sys.executable, "-m", "kvfleet", *args],
                                      env={**os.environ, **env}, stdout=self._log,
                                      stderr=subprocess.STDOUT, start_new_session=True)

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(sig)
        self.wait_exit()

    def stop(self) -> None:
        self.kill(signal.SIGTERM)

    def wait_exit(self, timeout_s: float = 15) -> None:
        """Until the process has exited (SIGKILLed after `timeout_s`); then close its log."""
        try:
            self.popen.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait()
        if self._log is not None:
            self._log.close()


class ProcessFleet:
    """Gateway and workers on one Redis (or one Redis Cluster), under a key prefix of their own;
    `queue_shards` stream shards per model (KVFLEET_QUEUE_SHARDS). Its processes are forked
    from the `gateway` and `worker` fork servers where the tests installed them
    (tests/conftest.py), else fresh interpreters."""

    def __init__(self, redis_url: str, log_dir: Path, worker_flags: list[str] | None = None,
                 queue_shards: int = 1, gateway_flags: list[str] | None = None):
        self.redis_url = redis_url
        self.queue_shards = queue_shards
        self.prefix = f"e2e-{uuid.uuid4().hex[:8]}:"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_dir = log_dir
        # float32 unless a test says otherwise: outputs are compared with HF generate in float32
        # and across resumes, and --dtype auto is bf16 on CPUs with native bf16
        flags = worker_flags or ["--kv-memory", "256MiB", "--num-threads", "1"]
        self.worker_flags = flags if "--dtype" in flags else ["--dtype", "float32", *flags]
        self.gateway_flags = gateway_flags or []
        self.gateway: Proc | None = None
        self.workers: dict[str, Proc] = {}  # by worker id

    @property
    def env(self) -> dict[str, str]:
        return {"KVFLEET_REDIS_URL": self.redis_url, "KVFLEET_KEY_PREFIX": self.prefix,
                "KVFLEET_QUEUE_SHARDS": str(self.queue_shards)}

    @property
    def keys(self) -> Keys:
        return Keys(self.prefix, queue_shards=self.queue_shards)

    def start(self, *worker_ids: str, timeout_s: float = 180) -> list[Proc]:
        """The gateway and the named workers, all starting at once (each spends seconds on its
        imports and a worker more on its model): returns the workers once every one is ready."""
        forkserver.start("gateway", "worker")  # where they are not running yet: side by side
        self.start_gateway(wait=False)
        workers = [self.start_worker(worker_id, wait=False) for worker_id in worker_ids]
        self.wait_gateway(timeout_s)
        for worker_id in worker_ids:
            self.wait_worker(worker_id, timeout_s)
        return workers

    def start_gateway(self, timeout_s: float = 120, wait: bool = True) -> Proc:
        self.gateway = Proc(["gateway", "--port", str(self.port), *self.gateway_flags], self.env,
                            self.log_dir, "gateway", forkserver.server("gateway"))
        if wait:
            self.wait_gateway(timeout_s)
        return self.gateway

    def wait_gateway(self, timeout_s: float = 120) -> None:
        self._wait(lambda: httpx.get(f"{self.url}/health", timeout=1).status_code == 200,
                   timeout_s, self.gateway)

    def start_worker(self, worker_id: str | None = None, wait: bool = True,
                     timeout_s: float = 180, env: dict[str, str] | None = None) -> Proc:
        """A worker with the fleet's flags; `env`: variables of its own beside the fleet's."""
        worker_id = worker_id or f"w{len(self.workers)}"
        proc = Proc(["worker", "--worker-id", worker_id, *self.worker_flags],
                    {**self.env, **(env or {})}, self.log_dir, worker_id,
                    forkserver.server("worker"))
        self.workers[worker_id] = proc
        if wait:
            self.wait_worker(worker_id, timeout_s)
        return proc

    def wait_worker(self, worker_id: str, timeout_s: float = 180) -> None:
        """Until the worker's heartbeat key exists: it has loaded its model and reads the queue."""
        from kvfleet.shared.redis_connect import connect

        client = connect(self.redis_url)
        try:
            self._wait(lambda: client.exists(self.keys.worker(worker_id)) == 1, timeout_s,
                       self.workers[worker_id])
        finally:
            client.close()

    def _wait(self, ready, timeout_s: float, proc: Proc) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if proc.popen.poll() is not None:
                raise RuntimeError(f"process exited early:\n{proc.log_text()[-4000:]}")
            try:
                if ready():
                    return
            except (httpx.HTTPError, OSError):
                pass
            time.sleep(0.05)
        raise RuntimeError(f"not ready after {timeout_s} s:\n{proc.log_text()[-4000:]}")

    def stop(self, sig: int = signal.SIGTERM) -> None:
        procs = [proc for proc in [*self.workers.values(), self.gateway] if proc is not None]
        for proc in procs:  # all at once: a clean shutdown takes each a second or more
            if proc.popen.poll() is None:
                proc.popen.send_signal(sig)
        for proc in procs:
            proc.wait_exit()

    def kill(self) -> None:
        """SIGKILL every process: the end of a test that asserts nothing of how they exit (a
        worker's clean exit spends over a second in the interpreter's last garbage collection)."""
        self.stop(signal.SIGKILL)
