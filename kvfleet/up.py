"""`kvfleet up`: Redis (embedded when none is configured), one gateway, N workers of each model
(`--worker-models`, else `--model`; `--prefill-workers` and `--decode-workers` add workers of those
roles) and one batch worker (rq, for /v1/batches) in one process tree. A worker that dies is
restarted, one that drained (`kvfleet drain`: exit code 0) is not: that scales the fleet in.
Ctrl-C stops them all and removes the embedded Redis."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time

from kvfleet.shared.models import resolve_model_path
from kvfleet.shared.redis_server import EmbeddedRedis
from kvfleet.shared.settings import UpSettings, WorkerSettings
from kvfleet.worker.sim.checks import WORKERS_PER_PROCESS as SIM_WORKERS_PER_PROCESS, check_sim_settings

log = logging.getLogger("kvfleet.up")

# OpenMP's wait for the workers' torch threads (libgomp, torch's runtime): sleep when idle, but
# spin for ~0.1 ms first (libgomp counts ~100,000 spins a millisecond), so that the next parallel
# region of the same step finds them awake (docs/BENCHMARKS.md has the measurements).
WORKER_OPENMP_ENV = {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "10000"}
SIM_OFF = {"KVFLEET_SIM_WORKERS": "0", "KVFLEET_SIM_DEVICE": "", "KVFLEET_SIM_STEP_COST": ""}


class LocalFleet:
    """Child processes of one local fleet; workers that die are restarted, workers that drained
    are not."""

    def __init__(self, num_workers: int, env: dict[str, str], models: list[str] | None = None,
                 *, prefill_workers: int = 0, decode_workers: int = 0, named_model: str = "",
                 sim_workers: int = 0):
        roles = [""] * num_workers + ["prefill"] * prefill_workers + ["decode"] * decode_workers
        # worker slot -> the model it serves and its role ("": the fleet's --model, --role, as
        # the child reads them)
        slots = [(model, role) for model in (models or [""]) for role in roles]
        self.worker_models = [model for model, _ in slots]
        self.worker_roles = [role for _, role in slots]
        # then the processes of simulated workers (worker/sim/host.py), of --model: how many each
        self.sim_counts = [0] * len(slots) + sim_process_counts(sim_workers)
        self.worker_models += [""] * (len(self.sim_counts) - len(slots))
        self.worker_roles += [""] * (len(self.sim_counts) - len(slots))
        self.num_workers = len(self.sim_counts)
        self.named_model = named_model  # the model --served-model-name names (--model)
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
        # a real worker is no simulation; a simulation process runs its share of --sim-workers
        extra.update(SIM_OFF if not self.sim_counts[index] else
                     {"KVFLEET_SIM_WORKERS": str(self.sim_counts[index])})
        if self.worker_models[index]:
            extra["KVFLEET_MODEL"] = self.worker_models[index]
            if self.worker_models[index] != self.named_model:
                # --served-model-name names --model: another model's workers serve their own id
                extra["KVFLEET_SERVED_MODEL_NAME"] = ""
        if self.worker_roles[index]:
            extra["KVFLEET_ROLE"] = self.worker_roles[index]
        # Each worker's KV transfer plane listens on a free port of its own (KVFLEET_HANDOFF_PORT
        # left at 0); its peers are on this host.
        if not self._given("KVFLEET_HANDOFF_ADVERTISE_HOST", "handoff_advertise_host"):
            extra["KVFLEET_HANDOFF_ADVERTISE_HOST"] = "127.0.0.1"
        if not self._given("KVFLEET_NUM_THREADS", "num_threads"):
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

    def _given(self, variable: str, setting: str) -> bool:
        """The user set a worker setting (a flag to `up`, or the variable): its workers keep it."""
        return variable in self.env or setting in WorkerSettings().model_fields_set

    def start(self) -> None:
        self.gateway = self._spawn("gateway", {})
        for index in range(self.num_workers):
            self.start_worker(index)
        self.batch = self._spawn("batch-worker", {})

    def supervise(self, stop: threading.Event) -> int:
        """Wait for Ctrl-C; restart dead workers (not drained ones); a dead gateway ends the
        fleet."""
        while not stop.wait(0.5):
            if self.gateway.poll() is not None:
                log.error("gateway exited with code %s; stopping the fleet", self.gateway.returncode)
                return 1
            for index, proc in enumerate(self.workers):
                if proc is None or proc.poll() is None:
                    continue
                if proc.returncode == 0:  # it drained (`kvfleet drain`): the fleet scales in
                    self.workers[index] = None
                    log.info("worker %d drained and exited; not restarted (%d workers left)",
                             index, sum(p is not None for p in self.workers))
                    continue
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
            # Workers stop at once (SIGINT): a drain (SIGTERM) would wait for peers that stop
            # too. Their requests resume from checkpoints when a fleet serves again.
            proc.send_signal(signal.SIGINT if proc in self.workers else signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for proc in procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("%s (pid %d) did not stop within %.0f s: killed",
                            " ".join(str(a) for a in proc.args[-2:]), proc.pid, timeout_s)
                proc.kill()
                proc.wait()


def sim_process_counts(sim_workers: int) -> list[int]:
    """Simulated workers per process: at most WORKERS_PER_PROCESS each, spread evenly."""
    if sim_workers <= 0:
        return []
    processes = -(-sim_workers // SIM_WORKERS_PER_PROCESS)
    return [sim_workers // processes + (i < sim_workers % processes) for i in range(processes)]


def worker_models(settings: UpSettings) -> list[str]:
    """The models `up` starts workers of: --worker-models, else --model."""
    named = [m.strip() for m in settings.worker_models.split(",") if m.strip()]
    return list(dict.fromkeys(named)) or [settings.model]


def fleet_workers(num_workers: int | None, settings: UpSettings) -> int:
    """The --workers count (not given: 1, or 0 beside prefill, decode or simulated workers),
    checked with the prefill and decode workers: SystemExit naming the flag when the fleet could
    not serve."""
    worker = WorkerSettings()  # the --workers ones' role and every worker's handoff port
    check_sim_settings(worker)
    if (worker.sim_device or worker.sim_step_cost) and not worker.sim_workers:
        raise SystemExit("kvfleet up: --sim-device / --sim-step-cost model simulated workers: "
                         "give --sim-workers N")
    extra = settings.prefill_workers + settings.decode_workers
    if num_workers is None:
        num_workers = 0 if extra or worker.sim_workers else 1
    if num_workers < 0 or num_workers + extra + worker.sim_workers < 1:
        raise SystemExit("kvfleet up: --workers must be at least 1 (or give --prefill-workers "
                         "and --decode-workers, or --sim-workers)")
    prefill = settings.prefill_workers + (num_workers if worker.role == "prefill" else 0)
    decode = settings.decode_workers + (num_workers if worker.role == "decode" else 0)
    if prefill and not decode:
        raise SystemExit("kvfleet up: prefill workers need --decode-workers: each hands its "
                         "streams to a decode worker after their first token; without one it "
                         "would decode them all itself")
    if decode and decode == num_workers + extra:
        raise SystemExit("kvfleet up: decode workers take no new requests: give "
                         "--prefill-workers (or --workers) too")
    if worker.handoff_port > 0 and num_workers + extra > 1:
        raise SystemExit("kvfleet up: its workers share this host: --handoff-port must be 0 (a "
                         "free port each) or -1 (off)")
    return num_workers


def run_fleet(num_workers: int | None, env: dict[str, str]) -> int:
    os.environ.update(env)  # flags given to `up` reach every child as KVFLEET_* variables
    settings = UpSettings()
    num_workers = fleet_workers(num_workers, settings)
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
    # Convert the default model once here, so gateway and workers don't race to do it (with
    # weights only where real workers load them).
    real = num_workers + settings.prefill_workers + settings.decode_workers > 0
    for model in dict.fromkeys([settings.model, *models]):
        resolve_model_path(model, settings.cache_dir, weights=real and model in models)
    sim_workers = WorkerSettings().sim_workers
    fleet = LocalFleet(num_workers if real else 0, env, models,
                       prefill_workers=settings.prefill_workers,
                       decode_workers=settings.decode_workers, named_model=settings.model,
                       sim_workers=sim_workers)
    try:
        host = "127.0.0.1" if settings.host in ("0.0.0.0", "::") else settings.host
        gateway_url = f"http://{host}:{settings.port}"
        os.environ.setdefault("KVFLEET_GATEWAY_URL", gateway_url)  # where batch jobs send lines
        fleet.start()
        split = (f" + {settings.prefill_workers} prefill + {settings.decode_workers} decode"
                 if settings.prefill_workers or settings.decode_workers else "")
        split += (f" + {sim_workers} simulated in {len(sim_process_counts(sim_workers))} "
                  "process(es)" if sim_workers else "")
        log.info("fleet up: gateway on http://%s:%d, %d worker(s)%s of each of %s; Ctrl-C stops "
                 "it", settings.host, settings.port, num_workers, split, ", ".join(models))
        return fleet.supervise(stop)
    finally:
        fleet.stop()
        if redis_server is not None:
            redis_server.stop()
        log.info("fleet stopped")
