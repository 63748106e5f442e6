"""The batch API end to end: a real gateway and worker (a tiny random Llama with SmolLM2's
tokenizer), real `kvfleet batch-worker` (rq) processes, and a 200-line batch through the OpenAI
client; a batch worker killed with SIGKILL mid-batch; a cancel."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import httpx
import pytest
import redis
import uvicorn
from fastapi import FastAPI

from kvfleet.gateway.fleet.redis_context import RedisContext
from kvfleet.gateway.http.errors import install_error_handlers
from kvfleet.gateway.openai.batches import batch_router
from kvfleet.shared.models import DEFAULT_MODEL, resolve_model_path
from kvfleet.shared.redis_server import free_port
from kvfleet.shared.settings import BatchSettings
from kvfleet.shared.wire import Keys
from tests.helpers.processes import ProcessFleet

pytestmark = [pytest.mark.e2e]

NUM_LINES = 200
ENDPOINT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A 1-layer random Llama (hidden 32) with the SmolLM2 tokenizer and chat template."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    target = tmp_path_factory.mktemp("models") / "tiny-batch-llama"
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(DEFAULT_MODEL))
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=2048, tie_word_embeddings=True,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    LlamaForCausalLM(config).save_pretrained(target)
    tokenizer.save_pretrained(target)
    return target


class TinyFleet(ProcessFleet):
    def __init__(self, redis_url: str, log_dir: Path, model_dir: Path):
        super().__init__(redis_url, log_dir)
        self.model_dir = model_dir

    @property
    def env(self) -> dict[str, str]:
        return {**super().env, "KVFLEET_MODEL": str(self.model_dir)}


@pytest.fixture(scope="module")
def fleet(redis_server, tmp_path_factory, tiny_model_dir):
    fleet = TinyFleet(redis_server.url, tmp_path_factory.mktemp("batch-logs"), tiny_model_dir)
    try:
        fleet.start("w0")  # the worker loads while the gateway starts
        yield fleet
    finally:
        fleet.stop()


class ApiServer:
    """The batch routes served from this process (until `create_app` mounts them, the fleet's
    gateway process does not serve them); the lines still go through the real gateway."""

    def __init__(self, redis_url: str, prefix: str):
        app = FastAPI()
        install_error_handlers(app)
        app.include_router(batch_router(RedisContext(redis_url, Keys(prefix)), BatchSettings()))
        self.url = f"http://127.0.0.1:{free_port()}"
        config = uvicorn.Config(app, host="127.0.0.1", port=int(self.url.rsplit(":", 1)[1]),
                                log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> ApiServer:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline, "the batch API server did not start"
            time.sleep(0.05)
        return self

    def __exit__(self, *exc_info) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


@pytest.fixture(scope="module")
def api_url(fleet):
    """The fleet's gateway when it serves the batch routes, else an in-process server."""
    probe = httpx.get(f"{fleet.url}/v1/batches/batch_probe", timeout=5)
    if probe.status_code == 404 and "batch_probe" in probe.text:
        yield fleet.url
        return
    with ApiServer(fleet.redis_url, fleet.prefix) as server:
        yield server.url


class BatchWorker:
    """A `kvfleet batch-worker` process (its own session, so SIGKILL takes all of it)."""

    def __init__(self, fleet: ProcessFleet, max_in_flight: int):
        self.log_path = fleet.log_dir / f"batch-worker-{uuid.uuid4().hex[:6]}.log"
        env = {**os.environ, **fleet.env, "KVFLEET_GATEWAY_URL": fleet.url,
               "KVFLEET_BATCH_MAX_IN_FLIGHT": str(max_in_flight),
               "KVFLEET_BATCH_LEASE_TTL_S": "1.5", "KVFLEET_BATCH_POLL_S": "0.1"}
        with open(self.log_path, "wb") as log:
            self.popen = subprocess.Popen([sys.executable, "-m", "kvfleet.batch_worker"],
                                          env=env, stdout=log, stderr=subprocess.STDOUT,
                                          start_new_session=True)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.popen.poll() is None:
            os.killpg(self.popen.pid, sig)
        try:
            self.popen.wait(timeout=5)
        except subprocess.TimeoutExpired:  # rq's warm shutdown waits for a running job
            os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait(timeout=5)

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")


@pytest.fixture
def batch_workers(fleet):
    started: list[BatchWorker] = []

    def start(max_in_flight: int = 32) -> BatchWorker:
        started.append(BatchWorker(fleet, max_in_flight))
        return started[-1]

    yield start
    for worker in started:
        worker.kill(signal.SIGTERM)


def batch_file(model: str, num_lines: int = NUM_LINES) -> bytes:
    lines = [{"custom_id": f"req-{i}", "method": "POST", "url": ENDPOINT,
              "body": {"model": model, "max_tokens": 3, "temperature": 0,
                       "messages": [{"role": "user", "content": f"Question number {i}?"}]}}
             for i in range(num_lines)]
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


def wait_for(api_url: str, batch_id: str, done, timeout_s: float = 60,
             workers: list[BatchWorker] = ()) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        batch = httpx.get(f"{api_url}/v1/batches/{batch_id}", timeout=5).json()
        if done(batch):
            return batch
        if time.monotonic() > deadline:
            logs = "\n".join(w.log_text()[-3000:] for w in workers)
            raise AssertionError(f"batch stuck: {batch}\n{logs}")
        time.sleep(0.05)


def outputs(api_url: str, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    text = httpx.get(f"{api_url}/v1/files/{file_id}/content", timeout=10).text
    return [json.loads(line) for line in text.splitlines()]


def submit(api_url: str, model: str, num_lines: int = NUM_LINES) -> dict:
    file = httpx.post(f"{api_url}/v1/files", data={"purpose": "batch"}, timeout=10,
                      files={"file": ("batch.jsonl", batch_file(model, num_lines))}).json()
    response = httpx.post(f"{api_url}/v1/batches", timeout=10,
                          json={"input_file_id": file["id"], "endpoint": ENDPOINT,
                                "completion_window": "24h"})
    assert response.status_code == 200, response.text
    return response.json()


def test_a_200_line_batch_round_trips_through_the_fleet(fleet, api_url, batch_workers):
    from openai import OpenAI

    worker = batch_workers()
    client = OpenAI(base_url=f"{api_url}/v1", api_key="unused", max_retries=0)
    model = fleet.model_dir.name
    file = client.files.create(file=("batch.jsonl", batch_file(model)), purpose="batch")
    batch = client.batches.create(input_file_id=file.id, endpoint=ENDPOINT,
                                  completion_window="24h")
    assert batch.status == "validating"
    done = wait_for(api_url, batch.id, lambda b: b["status"] in ("completed", "failed"),
                    workers=[worker])
    assert done["status"] == "completed", done
    assert done["request_counts"] == {"total": NUM_LINES, "completed": NUM_LINES, "failed": 0}
    retrieved = client.batches.retrieve(batch.id)
    assert retrieved.output_file_id == done["output_file_id"] and retrieved.error_file_id is None
    lines = [json.loads(line) for line in
             client.files.content(retrieved.output_file_id).text.splitlines()]
    assert len(lines) == NUM_LINES
    assert sorted(o["custom_id"] for o in lines) == sorted(f"req-{i}" for i in range(NUM_LINES))
    # every line went through a batch-priority stream: the shared one, or (prefix-affinity
    # routing, the default) the worker's own
    keys, client = Keys(fleet.prefix), redis.Redis.from_url(fleet.redis_url)
    batch_streams = [keys.queue(model, "batch"), keys.worker_queue(model, "w0", "batch")]
    assert sum(client.xlen(stream) for stream in batch_streams) >= NUM_LINES
    for line in lines:
        assert line["error"] is None and line["response"]["status_code"] == 200
        body = line["response"]["body"]
        assert body["object"] == "chat.completion" and body["model"] == model
        assert 1 <= body["usage"]["completion_tokens"] <= 3


def test_a_killed_batch_worker_is_replaced_without_lost_or_repeated_lines(
        fleet, api_url, batch_workers):
    first = batch_workers(max_in_flight=2)
    batch = submit(api_url, fleet.model_dir.name)
    wait_for(api_url, batch["id"], lambda b: b["request_counts"]["completed"] >= 20,
             workers=[first])
    first.kill()  # SIGKILL: no cleanup, the lease is left to expire
    at_kill = httpx.get(f"{api_url}/v1/batches/{batch['id']}", timeout=5).json()
    assert at_kill["status"] == "in_progress", at_kill
    assert at_kill["request_counts"]["completed"] < NUM_LINES
    second = batch_workers(max_in_flight=32)
    done = wait_for(api_url, batch["id"], lambda b: b["status"] in ("completed", "failed"),
                    workers=[second])
    assert done["status"] == "completed", done
    assert done["request_counts"] == {"total": NUM_LINES, "completed": NUM_LINES, "failed": 0}
    lines = outputs(api_url, done["output_file_id"])
    ids = [o["custom_id"] for o in lines]
    assert len(ids) == NUM_LINES and set(ids) == {f"req-{i}" for i in range(NUM_LINES)}
    record = redis.Redis.from_url(fleet.redis_url).hget(Keys(fleet.prefix).batch(batch["id"]),
                                                        "attempts")
    assert int(record) == 2  # the second job resumed the same batch
    assert "requeueing" in second.log_text()


def test_cancel_ends_the_batch_with_partial_results(fleet, api_url, batch_workers):
    worker = batch_workers(max_in_flight=2)
    batch = submit(api_url, fleet.model_dir.name)
    wait_for(api_url, batch["id"], lambda b: b["request_counts"]["completed"] >= 10,
             workers=[worker])
    cancelled = httpx.post(f"{api_url}/v1/batches/{batch['id']}/cancel", timeout=5).json()
    assert cancelled["status"] in ("cancelling", "cancelled")
    done = wait_for(api_url, batch["id"], lambda b: b["status"] == "cancelled",
                    workers=[worker])
    lines = outputs(api_url, done["output_file_id"])
    counts = done["request_counts"]
    assert 10 <= len(lines) < NUM_LINES
    assert len(lines) == counts["completed"] and counts["failed"] == 0
    assert len({o["custom_id"] for o in lines}) == len(lines)
