"""The servers benchmarks/fleet_affinity.py measures: `kvfleet up` fleets (each with its own
embedded Redis, on free ports), SGLang's router in front of several of them, which worker served
a request (read from the fleet's Redis), and SIGKILLing one worker of a running fleet."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import redis
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.http_peers import free_port, stop_session, wait_first_answer
from benchmarks.peer_env import peer_env
from benchmarks.vllm_peer import REPO
from kvfleet.shared.wire import Keys, RequestRecord

SGLANG_ROUTER_HINT = ("make it with `bash benchmarks/sglang_router_env.sh` (or point "
                      "KVFLEET_SGLANG_ROUTER_VENV at one)")
KEY_PREFIX = "kvf:"  # `kvfleet up`'s default key prefix (CommonSettings.key_prefix)
# a worker's admissions by the stream taken from (docs/OPERATIONS.md): own, shared, other
TAKEN_METRIC = "kvfleet_worker_requests_taken"
PEER_FETCH_METRIC = "kvfleet_worker_kv_peer_fetches"


class KvfleetServer:
    """`kvfleet up --workers N --routing R` in a session of its own (stopping it reaches its
    children), its embedded Redis on a port chosen here so that the benchmark can read it."""

    def __init__(self, workers: int, routing: str, dtype: str, log_path: Path,
                 num_threads: int | None = None, extra_args: tuple[str, ...] = ()):
        """`num_threads`: torch threads of each worker; None: `kvfleet up`'s cores / workers.
        `extra_args`: more flags of `kvfleet up`."""
        self.workers = workers
        self.port, self.redis_port = free_port(), free_port()
        command = [sys.executable, "-m", "kvfleet", "up", "--port", str(self.port),
                   "--workers", str(workers), "--routing", routing, "--dtype", dtype,
                   *extra_args]
        # the trace must be served whole, as SGLang's router serves it: the gateway's
        # expected-wait admission limit (429 beyond 60 s by default) is off
        env = peer_env({"KVFLEET_EMBEDDED_REDIS_PORT": str(self.redis_port),
                        "KVFLEET_MAX_QUEUE_WAIT_S": "0"})
        if num_threads is not None:
            env["KVFLEET_NUM_THREADS"] = str(num_threads)
        self.started = time.perf_counter()
        self.process = subprocess.Popen(command, cwd=REPO, env=env, stdout=open(log_path, "w"),
                                        stderr=subprocess.STDOUT, start_new_session=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def redis_url(self) -> str:
        return f"redis://127.0.0.1:{self.redis_port}/0"

    def worker_ids(self) -> list[str]:
        """The live workers, by their heartbeats (the gateway's /dashboard/data)."""
        reply = httpx.get(f"{self.url}/dashboard/data", timeout=10)
        reply.raise_for_status()
        return sorted(w["id"] for w in reply.json()["workers"])

    def wait_ready(self, model: str, timeout_s: float) -> None:
        """Until the gateway answers and every worker heartbeats, then one completion per
        worker at once, so that no worker meets its first request during the trace."""
        wait_first_answer(self.url, model, self.process, timeout_s)
        deadline = time.monotonic() + timeout_s
        while len(self.worker_ids()) < self.workers:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.url}: fewer than {self.workers} workers heartbeat")
            time.sleep(0.5)
        with httpx.Client(base_url=self.url, timeout=120) as client:
            warm_up = [{"model": model, "prompt": f"Warm-up {i}.", "max_tokens": 4,
                        "temperature": 0.0} for i in range(self.workers)]
            with ThreadPoolExecutor(self.workers) as pool:
                list(pool.map(lambda body: client.post("/v1/completions", json=body), warm_up))

    def owners(self, response_ids: list[str]) -> dict[str, str]:
        """The worker that finished each request (after a takeover, the one that resumed it),
        from the request hashes in the fleet's Redis; ids not found there are left out."""
        keys = Keys(KEY_PREFIX)
        client = redis.Redis.from_url(self.redis_url)
        try:
            pipe = client.pipeline(transaction=False)
            for response_id in response_ids:
                pipe.hget(keys.request(response_id), RequestRecord.WORKER)
            found = pipe.execute()
        finally:
            client.close()
        return {rid: worker.decode() for rid, worker in zip(response_ids, found) if worker}

    def requests_taken(self) -> dict[str, int]:
        """Requests the live workers admitted, by the stream they took them from (own, shared,
        other), summed over the workers' /metrics; {} where workers have no such metric. A
        worker restarted after a kill counts from its restart."""
        return self._summed(TAKEN_METRIC, "source")

    def peer_fetches(self) -> dict[str, int]:
        """Admitted requests whose prompt opening a peer held, by what came of it (fetched,
        joined, slower, failed, late, incompatible), summed over the live workers' /metrics."""
        return {k: v for k, v in self._summed(PEER_FETCH_METRIC, "outcome").items() if v}

    def _summed(self, metric: str, label: str) -> dict[str, int]:
        rows = httpx.get(f"{self.url}/dashboard/data", timeout=10).json()["workers"]
        counts: dict[str, int] = {}
        for url in (row["metrics_url"] for row in rows if row["metrics_url"]):
            text = httpx.get(url, timeout=10).text
            for value, count in counts_by_label(text, metric, label).items():
                counts[value] = counts.get(value, 0) + count
        return counts

    def kill_busiest_worker(self) -> str:
        """SIGKILL the worker process running the most streams now (its supervisor, `kvfleet
        up`, restarts it); returns what was killed."""
        rows = httpx.get(f"{self.url}/dashboard/data", timeout=10).json()["workers"]
        if not rows:
            raise RuntimeError(f"{self.url}: no live worker to kill")
        victim = max(rows, key=lambda w: (w["running"] + w["waiting"], w["id"]))["id"]
        pids = worker_pids(self.process.pid)
        if victim not in pids:
            raise RuntimeError(f"no child process of pid {self.process.pid} is worker {victim}")
        os.kill(pids[victim], signal.SIGKILL)
        return f"worker {victim} (pid {pids[victim]})"

    def stop(self) -> None:
        stop_session(self.process)


def taken_by_source(metrics_text: str) -> dict[str, int]:
    """`kvfleet_worker_requests_taken_total` by its `source` label, from one worker's /metrics."""
    return counts_by_label(metrics_text, TAKEN_METRIC, "source")


def counts_by_label(metrics_text: str, metric: str, label: str) -> dict[str, int]:
    """Counter `metric` (its name without `_total`) summed by one label, from one /metrics."""
    counts: dict[str, int] = {}
    for family in text_string_to_metric_families(metrics_text):
        if family.name != metric:
            continue
        for sample in family.samples:
            if sample.name == metric + "_total":
                value = sample.labels.get(label, "")
                counts[value] = counts.get(value, 0) + int(sample.value)
    return counts


def worker_pids(parent_pid: int) -> dict[str, int]:
    """The worker processes among `parent_pid`'s children, by worker id: `kvfleet up` names each
    worker in its environment (KVFLEET_WORKER_ID); /proc is read because it keeps no pid list."""
    pids = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            if ppid != parent_pid:
                continue
            environ = (entry / "environ").read_bytes().split(b"\0")
        except (OSError, ValueError, IndexError):
            continue  # exited meanwhile, or not ours to read
        for variable in environ:
            if variable.startswith(b"KVFLEET_WORKER_ID="):
                pids[variable.split(b"=", 1)[1].decode()] = int(entry.name)
    return pids


def sglang_router_python(venv: str | None = None) -> Path | None:
    """The router's virtualenv python (benchmarks/sglang_router_env.sh), None when absent."""
    root = venv or os.environ.get("KVFLEET_SGLANG_ROUTER_VENV",
                                  str(Path.home() / ".cache" / "kvfleet" / "sglang-router-venv"))
    python = Path(root) / "bin" / "python"
    if not python.exists():
        return None
    probe = subprocess.run([str(python), "-c", "import sglang_router"], capture_output=True,
                           env=peer_env())
    return python if probe.returncode == 0 else None


def sglang_router_version(python: Path) -> str:
    return subprocess.run(
        [str(python), "-c", "from importlib.metadata import version; "
                            "print(version('sglang-router'))"],
        capture_output=True, text=True, check=True, env=peer_env()).stdout.strip()


class SglangRouter:
    """`sglang_router.launch_router` with one policy in front of the given servers."""

    def __init__(self, python: Path, worker_urls: list[str], policy: str, log_path: Path):
        self.port = free_port()
        command = [str(python), "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
                   "--port", str(self.port), "--policy", policy,
                   "--worker-urls", *worker_urls]
        self.num_workers = len(worker_urls)
        self.process = subprocess.Popen(command, cwd=REPO, env=peer_env(),
                                        stdout=open(log_path, "w"), stderr=subprocess.STDOUT,
                                        start_new_session=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, model: str, timeout_s: float) -> None:
        """Until every server is registered (the router adds them in the background, after it
        already answers) and a completion comes back through it."""
        deadline = time.monotonic() + timeout_s
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"sglang-router exited with code {self.process.returncode}")
            try:
                if httpx.get(f"{self.url}/workers", timeout=5).json()["total"] >= self.num_workers:
                    break
            except (httpx.HTTPError, ValueError, KeyError):
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"sglang-router: fewer than {self.num_workers} workers")
            time.sleep(0.5)
        wait_first_answer(self.url, model, self.process, timeout_s)

    def stop(self) -> None:
        stop_session(self.process)
