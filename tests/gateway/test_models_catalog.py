"""One gateway, many models, against a real Redis: the models live workers serve (their heartbeats
name the model and its source) are listed and served beside the default; each model's tokenizer
is loaded on the first request naming it, once however many arrive together; an unknown model is
OpenAI's 404; a model whose source cannot be loaded is a 503 that is not retried per request."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from redis.asyncio import Redis

from kvfleet.gateway.app import create_app
from kvfleet.gateway.fleet.redis_context import RedisContext
from kvfleet.gateway.models import loader
from kvfleet.shared.settings import GatewaySettings
from kvfleet.shared.wire import Heartbeat, Keys
from tests.gateway.helpers import MODEL
from tests.gateway.model_dirs import save_model_dir

PREFIX = "kvcat:"
KEYS = Keys(PREFIX)
OTHER = "tiny-other"  # the served id of the second model


@pytest.fixture(scope="module")
def other_model_dir(tmp_path_factory, tokenizer):
    return save_model_dir(tmp_path_factory.mktemp("models") / OTHER, tokenizer)


@pytest.fixture
def catalog_settings(redis_url) -> GatewaySettings:
    return GatewaySettings(redis_url=redis_url, model=MODEL, key_prefix=PREFIX,
                           default_max_tokens=8, request_timeout_s=30, first_event_timeout_s=5)


@pytest.fixture
async def redis(redis_url):
    client = Redis.from_url(redis_url)
    yield client
    await client.aclose()


async def beat(redis: Redis, worker_id: str, model: str, source: str) -> None:
    heartbeat = Heartbeat(model=model, ts=time.time(), model_source=source)
    await redis.hset(KEYS.worker(worker_id), mapping=heartbeat.encode())
    await redis.expire(KEYS.worker(worker_id), 30)


@pytest.fixture
async def gateway(catalog_settings, engine, tokenizer, model_info):
    """(app, http client): a fake engine, the fleet's Redis for the catalog; lifespan running."""
    context = RedisContext.from_settings(catalog_settings)
    app = create_app(catalog_settings, engine, tokenizer, model_info=model_info, redis=context)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as http:
            yield app, http
    await context.aclose()


def complete(http, model: str, prompt: str = "Hi"):
    return http.post("/v1/completions", json={"model": model, "prompt": prompt})


async def test_models_of_live_workers_are_listed_and_served(gateway, redis, say,
                                                            other_model_dir, engine):
    app, http = gateway
    say("Hello")
    await beat(redis, "w-1", OTHER, str(other_model_dir))
    await beat(redis, "w-2", MODEL, MODEL)  # the default model's worker: listed once
    listed = (await http.get("/v1/models")).json()["data"]
    assert [m["id"] for m in listed] == [MODEL, OTHER]
    assert listed[1]["root"] == str(other_model_dir) and listed[1]["parent"] is None
    assert listed[1]["max_model_len"] is None  # not loaded until a request names it
    response = await complete(http, OTHER)
    assert response.status_code == 200, response.text
    assert response.json()["model"] == OTHER and response.json()["choices"][0]["text"] == "Hello"
    assert (await complete(http, MODEL)).status_code == 200
    assert [(r.model, r.lora) for r in engine.submitted] == [(OTHER, ""), (MODEL, "")]
    listed = (await http.get("/v1/models")).json()["data"]
    assert listed[1]["max_model_len"] == 1024  # TINY's max_position_embeddings
    chat = await http.post("/v1/chat/completions", json={
        "model": OTHER, "messages": [{"role": "user", "content": "hi"}]})
    assert chat.status_code == 200 and chat.json()["model"] == OTHER
    tokens = await http.post("/tokenize", json={"model": OTHER, "prompt": "Hello"})
    assert tokens.json()["max_model_len"] == 1024
    # per model: backpressure's estimator and the metrics' label
    assert set(app.state.admission.queues) == {OTHER, MODEL}
    metrics = (await http.get("/metrics")).text
    assert sample(metrics, "kvfleet_gateway_requests_total", model=OTHER, endpoint="completions",
                  outcome="stop") == 1
    assert sample(metrics, "kvfleet_gateway_output_tokens_total", model=OTHER) > 0


async def test_a_model_whose_workers_are_gone_is_unknown_again(gateway, redis, say,
                                                               other_model_dir):
    app, http = gateway
    say("Hello")
    await beat(redis, "w-1", OTHER, str(other_model_dir))
    assert (await complete(http, OTHER)).status_code == 200  # found by the miss's refresh
    await redis.delete(KEYS.worker("w-1"))  # its heartbeat expired
    await app.state.models.catalog.refresh()
    assert (await complete(http, OTHER)).status_code == 404
    assert [m["id"] for m in (await http.get("/v1/models")).json()["data"]] == [MODEL]


async def test_an_unknown_model_is_a_404_in_openai_shape(gateway):
    _app, http = gateway
    for response in (await complete(http, "no-such-model"),
                     await http.post("/v1/chat/completions", json={
                         "model": "no-such-model", "messages": [{"role": "user", "content": "x"}]}),
                     await http.post("/tokenize", json={"model": "no-such-model", "prompt": "x"})):
        assert response.status_code == 404
        assert response.json() == {"error": {
            "message": "The model `no-such-model` does not exist.", "type": "not_found_error",
            "param": "model", "code": "model_not_found"}}


async def test_a_model_is_loaded_once_under_concurrent_first_requests(
        gateway, redis, say, other_model_dir, monkeypatch):
    _app, http = gateway
    say("Hi")
    loads = []
    real = loader.load_tokenizer

    def counting(path):
        loads.append(path)
        time.sleep(0.2)  # slow enough that every request below arrives during the load
        return real(path)

    monkeypatch.setattr(loader, "load_tokenizer", counting)
    await beat(redis, "w-1", OTHER, str(other_model_dir))
    responses = await asyncio.gather(*(complete(http, OTHER, f"prompt {i}") for i in range(8)))
    assert [r.status_code for r in responses] == [200] * 8
    assert loads == [str(other_model_dir)]


async def test_a_model_that_cannot_be_loaded_is_a_503_not_a_load_per_request(
        gateway, redis, monkeypatch, tmp_path):
    _app, http = gateway
    loads, real = [], loader.load_tokenizer
    monkeypatch.setattr(loader, "load_tokenizer", lambda path: loads.append(path) or real(path))
    empty = tmp_path / "no-tokenizer-here"
    empty.mkdir()
    await beat(redis, "w-1", "broken", str(empty))
    first, second = await complete(http, "broken"), await complete(http, "broken")
    for response in (first, second):
        assert response.status_code == 503
        error = response.json()["error"]
        assert error["code"] == "model_unavailable"
        assert f"cannot load model `broken` from `{empty}`" in error["message"]
    assert len(loads) == 1


async def test_the_router_follows_every_model_served(catalog_settings, redis, tokenizer,
                                                      model_info, other_model_dir):
    await beat(redis, "w-1", OTHER, str(other_model_dir))
    app = create_app(catalog_settings, None, tokenizer, model_info=model_info)
    async with app.router.lifespan_context(app):
        assert set(app.state.client.router.indexes) == {MODEL, OTHER}


def sample(text: str, name: str, **labels: str) -> float:
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and s.labels == labels:
                return s.value
    raise AssertionError(f"no sample {name}{labels}")
