"""No false failovers: two worker processes under 2x overload, every engine step longer than the
heartbeat TTL, take nothing over from each other; SIGKILL one and its requests resume on the other
with the text an uninterrupted run gives, each counted as one takeover."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import redis

from kvfleet.shared.redis_server import free_port
from kvfleet.shared.wire import Keys, SamplingParams
from tests.engine.tiny_models import TinyModel, random_prompt
from tests.helpers import forkserver
from tests.integration.slow_worker import MODEL
from tests.integration.test_worker_service import Client

pytestmark = pytest.mark.e2e

# A TTL 10x the heartbeat interval: a busy CI machine may delay the heartbeat thread a little,
# never by 0.5 s; every step is still half again as long as the TTL.
TTL_S = 0.6
HEARTBEAT_S = 0.06
STEP_S = 0.9  # > TTL_S: an entry delivered just before a step would look orphaned after it
MAX_RUNNING = 4  # per worker: 8 streams at once in the fleet
MAX_TOKENS = 4
ROOT = Path(__file__).resolve().parents[2]
SLOW_WORKER = "tests.integration.slow_worker"


class SlowWorker:
    """One `tests.integration.slow_worker` process, its log and its /metrics."""

    def __init__(self, redis_url: str, worker_id: str, log_dir: Path, step_s: float = STEP_S,
                 ttl_s: float = TTL_S, heartbeat_s: float = HEARTBEAT_S,
                 tensor_parallel_size: int = 1):
        self.worker_id = worker_id
        self.metrics_port = free_port()
        self.log_path = log_dir / f"{worker_id}.log"
        args = ["--redis-url", redis_url, "--worker-id", worker_id, "--step-s", str(step_s),
                "--heartbeat-ttl-s", str(ttl_s), "--heartbeat-interval-s", str(heartbeat_s),
                "--max-running", str(MAX_RUNNING), "--metrics-port", str(self.metrics_port),
                "--tensor-parallel-size", str(tensor_parallel_size)]
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        server = forkserver.server("slow_worker")  # tests/conftest.py: its imports done once
        if server is not None:
            self.popen = server.spawn(SLOW_WORKER, args, env, self.log_path, cwd=ROOT)
            return
        with open(self.log_path, "wb") as log:
            self.popen = subprocess.Popen([sys.executable, "-m", SLOW_WORKER, *args], cwd=ROOT,
                                          env=env, stdout=log, stderr=subprocess.STDOUT,
                                          start_new_session=True)

    def takeovers(self) -> float:
        text = httpx.get(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5).text
        return float(re.search(r"^kvfleet_worker_takeovers_total\{.*\} (\S+)$", text, re.M)[1])

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()


def wait_for(condition, timeout_s: float, what: str, workers=()) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            logs = "\n".join(w.log_path.read_text(errors="replace")[-3000:] for w in workers)
            raise AssertionError(f"timed out waiting for {what}\n{logs}")
        time.sleep(0.05)


def send_burst(client: Client, n: int, seed: int) -> dict[str, list[int]]:
    prompts = {}
    for i in range(n):
        prompt = random_prompt(8 + (i * 7) % 24, seed=seed + i)
        req_id = client.send(prompt, SamplingParams(max_tokens=MAX_TOKENS, temperature=0,
                                                    ignore_eos=True))
        prompts[req_id] = prompt
    return prompts


def test_long_steps_under_overload_take_nothing_over_and_a_kill_does(redis_url, tmp_path):
    keys = Keys()
    client = Client(redis.Redis.from_url(redis_url), keys)
    tiny = TinyModel("llama")  # the same seeded weights the workers build
    workers = [SlowWorker(redis_url, name, tmp_path) for name in ("w-a", "w-b")]
    try:
        wait_for(lambda: all(client.redis.exists(keys.worker(w.worker_id)) for w in workers)
                 and all(_metrics_up(w) for w in workers), 120, "both workers", workers)

        # 2x overload: twice the streams the fleet runs at once, queued in one burst.
        first = send_burst(client, 4 * MAX_RUNNING, seed=100)
        wait_for(lambda: all(client.final(r) for r in first), 120, "the burst", workers)
        for req_id, prompt in first.items():
            assert client.text(req_id) == tiny.reference(prompt, MAX_TOKENS)
        attempts = [int(client.redis.hget(keys.request(r), "attempt")) for r in first]
        assert attempts == [1] * len(first), "a live worker's request was taken over"
        assert [w.takeovers() for w in workers] == [0, 0]
        served_by = {client.redis.hget(keys.request(r), "worker") for r in first}
        assert served_by == {b"w-a", b"w-b"}  # both really served under the overload

        # Now a real death: SIGKILL w-a while it streams; w-b resumes its requests.
        victim, survivor = workers
        second = send_burst(client, 4 * MAX_RUNNING, seed=200)

        def victim_mid_stream() -> list[str]:
            return [r for r in second
                    if client.redis.hget(keys.request(r), "worker") == b"w-a"
                    and 0 < client.redis.strlen(keys.checkpoint(r)) // 4 < MAX_TOKENS]

        wait_for(lambda: victim_mid_stream(), 60, "w-a to stream", workers)
        victim.popen.send_signal(signal.SIGKILL)
        victim.popen.wait(timeout=10)
        wait_for(lambda: all(client.final(r) for r in second), 120, "the resumed burst", [survivor])
        for req_id, prompt in second.items():
            assert client.text(req_id) == tiny.reference(prompt, MAX_TOKENS)
            assert client.final(req_id).finish_reason == "length"
        resumed = [r for r in second if int(client.redis.hget(keys.request(r), "attempt")) == 2]
        assert resumed and all(client.redis.hget(keys.request(r), "worker") == b"w-b"
                               for r in resumed)
        # Every resumed request was taken over. So is an entry w-a had been delivered but not yet
        # started when it died: its first attempt then runs on w-b (attempt 1), and counts too.
        on_survivor = [r for r in second if client.redis.hget(keys.request(r), "worker") == b"w-b"]
        assert len(resumed) <= survivor.takeovers() <= len(on_survivor)
        assert client.redis.xpending(keys.queue(MODEL), keys.group)["pending"] == 0
    finally:
        for worker in workers:
            worker.stop()


def _metrics_up(worker: SlowWorker) -> bool:
    try:
        worker.takeovers()
        return True
    except httpx.HTTPError:
        return False
