"""`kvfleet up`: Redis (embedded when none is configured), one gateway, N workers of each model
(`--worker-models`, else `--model`) and one batch worker (rq, for /v1/batches) in one process tree;
Ctrl-C stops them all and removes the embedded Redis."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time

from shared.models import resolve_model_path
from shared.redis_server import EmbeddedRedis
from shared.settings import UpSettings, WorkerSettings

log = logging.getLogger("kvfleet.up")

# OpenMP's wait for the workers' torch threads (libgomp, torch's runtime): sleep when idle, but
# spin for ~0.1 ms first (libgomp counts ~100,000 spins a millisecond), so that the next parallel
# region of the same step finds them awake (docs/BENCHMARKS.md has the measurements).
WORKER_OPENMP_ENV = {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "10000"}


class LocalFleet:
    """Child processes of one local fleet; workers that die are restarted."""

    def __init__(self, num_workers: int, env: dict[str, str], models: list[str] | None = None):
        # worker slot -> the model it serves ("": the fleet's --model, as the child reads it)
        self.worker_models = [m for m in (models or [""]) for _ in range(num_workers)]
        self.num_workers = len(self.worker_models)
        self.env = env
        self.gateway: subprocess.Popen | None = None
        self.batch: subprocess.Popen | None = None
        self.workers: list[subprocess.Popen | None] = [None] * self.num_workers

    def _spawn(self, role: str, extra_env: dict[str, str]) -> subprocess.Popen:
        env = {**os.environ, **self.env, **extra_env}
        return subprocess.Popen([sys.executable, "-m", "kvfleet", role], env=env)

    def start_worker(self, index: int) -> None:
        threads = max(1, (os.cpu_count() or 1) // self.num_workers)
        extra = {"KVFLEET_WORKER_ID": f"{os.uname().nodename}-w{index}-{os.getpid()}"}
        if self.worker_models[index]:
            extra["KVFLEET_MODEL"] = self.worker_models[index]
        if not self._threads_given():
            extra["KVFLEET_NUM_THREADS"] = str(threads)
        # The workers share the host's cores with the gateway, Redis and each other: OpenMP
        # threads that spin while waiting starve them (libgomp's default spin is milliseconds
        # long; docs/BENCHMARKS.md). PASSIVE alone puts the threads to sleep after every parallel
        # region, and a decode step runs its regions back to back: waking the threads each time
        # slows the step's matrix products.
        # A short spin (WORKER_OPENMP_ENV) covers the gaps inside a step and sleeps between
        # steps. A policy or spin count the user set is kept.
        if not any(name in self.env or name in os.environ for name in WORKER_OPENMP_ENV):
            extra.update(WORKER_OPENMP_ENV)
        self.workers[index] = self._spawn("worker", extra)

    def _threads_given(self) -> bool:
        """The user set num_threads (a flag to `up`, or the variable): its workers keep it."""
        given = WorkerSettings().model_fields_set
        return "KVFLEET_NUM_THREADS" in self.env or "num_threads" in given

    def start(self) -> None:
        self.gateway = self._spawn("gateway", {})
        for index in range(self.num_workers):
            self.start_worker(index)
        self.batch = self._spawn("batch-worker", {})

    def supervise(self, stop: threading.Event) -> int:
        """Wait for Ctrl-C; restart dead workers; a dead gateway ends the fleet."""
        while not stop.wait(0.5):
            if self.gateway.poll() is not None:
                log.error("gateway exited with code %s; stopping the fleet", self.gateway.returncode)
                return 1
            for index, proc in enumerate(self.workers):
                if proc is not None and proc.poll() is not None:
                    log.warning("worker %d exited with code %s; restarting it", index,
                                proc.returncode)
                    time.sleep(1.0)
                    self.start_worker(index)
            if self.batch.poll() is not None:
                log.warning("batch worker exited with code %s; restarting it", self.batch.returncode)
                self.batch = self._spawn("batch-worker", {})
        return 0

    def stop(self, timeout_s: float = 15.0) -> None:
        procs = [p for p in [self.gateway, self.batch, *self.workers]
                 if p is not None and p.poll() is None]
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for proc in procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("%s (pid %d) did not stop within %.0f s: killed",
                            " ".join(str(a) for a in proc.args[-2:]), proc.pid, timeout_s)
                proc.kill()
                proc.wait()


def worker_models(settings: UpSettings) -> list[str]:
    """The models `up` starts workers of: --worker-models, else --model."""
    named = [m.strip() for m in settings.worker_models.split(",") if m.strip()]
    return list(dict.fromkeys(named)) or [settings.model]


def run_fleet(num_workers: int, env: dict[str, str]) -> int:
    if num_workers < 1:
        raise SystemExit("kvfleet up: --workers must be at least 1")
    os.environ.update(env)  # flags given to `up` reach every child as KVFLEET_* variables
    settings = UpSettings()
    models = worker_models(settings)
    if settings.lora_modules and "enable_lora" not in WorkerSettings().model_fields_set:
        env = {**env, "KVFLEET_ENABLE_LORA": "true"}  # the workers serve the adapters named
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    redis_server = None
    if not settings.redis_url:
        redis_server = EmbeddedRedis(port=settings.embedded_redis_port or None).start()
        os.environ["KVFLEET_REDIS_URL"] = redis_server.url
        log.info("started an embedded Redis at %s (removed on exit)", redis_server.url)
    # Convert the default model once here, so gateway and workers don't race to do it.
    for model in dict.fromkeys([settings.model, *models]):
        resolve_model_path(model, settings.cache_dir)
    fleet = LocalFleet(num_workers, env, models)
    try:
        host = "127.0.0.1" if settings.host in ("0.0.0.0", "::") else settings.host
        gateway_url = f"http://{host}:{settings.port}"
        os.environ.setdefault("KVFLEET_GATEWAY_URL", gateway_url)  # where batch jobs send lines
        fleet.start()
        log.info("fleet up: gateway on http://%s:%d, %d worker(s) of each of %s; Ctrl-C stops "
                 "it", settings.host, settings.port, num_workers, ", ".join(models))
        return fleet.supervise(stop)
    finally:
        fleet.stop()
        if redis_server is not None:
            redis_server.stop()
        log.info("fleet stopped")
