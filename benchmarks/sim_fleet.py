"""A simulated fleet's processes for the benchmarks of issue 51 (sim_scale, sim_mixed, sim_roles,
sim_pace): an embedded Redis, `kvfleet` commands started on it (each logging to a file), waited
for until every simulated worker heartbeats and every gateway answers, and stopped with Ctrl-C's
signal; the workers' heartbeats and their played and lagged steps."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import redis

from kvfleet.shared.redis_server import EmbeddedRedis, free_port
from kvfleet.shared.wire import Heartbeat, Keys
from kvfleet.worker.sim.clock import INVALID_LAG_SHARE


@dataclass(frozen=True)
class StepCounts:
    """The fleet's played and lagged steps (summed over its heartbeats)."""

    workers: int
    steps: int
    lagged: int

    def since(self, before: StepCounts) -> StepCounts:
        return StepCounts(self.workers, self.steps - before.steps, self.lagged - before.lagged)

    @property
    def share(self) -> float:
        return self.lagged / self.steps if self.steps else 0.0

    @property
    def valid(self) -> bool:
        return self.steps > 0 and self.share <= INVALID_LAG_SHARE


def step_counts(beats: list[Heartbeat]) -> StepCounts:
    simulated = [b for b in beats if b.simulated]
    return StepCounts(len(simulated), sum(b.sim_steps for b in simulated),
                      sum(b.sim_lagged_steps for b in simulated))


def read_beats(client: redis.Redis, keys: Keys) -> list[Heartbeat]:
    return [Heartbeat.decode(client.hgetall(k)) for k in client.scan_iter(keys.worker("*"))]


def healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def kvfleet(*args: str) -> list[str]:
    """A `kvfleet` command line in this interpreter."""
    return [sys.executable, "-m", "kvfleet", *args]



def stop_fleets_on_sigterm() -> None:
    """SIGTERM (a `timeout`, a CI job's cancel) ends a benchmark as Ctrl-C does, so that its
    `finally` blocks and context managers stop the fleets it started rather than leave their
    processes running (Python's default for SIGTERM runs none of them)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))


class SimFleet:
    """`commands` (named, in order) on a fresh embedded Redis; `env` added to this process's."""

    def __init__(self, commands: dict[str, list[str]], env: dict[str, str], log_dir: Path,
                 prefix: str = "kvf:"):
        self.redis_server = EmbeddedRedis(port=free_port()).start()
        self.keys = Keys(prefix)
        self.log_dir = log_dir
        env = {**os.environ, "KVFLEET_REDIS_URL": self.redis_server.url,
               "KVFLEET_KEY_PREFIX": prefix, **env}
        self.logs = [open(log_dir / f"{name}.log", "w") for name in commands]
        self.procs = [subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
                      for cmd, log in zip(commands.values(), self.logs)]
        self.client = redis.Redis.from_url(self.redis_server.url)

    def __enter__(self) -> SimFleet:
        stop_fleets_on_sigterm()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def beats(self) -> list[Heartbeat]:
        return read_beats(self.client, self.keys)

    def wait_ready(self, workers: int, urls: list[str], timeout_s: float = 600) -> None:
        deadline = time.monotonic() + timeout_s
        while step_counts(self.beats()).workers < workers or not all(healthy(u) for u in urls):
            if time.monotonic() > deadline or any(p.poll() is not None for p in self.procs):
                raise SystemExit(f"the fleet did not come up: see {self.log_dir}")
            time.sleep(1.0)

    def stop(self) -> None:
        for proc in self.procs:
            proc.send_signal(2)
        for proc in self.procs:
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
        for log in self.logs:
            log.close()
        self.redis_server.stop()
