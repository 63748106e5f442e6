"""The Files and Batch API on a real Redis (flushed around each test), and the batch job run
in-process against a fake gateway: validation, the status machine, exactly-once results, resume,
retries and cancel."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from rq import Queue

from kvfleet.batch.jobs import BatchRunner, line_request_id, requeue_orphans
from kvfleet.batch.store import BatchStore
from kvfleet.gateway.fleet.redis_context import RedisContext
from kvfleet.gateway.http.errors import install_error_handlers
from kvfleet.gateway.openai.batches import batch_router
from kvfleet.shared.settings import BatchSettings
from kvfleet.shared.wire import BatchStatus, Keys

PREFIX = "bt:"
MODEL = "tiny"


def chat_line(custom_id: str, content: str = "hi", **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": MODEL, "messages": [{"role": "user", "content": content}],
                     "max_tokens": 4, **body}}


def jsonl(lines: list) -> bytes:
    return "".join((line if isinstance(line, str) else json.dumps(line)) + "\n"
                   for line in lines).encode()


@pytest.fixture
def settings(redis_url) -> BatchSettings:
    return BatchSettings(redis_url=redis_url, key_prefix=PREFIX, batch_max_in_flight=4,
                         batch_poll_s=0.05, batch_lease_ttl_s=2, batch_line_retries=2)


@pytest.fixture
def api(settings) -> TestClient:
    app = FastAPI()
    install_error_handlers(app)
    app.include_router(batch_router(RedisContext(settings.redis_url, Keys(PREFIX)), settings))
    with TestClient(app) as client:
        yield client


@pytest.fixture
def store(redis_client, settings) -> BatchStore:
    return BatchStore(redis_client, Keys(PREFIX), settings.batch_ttl_s)


def upload(api: TestClient, content: bytes, purpose: str = "batch") -> httpx.Response:
    return api.post("/v1/files", data={"purpose": purpose},
                    files={"file": ("requests.jsonl", content, "application/jsonl")})


def create_batch(api: TestClient, lines: list, endpoint: str = "/v1/chat/completions") -> dict:
    file = upload(api, jsonl(lines))
    assert file.status_code == 200, file.text
    response = api.post("/v1/batches", json={"input_file_id": file.json()["id"],
                                             "endpoint": endpoint, "completion_window": "24h"})
    assert response.status_code == 200, response.text
    return response.json()


def assert_openai_error(response: httpx.Response, status: int, *words: str) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    for word in words:
        assert word in error["message"], error["message"]
    return error


# Files.

def test_upload_retrieve_and_download_a_file(api):
    content = jsonl([chat_line("a"), chat_line("b")])
    file = upload(api, content).json()
    assert file["object"] == "file" and file["purpose"] == "batch"
    assert file["bytes"] == len(content) and file["id"].startswith("file-")
    assert api.get(f"/v1/files/{file['id']}").json() == file
    assert api.get(f"/v1/files/{file['id']}/content").content == content
    assert api.delete(f"/v1/files/{file['id']}").json()["deleted"] is True
    assert_openai_error(api.get(f"/v1/files/{file['id']}"), 404, file["id"])


@pytest.mark.parametrize("lines, line_no, words", [
    ([chat_line("a"), chat_line("b"), "{not json"], 3, ["not valid JSON"]),
    ([chat_line("a"), chat_line("a")], 2, ["custom_id `a`", "line 1"]),
    ([{**chat_line("a"), "url": "/v1/embeddings"}], 1, ["`url`"]),
    ([{**chat_line("a"), "method": "GET"}], 1, ["`method`"]),
    ([chat_line("a"), {"method": "POST", "url": "/v1/completions", "body": {}}], 2,
     ["custom_id"]),
    ([chat_line("a"), chat_line("b", temperature=7)], 2, ["body.temperature"]),
    ([chat_line("a"), {**chat_line("b"), "body": {"model": MODEL,
                                                  "messages": [{"role": "robot"}]}}], 2,
     ["body.messages.0.role"]),
    (["[1, 2]"], 1, ["JSON object"]),
])
def test_a_bad_line_is_a_400_naming_the_line(api, lines, line_no, words):
    error = assert_openai_error(upload(api, jsonl(lines)), 400, f"Line {line_no}:", *words)
    assert error["type"] == "invalid_request_error" and error["param"] == "file"


def test_an_empty_file_and_a_wrong_purpose_are_400s(api):
    assert_openai_error(upload(api, b"\n\n"), 400, "no requests")
    error = assert_openai_error(upload(api, jsonl([chat_line("a")]), purpose="fine-tune"), 400,
                                "fine-tune")
    assert error["param"] == "purpose"
    assert_openai_error(api.post("/v1/files", files={"file": ("x.jsonl", b"{}")}), 400,
                        "purpose")


def test_a_file_over_the_limit_is_a_413(redis_url):
    settings = BatchSettings(redis_url=redis_url, key_prefix=PREFIX, batch_max_file_bytes=100)
    app = FastAPI()
    install_error_handlers(app)
    app.include_router(batch_router(RedisContext.from_settings(settings), settings))
    with TestClient(app) as client:
        content = jsonl([chat_line(str(i)) for i in range(5)])
        assert_openai_error(upload(client, content), 413, "100 bytes")


# Batches: creation and its validation.

def test_create_batch_enqueues_an_rq_job(api, redis_client):
    batch = create_batch(api, [chat_line("a"), chat_line("b"), chat_line("c")])
    assert batch["object"] == "batch" and batch["status"] == "validating"
    assert batch["request_counts"] == {"total": 3, "completed": 0, "failed": 0}
    assert batch["expires_at"] - batch["created_at"] == 24 * 3600
    assert api.get(f"/v1/batches/{batch['id']}").json() == batch
    queue = Queue(Keys(PREFIX).batch_queue(), connection=redis_client)
    (job,) = queue.get_jobs()
    assert job.args == (batch["id"], PREFIX) and job.id.startswith(batch["id"])


def test_list_batches_newest_first_with_a_cursor(api, store):
    ids = [create_batch(api, [chat_line("a")])["id"] for _ in range(3)]
    for age, batch_id in enumerate(reversed(ids)):  # make creation times distinct
        store.redis.zadd(store.keys.batches_by_time(), {batch_id: 1_000_000 - age})
    page = api.get("/v1/batches", params={"limit": 2}).json()
    assert page["object"] == "list" and page["has_more"] is True
    assert [b["id"] for b in page["data"]] == ids[::-1][:2]
    rest = api.get("/v1/batches", params={"limit": 2, "after": page["last_id"]}).json()
    assert [b["id"] for b in rest["data"]] == [ids[0]] and rest["has_more"] is False
    store.redis.delete(store.keys.batch(ids[1]))  # expired: skipped and dropped from the index
    assert [b["id"] for b in api.get("/v1/batches").json()["data"]] == [ids[2], ids[0]]
    assert_openai_error(api.get("/v1/batches", params={"limit": 0}), 400, "limit")


def test_create_batch_rejects_bad_input(api):
    file_id = upload(api, jsonl([chat_line("a")])).json()["id"]

    def create(**body):
        return api.post("/v1/batches", json={"input_file_id": file_id,
                                             "endpoint": "/v1/chat/completions", **body})

    assert assert_openai_error(create(endpoint="/v1/embeddings"), 400)["param"] == "endpoint"
    assert assert_openai_error(create(endpoint="/v1/completions"), 400,
                               "/v1/chat/completions")["param"] == "endpoint"
    assert assert_openai_error(create(completion_window="soon"), 400)["param"] == \
        "completion_window"
    error = assert_openai_error(create(input_file_id="file-nope"), 404, "file-nope")
    assert error["param"] == "input_file_id" and error["type"] == "not_found_error"
    assert_openai_error(api.post("/v1/batches", json={"endpoint": "/v1/completions"}), 400,
                        "input_file_id")
    assert_openai_error(api.get("/v1/batches/batch_nope"), 404, "batch_nope")
    assert_openai_error(api.post("/v1/batches/batch_nope/cancel"), 404, "batch_nope")


def test_an_output_file_is_no_batch_input(api, store, settings):
    batch = create_batch(api, [chat_line("a")])
    BatchRunner(store, settings, transport=FakeGateway()).run(batch["id"])
    output_id = api.get(f"/v1/batches/{batch['id']}").json()["output_file_id"]
    response = api.post("/v1/batches", json={"input_file_id": output_id,
                                             "endpoint": "/v1/chat/completions"})
    assert_openai_error(response, 400, "batch_output")


# The job, against a fake gateway.

class FakeGateway(httpx.MockTransport):
    """Answers like the gateway; `script` maps a custom content to a list of statuses to give
    before a 200 (e.g. [503] = one 503 then success)."""

    def __init__(self, script: dict[str, list[int]] | None = None, delay_s: float = 0.0):
        super().__init__(self._handle)
        self.script = {k: list(v) for k, v in (script or {}).items()}
        self.delay_s = delay_s
        self.bodies: list[dict] = []
        self._lock = threading.Lock()

    def _handle(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        content = body["messages"][0]["content"]
        with self._lock:
            self.bodies.append(body)
            statuses = self.script.get(content, [])
            status = statuses.pop(0) if statuses else 200
        time.sleep(self.delay_s)
        if status != 200:
            return httpx.Response(status, headers={"retry-after": "0.05"},
                                  json={"error": {"message": f"fake {status}", "type": "x",
                                                  "param": None, "code": None}})
        return httpx.Response(200, json={
            "id": f"cmpl-{len(self.bodies)}", "object": "chat.completion", "model": MODEL,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": content[::-1]},
                         "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})


def output_lines(api: TestClient, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(line) for line in api.get(f"/v1/files/{file_id}/content").text.splitlines()]


def test_the_job_runs_every_line_once_at_batch_priority(api, store, settings):
    lines = [chat_line(f"id-{i}", f"line {i}") for i in range(40)]
    batch = create_batch(api, lines)
    gateway = FakeGateway()
    assert BatchRunner(store, settings, transport=gateway).run(batch["id"]) == "completed"
    done = api.get(f"/v1/batches/{batch['id']}").json()
    assert done["status"] == "completed" and done["error_file_id"] is None
    assert done["request_counts"] == {"total": 40, "completed": 40, "failed": 0}
    assert done["in_progress_at"] and done["completed_at"]
    assert len(gateway.bodies) == 40
    assert all(b["priority"] == "batch" and b["stream"] is False for b in gateway.bodies)
    out = output_lines(api, done["output_file_id"])
    assert [o["custom_id"] for o in out] == [f"id-{i}" for i in range(40)]  # input order
    first = out[0]
    assert first["id"] == line_request_id(batch["id"], 0) and first["error"] is None
    assert first["response"]["status_code"] == 200
    assert first["response"]["body"]["choices"][0]["message"]["content"] == "0 enil"
    assert not store.redis.exists(store.keys.batch_results(batch["id"]))  # folded into the file
    assert batch["id"] not in store.active_ids()


def test_retries_then_errors_go_to_the_error_file(api, store, settings):
    lines = [chat_line("ok", "ok"), chat_line("flaky", "flaky"), chat_line("bad", "bad"),
             chat_line("down", "down"), chat_line("busy", "busy")]
    batch = create_batch(api, lines)
    gateway = FakeGateway({"flaky": [503], "bad": [400], "down": [503] * 10,
                           "busy": [429, 429]})
    BatchRunner(store, settings, transport=gateway).run(batch["id"])
    done = api.get(f"/v1/batches/{batch['id']}").json()
    assert done["request_counts"] == {"total": 5, "completed": 3, "failed": 2}
    assert {o["custom_id"] for o in output_lines(api, done["output_file_id"])} == \
        {"ok", "flaky", "busy"}
    errors = {o["custom_id"]: o for o in output_lines(api, done["error_file_id"])}
    assert errors["bad"]["response"]["status_code"] == 400 and errors["bad"]["error"] is None
    assert errors["down"]["response"] is None
    assert errors["down"]["error"]["code"] == "http_503"
    assert len([b for b in gateway.bodies if b["messages"][0]["content"] == "down"]) == 3


def test_a_rerun_resumes_without_repeating_recorded_lines(api, store, settings):
    lines = [chat_line(f"id-{i}", f"line {i}") for i in range(20)]
    batch = create_batch(api, lines)
    # A first run that died after 8 lines: their results are recorded, the batch in progress.
    assert store.transition(batch["id"], BatchStatus.IN_PROGRESS, (BatchStatus.VALIDATING,),
                            time.time())
    for index in range(8):
        store.record_result(batch["id"], index, {"id": line_request_id(batch["id"], index),
                                                 "custom_id": f"id-{index}",
                                                 "response": {"status_code": 200, "body": {}},
                                                 "error": None}, ok=True)
    assert store.record_result(batch["id"], 3, {"custom_id": "id-3"}, ok=True) == 0  # once only
    gateway = FakeGateway()
    BatchRunner(store, settings, transport=gateway).run(batch["id"])
    assert sorted(b["messages"][0]["content"] for b in gateway.bodies) == \
        sorted(f"line {i}" for i in range(8, 20))
    done = api.get(f"/v1/batches/{batch['id']}").json()
    assert done["request_counts"] == {"total": 20, "completed": 20, "failed": 0}
    assert [o["custom_id"] for o in output_lines(api, done["output_file_id"])] == \
        [f"id-{i}" for i in range(20)]


def test_a_second_job_leaves_a_leased_batch_alone(api, store, settings):
    batch = create_batch(api, [chat_line("a")])
    assert store.acquire_lease(batch["id"], "someone-else", 5)
    assert BatchRunner(store, settings, transport=FakeGateway()).run(batch["id"]) == \
        "another job holds the batch"
    assert store.status(batch["id"]) == BatchStatus.VALIDATING


def test_cancel_stops_feeding_and_ends_cancelled(api, store, settings):
    lines = [chat_line(f"id-{i}", f"line {i}") for i in range(200)]
    batch = create_batch(api, lines)
    runner = threading.Thread(target=BatchRunner(store, settings,
                                                 transport=FakeGateway(delay_s=0.02)).run,
                              args=(batch["id"],))
    runner.start()
    deadline = time.monotonic() + 10
    while api.get(f"/v1/batches/{batch['id']}").json()["request_counts"]["completed"] < 8:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert api.post(f"/v1/batches/{batch['id']}/cancel").json()["status"] == "cancelling"
    runner.join(timeout=10)
    done = api.get(f"/v1/batches/{batch['id']}").json()
    assert done["status"] == "cancelled" and done["cancelled_at"]
    out = output_lines(api, done["output_file_id"])
    assert 8 <= len(out) < 200 and len(out) == done["request_counts"]["completed"]
    assert len({o["custom_id"] for o in out}) == len(out)
    assert api.post(f"/v1/batches/{batch['id']}/cancel").json()["status"] == "cancelled"


def test_cancel_before_the_job_runs_and_after_it_finished(api, store, settings):
    batch = create_batch(api, [chat_line("a")])
    assert api.post(f"/v1/batches/{batch['id']}/cancel").json()["status"] == "cancelling"
    BatchRunner(store, settings, transport=FakeGateway()).run(batch["id"])
    assert api.get(f"/v1/batches/{batch['id']}").json()["status"] == "cancelled"
    other = create_batch(api, [chat_line("b")])
    BatchRunner(store, settings, transport=FakeGateway()).run(other["id"])
    assert_openai_error(api.post(f"/v1/batches/{other['id']}/cancel"), 400, "completed")


def test_requeue_orphans_enqueues_only_batches_without_a_live_job(api, store, settings,
                                                                  redis_client):
    queue = Queue(Keys(PREFIX).batch_queue(), connection=redis_client)
    waiting = create_batch(api, [chat_line("a")])
    assert requeue_orphans(store, queue, settings.batch_lease_ttl_s) == []  # its job is queued
    queue.empty()  # the job vanished (say rq's queue was flushed): the batch is an orphan
    assert requeue_orphans(store, queue, settings.batch_lease_ttl_s) == [waiting["id"]]
    assert store.get_batch(waiting["id"]).job_id == queue.get_job_ids()[0]
    queue.empty()
    assert store.acquire_lease(waiting["id"], "alive", 5)
    assert requeue_orphans(store, queue, settings.batch_lease_ttl_s) == []  # leased: alive


def test_a_batch_whose_input_file_expired_fails(api, store, settings):
    batch = create_batch(api, [chat_line("a")])
    store.delete_file(batch["input_file_id"])
    BatchRunner(store, settings, transport=FakeGateway()).run(batch["id"])
    done = api.get(f"/v1/batches/{batch['id']}").json()
    assert done["status"] == "failed"
    assert done["errors"]["data"][0]["code"] == "input_file_expired"


def test_without_redis_the_batch_routes_are_503s():
    app = FastAPI()
    install_error_handlers(app)
    app.include_router(batch_router(None, BatchSettings()))
    with TestClient(app) as client:
        assert_openai_error(client.get("/v1/batches/batch_x"), 503, "Redis")


def test_redis_down_is_a_503(redis_server):
    url = redis_server.url.rsplit(":", 1)[0] + ":1"
    app = FastAPI()
    install_error_handlers(app)
    app.include_router(batch_router(RedisContext(url, Keys()), BatchSettings()))
    with TestClient(app) as client:
        assert_openai_error(client.get("/v1/batches/batch_x"), 503, "Redis")
