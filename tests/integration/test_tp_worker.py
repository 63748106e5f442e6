"""A tensor-parallel worker (2 gloo ranks on the CPU) in the fleet: it serves like any worker;
SIGKILL its second rank mid-stream and the whole worker exits non-zero, its requests finishing on
another worker with exactly the tokens an uninterrupted run gives; SIGTERM stops every rank."""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import pytest
import redis

from kvfleet.shared.wire import Keys, SamplingParams
from kvfleet.shared.wire.checkpoint import TOKEN_BYTES
from tests.engine.tiny_models import TinyModel, random_prompt
from tests.integration.test_worker_service import Client
from tests.integration.test_worker_takeover import SlowWorker, wait_for
from kvfleet.worker.engine.parallel.tp_group import EXIT_RANK_DIED

pytestmark = pytest.mark.e2e

MAX_TOKENS = 12
STEP_S = 0.25  # long enough to catch a stream half way, short enough for a quick test


def rank_pids(worker: SlowWorker) -> list[int]:
    """Pids of ranks 1.. as rank 0 logs them."""
    found = re.search(r"started ranks 1\.\.\d+ \(pids ([\d, ]+)\)", worker.log_path.read_text())
    return [int(pid) for pid in found[1].split(", ")] if found else []


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")  # a zombie has exited


def send(client: Client, n: int, seed: int) -> dict[str, list[int]]:
    prompts = {}
    for i in range(n):
        prompt = random_prompt(9 + 5 * i, seed=seed + i)
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
        prompts[client.send(prompt, params)] = prompt
    return prompts


def start_tp_worker(redis_url: str, worker_id: str, log_dir: Path) -> SlowWorker:
    worker = SlowWorker(redis_url, worker_id, log_dir, step_s=STEP_S, ttl_s=1.0, heartbeat_s=0.1,
                        tensor_parallel_size=2)
    client = redis.Redis.from_url(redis_url)
    wait_for(lambda: client.exists(Keys().worker(worker_id)) and rank_pids(worker), 180,
             f"{worker_id} with its ranks", [worker])
    return worker


def test_a_dead_rank_takes_its_worker_down_and_the_requests_resume(redis_url, tmp_path):
    keys = Keys()
    client = Client(redis.Redis.from_url(redis_url), keys)
    tiny = TinyModel("llama")  # the seeded weights both workers build
    victim = start_tp_worker(redis_url, "w-tp", tmp_path)
    rescuer = None
    try:
        served = send(client, 2, seed=300)  # two ranks serve it through the fleet protocol
        wait_for(lambda: all(client.final(r) for r in served), 120, "the first requests", [victim])
        for req_id, prompt in served.items():
            assert client.text(req_id) == tiny.reference(prompt, MAX_TOKENS)

        streaming = send(client, 3, seed=400)

        def mid_stream() -> bool:
            return any(0 < client.redis.strlen(keys.checkpoint(r)) // TOKEN_BYTES < MAX_TOKENS - 3
                       for r in streaming)

        wait_for(mid_stream, 60, "w-tp to stream", [victim])
        (rank1,) = rank_pids(victim)
        os.kill(rank1, signal.SIGKILL)
        assert victim.popen.wait(timeout=30) == EXIT_RANK_DIED
        assert "rank process tp-rank-1 exited (status -9)" in victim.log_path.read_text()
        assert not any(client.final(r) for r in streaming)

        rescuer = start_tp_worker(redis_url, "w-rescue", tmp_path)
        wait_for(lambda: all(client.final(r) for r in streaming), 120, "the resumed requests",
                 [rescuer])
        for req_id, prompt in streaming.items():
            assert client.text(req_id) == tiny.reference(prompt, MAX_TOKENS)
            assert client.redis.hget(keys.request(req_id), "worker") == b"w-rescue"
        assert any(client.redis.hget(keys.request(r), "attempt") == b"2" for r in streaming)

        (rescuer_rank1,) = rank_pids(rescuer)
        rescuer.stop()  # SIGTERM: rank 0 stops its ranks and exits cleanly
        assert rescuer.popen.returncode == 0
        wait_for(lambda: not alive(rescuer_rank1), 10, "the rescuer's rank 1 to exit")
    finally:
        for worker in (victim, rescuer):
            if worker is not None:
                worker.stop()
