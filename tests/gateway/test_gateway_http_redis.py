"""The whole gateway (HTTP in, Redis out) against a real Redis (and a real Redis Cluster) and a
fake worker."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
import uvicorn

from kvfleet.gateway.app import create_app
from kvfleet.shared.redis_connect import connect
from kvfleet.shared.redis_server import free_port
from kvfleet.shared.settings import GatewaySettings
from kvfleet.shared.wire import Keys, TokenEvent
from tests.gateway.fake_worker import FakeWorker
from tests.gateway.fakes import token_events, worker_events
from tests.gateway.helpers import MODEL
from tests.helpers.channels import next_message, subscribe

pytestmark = pytest.mark.topologies

PREFIX = "kvgw:"


@pytest.fixture
def redis_settings(redis_url) -> GatewaySettings:
    return GatewaySettings(redis_url=redis_url, model=MODEL, key_prefix=PREFIX,
                           request_timeout_s=30, first_event_timeout_s=5)


@pytest.fixture
async def served(redis_settings, tokenizer, model_info):
    """The app with a RedisEngineClient, served by a real uvicorn (real disconnects)."""
    app = create_app(redis_settings, None, tokenizer, model_info=model_info)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.02)
    yield f"http://127.0.0.1:{port}", app
    server.should_exit = True
    await asyncio.wait_for(task, 10)


def hello_script(tokenizer):
    ids = tokenizer.encode("Hello there!")

    def script(request) -> list[TokenEvent]:
        return token_events(ids + [2], prompt_tokens=len(request.prompt_token_ids), cached_tokens=3)
    return script


async def test_chat_round_trip_through_redis(served, redis_url, tokenizer):
    base_url, app = served
    async with FakeWorker(redis_url, Keys(PREFIX), MODEL, hello_script(tokenizer)) as worker:
        async with httpx.AsyncClient(base_url=base_url, timeout=10) as http:
            response = await http.post("/v1/chat/completions", json={
                "model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                "priority": "interactive", "seed": 5})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["choices"][0]["message"]["content"] == "Hello there!"
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 3
    [request] = worker.received
    assert request.req_id == body["id"]
    assert request.params.seed == 5
    assert request.prompt_token_ids == tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True)["input_ids"]
    assert request.deadline == pytest.approx(time.time() + 30, abs=5)
    assert app.state.client.fanout.num_subscribed == 0


async def test_the_workers_stop_crosses_redis(served, redis_url, tokenizer):
    """The final event's stop_reason and text_after_stop survive the inbox and the fan-out."""
    base_url, _app = served
    ids = tokenizer.encode("Hello there! User: more")

    def script(request) -> list[TokenEvent]:
        return worker_events(request, ids, tokenizer, per_event=2)
    async with FakeWorker(redis_url, Keys(PREFIX), MODEL, script):
        async with httpx.AsyncClient(base_url=base_url, timeout=10) as http:
            response = await http.post("/v1/completions", json={
                "model": MODEL, "prompt": "hi", "stop": ["User:"]})
    assert response.status_code == 200, response.text
    [choice] = response.json()["choices"]
    assert (choice["text"], choice["finish_reason"]) == ("Hello there! ", "stop")
    assert choice["stop_reason"] == "User:"


async def test_client_disconnect_publishes_cancel(served, redis_url, tokenizer):
    base_url, _app = served
    keys = Keys(PREFIX)

    def endless(request) -> list[TokenEvent]:  # a few tokens, then nothing: still generating
        return [TokenEvent(seq=0, attempt=0, token_ids=tokenizer.encode("Once upon"))]

    redis = connect(redis_url)
    cancels = subscribe(redis, keys.cancel())
    async with FakeWorker(redis_url, keys, MODEL, endless) as worker:
        async with httpx.AsyncClient(base_url=base_url, timeout=10) as http:
            async with http.stream("POST", "/v1/completions", json={
                    "model": MODEL, "prompt": "Tell me a story", "stream": True}) as response:
                assert response.status_code == 200
                async for line in response.aiter_lines():
                    if "Once" in line:
                        break  # leave mid-stream: closing the response disconnects
        message = await asyncio.to_thread(next_message, cancels, 5.0)
    cancels.close()
    redis.close()
    assert message is not None, "no cancel was published after the client went away"
    assert message["data"].decode() == worker.received[0].req_id


async def test_unreachable_redis_is_503_never_500(tokenizer, model_info):
    settings = GatewaySettings(redis_url=f"redis://127.0.0.1:{free_port()}/0", model=MODEL)
    app = create_app(settings, None, tokenizer, model_info=model_info)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as http:
            started = time.monotonic()
            chat = await http.post("/v1/chat/completions", json={
                "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True})
            ready = await http.get("/ready")
            health = await http.get("/health")
            elapsed_s = time.monotonic() - started
    assert chat.status_code == 503 and chat.json()["error"]["type"] == "service_unavailable"
    assert ready.status_code == 503 and "error" in ready.json()
    assert health.status_code == 200
    assert elapsed_s < 15


async def test_batch_routes_use_the_gateways_redis_and_its_own_limits(redis_url, tokenizer,
                                                                      model_info, redis_topology,
                                                                      request):
    """The upload limit comes from the gateway's settings (`--batch-max-file-bytes`), and the
    file lands under the gateway's key prefix, through the app's one Redis context."""
    # rq's queue needs a single Redis: on a cluster, a separate one (--batch-redis-url)
    batch_redis_url = (request.getfixturevalue("redis_server").url
                       if redis_topology == "cluster" else None)
    settings = GatewaySettings(redis_url=redis_url, model=MODEL, key_prefix=PREFIX,
                               batch_max_file_bytes=300, batch_redis_url=batch_redis_url)
    app = create_app(settings, None, tokenizer, model_info=model_info)
    line = ('{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": '
            '{"model": "%s", "prompt": "hi"}}\n' % MODEL).encode()
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as http:
            ok = await http.post("/v1/files", data={"purpose": "batch"},
                                 files={"file": ("a.jsonl", line)})
            too_big = await http.post("/v1/files", data={"purpose": "batch"},
                                      files={"file": ("b.jsonl", line * 3)})
    assert ok.status_code == 200, ok.text
    assert too_big.status_code == 413 and "300 bytes" in too_big.json()["error"]["message"]
    redis = connect(redis_url)
    try:
        assert redis.exists(Keys(PREFIX).file(ok.json()["id"])) == 1
    finally:
        redis.close()
