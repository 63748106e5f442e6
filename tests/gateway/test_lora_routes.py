"""LoRA adapters at the gateway against a real Redis: vLLM's load and unload routes and their
answers (a good adapter, a missing directory, an adapter of another base model, a rank over the
limit, a taken name, an unknown one), the registry every gateway reads, /v1/models' listing, an
adapter's requests enqueued on its base model with its name and directory, and start-up
adapters (--lora-modules)."""

from __future__ import annotations

import json
import time
from contextlib import asynccontextmanager

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from redis.asyncio import Redis

from kvfleet.gateway.app import create_app
from kvfleet.gateway.fleet.redis_context import RedisContext
from kvfleet.shared.lora import LoraRecord
from kvfleet.shared.settings import GatewaySettings
from kvfleet.shared.wire import Heartbeat, Keys
from tests.gateway.fakes import FakeEngineClient
from tests.gateway.helpers import MODEL
from tests.gateway.model_dirs import TINY, default_model_config, save_adapter, save_model_dir

PREFIX = "kvlora:"
KEYS = Keys(PREFIX)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> dict[str, str]:
    """Adapter directories: `good` (rank 8, of the default model), `wide` (rank 32), `other` (of
    a model with another hidden size), `missing` (no such directory)."""
    root = tmp_path_factory.mktemp("adapters")
    config = default_model_config()
    return {"good": str(save_adapter(root / "good", config)),
            "wide": str(save_adapter(root / "wide", config, rank=32)),
            "other": str(save_adapter(root / "other", dict(TINY, hidden_size=96))),
            "missing": str(root / "missing")}


def lora_settings(redis_url: str, **overrides) -> GatewaySettings:
    return GatewaySettings(redis_url=redis_url, model=MODEL, key_prefix=PREFIX,
                           default_max_tokens=8, request_timeout_s=30, first_event_timeout_s=5,
                           **overrides)


@asynccontextmanager
async def serve(app):
    """An HTTP client of `app` with its lifespan running."""
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as http:
            yield http


@pytest.fixture
async def gateway(redis_url, engine, tokenizer, model_info):
    """(app, http client): a fake engine and the fleet's real Redis."""
    settings = lora_settings(redis_url)
    context = RedisContext.from_settings(settings)
    app = create_app(settings, engine, tokenizer, model_info=model_info, redis=context)
    async with serve(app) as http:
        yield app, http
    await context.aclose()


@pytest.fixture
async def redis(redis_url):
    client = Redis.from_url(redis_url)
    yield client
    await client.aclose()


def load(http, name: str, path: str, **extra):
    return http.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path,
                                                     **extra})


def unload(http, name: str):
    return http.post("/v1/unload_lora_adapter", json={"lora_name": name})


async def test_an_adapter_is_registered_listed_served_and_removed(gateway, redis, adapters, say,
                                                                  engine):
    app, http = gateway
    say("Hi")
    response = await load(http, "sql", adapters["good"])
    assert response.status_code == 200, response.text
    assert response.text == "Success: LoRA adapter 'sql' added successfully."
    record = LoraRecord.from_json(await redis.hget(KEYS.loras(), "sql"))
    assert (record.base_model, record.path, record.rank, record.target_modules, record.pinned) \
        == (MODEL, adapters["good"], 8, ("q_proj", "v_proj"), False)
    listed = (await http.get("/v1/models")).json()["data"]
    assert [(m["id"], m["parent"], m["root"]) for m in listed] == [
        (MODEL, None, MODEL), ("sql", MODEL, adapters["good"])]
    completion = await http.post("/v1/completions", json={"model": "sql", "prompt": "Hi"})
    assert completion.status_code == 200, completion.text
    assert completion.json()["model"] == "sql"
    chat = await http.post("/v1/chat/completions", json={
        "model": "sql", "messages": [{"role": "user", "content": "hi"}], "stream": True})
    assert chat.status_code == 200 and '"model":"sql"' in chat.text
    # enqueued on the base model's queues, naming the adapter and its directory
    assert [(r.model, r.lora, r.lora_path) for r in engine.submitted] == \
        [(MODEL, "sql", adapters["good"])] * 2
    metrics = (await http.get("/metrics")).text
    assert sample(metrics, "kvfleet_gateway_requests_total", model="sql",
                  endpoint="completions", outcome="stop") == 1
    assert sample(metrics, "kvfleet_gateway_output_tokens_total", model="sql") > 0
    assert set(app.state.admission.queues) == {MODEL}  # an adapter waits in its base's queues
    # token ids are checked against the base model's vocabulary
    bias = await http.post("/v1/completions", json={
        "model": "sql", "prompt": "Hi", "logit_bias": {str(len(app.state.chat.processor
                                                               .tokenizer) + 5): 1}})
    assert bias.status_code == 400 and bias.json()["error"]["param"] == "logit_bias"
    assert sample((await http.get("/metrics")).text, "kvfleet_gateway_requests_total",
                  model="sql", endpoint="completions", outcome="400") == 1  # the adapter's
    response = await unload(http, "sql")
    assert response.status_code == 200
    assert response.text == "Success: LoRA adapter 'sql' removed successfully."
    assert await redis.hget(KEYS.loras(), "sql") is None
    assert (await http.post("/v1/completions", json={"model": "sql", "prompt": "Hi"})
            ).status_code == 404


@pytest.mark.parametrize("adapter, message", [
    ("missing", "does not exist"),
    ("other", "an adapter of another base model"),
    ("wide", "rank 32 is over the limit of 16"),
])
async def test_an_adapter_the_workers_would_refuse_is_a_400(gateway, redis, adapters, adapter,
                                                            message):
    _app, http = gateway
    response = await load(http, "bad", adapters[adapter])
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "invalid_lora_adapter"
    assert error["message"].startswith("Invalid LoRA adapter `bad`: ") and message in \
        error["message"]
    assert await redis.hlen(KEYS.loras()) == 0


async def test_the_rank_limit_is_a_setting(redis_url, engine, tokenizer, model_info, adapters):
    settings = lora_settings(redis_url, max_lora_rank=32)
    context = RedisContext.from_settings(settings)
    app = create_app(settings, engine, tokenizer, model_info=model_info, redis=context)
    async with serve(app) as http:
        assert (await load(http, "wide", adapters["wide"])).status_code == 200
    await context.aclose()


async def test_taken_names_and_missing_fields_are_400s(gateway, adapters):
    _app, http = gateway
    assert (await load(http, "sql", adapters["good"])).status_code == 200
    again = await load(http, "sql", adapters["good"])
    assert again.status_code == 400
    assert again.json()["error"]["message"] == "The lora adapter 'sql' has already been loaded."
    model_name = await load(http, MODEL, adapters["good"])
    assert model_name.status_code == 400 and "served model" in model_name.json()["error"]["message"]
    no_path = await http.post("/v1/load_lora_adapter", json={"lora_name": "x"})
    assert no_path.status_code == 400
    assert no_path.json()["error"]["message"] == \
        "Both 'lora_name' and 'lora_path' must be provided."
    no_base = await load(http, "y", adapters["good"], base_model_name="no-such-model")
    assert no_base.status_code == 400 and no_base.json()["error"]["param"] == "base_model_name"


async def test_unloading_an_unknown_adapter_is_a_404(gateway):
    _app, http = gateway
    for name in ("never-loaded", MODEL):  # a served model is no adapter either
        response = await unload(http, name)
        assert response.status_code == 404
        assert response.json() == {"error": {
            "message": f"The lora adapter '{name}' cannot be found.", "type": "not_found_error",
            "param": "lora_name", "code": "lora_adapter_not_found"}}


async def test_another_gateway_serves_an_adapter_registered_on_one(gateway, redis_url, adapters,
                                                                   tokenizer, model_info):
    _app, http = gateway
    assert (await load(http, "sql", adapters["good"])).status_code == 200
    settings = lora_settings(redis_url)
    context = RedisContext.from_settings(settings)
    other = create_app(settings, FakeEngineClient(), tokenizer, model_info=model_info,
                       redis=context)
    async with serve(other) as other_http:
        listed = (await other_http.get("/v1/models")).json()["data"]
        assert [m["id"] for m in listed] == [MODEL, "sql"]
        tokens = await other_http.post("/tokenize", json={"model": "sql", "prompt": "Hi"})
        assert tokens.status_code == 200  # the base model's tokenizer
        assert (await unload(other_http, "sql")).status_code == 200
    await context.aclose()
    assert (await load(http, "sql", adapters["good"])).status_code == 200  # the name is free


async def test_start_up_adapters_are_checked_and_pinned(redis_url, engine, tokenizer,
                                                        model_info, adapters, redis):
    entries = [f"sql={adapters['good']}",
               json.dumps({"name": "chat", "path": adapters["good"], "base_model_name": MODEL})]
    settings = lora_settings(redis_url, lora_modules=entries)
    context = RedisContext.from_settings(settings)
    app = create_app(settings, engine, tokenizer, model_info=model_info, redis=context)
    async with serve(app) as http:
        listed = (await http.get("/v1/models")).json()["data"]
        assert [m["id"] for m in listed] == [MODEL, "chat", "sql"]
    await context.aclose()
    records = {k.decode(): LoraRecord.from_json(v)
               for k, v in (await redis.hgetall(KEYS.loras())).items()}
    assert {name: (r.path, r.pinned) for name, r in records.items()} == {
        "sql": (adapters["good"], True), "chat": (adapters["good"], True)}


@pytest.mark.parametrize("entry, message", [
    ("bad={missing}", "--lora-modules bad={missing}: adapter directory"),
    ("wide={wide}", "rank 32 is over the limit of 16"),
    ('{{"name": "x", "path": "{good}", "base_model_name": "another"}}',
     "base_model_name `another` is not --model"),
])
def test_a_bad_start_up_adapter_stops_the_gateway(redis_url, engine, tokenizer, model_info,
                                                  adapters, entry, message):
    settings = lora_settings(redis_url, lora_modules=[entry.format(**adapters)])
    with pytest.raises(ValueError, match=message.format(**adapters).replace("{", r"\{")):
        create_app(settings, engine, tokenizer, model_info=model_info)


async def test_an_adapter_of_another_served_model(gateway, redis, tmp_path, tokenizer, say,
                                                  engine):
    """base_model_name names a live worker's model: the adapter is checked against that model's
    config and its requests go to that model's queues, tokenised by its tokenizer."""
    _app, http = gateway
    say("Hi")
    model_dir = save_model_dir(tmp_path / "tiny-other", tokenizer)
    heartbeat = Heartbeat(model="tiny-other", ts=time.time(), model_source=str(model_dir))
    await redis.hset(KEYS.worker("w-1"), mapping=heartbeat.encode())
    await redis.expire(KEYS.worker("w-1"), 30)
    adapter = str(save_adapter(tmp_path / "tiny-sql", TINY, rank=4))
    assert (await load(http, "tiny-sql", adapter)).status_code == 400  # not the default's shapes
    response = await load(http, "tiny-sql", adapter, base_model_name="tiny-other")
    assert response.status_code == 200, response.text
    listed = (await http.get("/v1/models")).json()["data"]
    assert ("tiny-sql", "tiny-other") in [(m["id"], m["parent"]) for m in listed]
    completion = await http.post("/v1/completions", json={"model": "tiny-sql", "prompt": "Hi"})
    assert completion.status_code == 200, completion.text
    assert [(r.model, r.lora, r.lora_path) for r in engine.submitted] == \
        [("tiny-other", "tiny-sql", adapter)]


def sample(text: str, name: str, **labels: str) -> float:
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and s.labels == labels:
                return s.value
    raise AssertionError(f"no sample {name}{labels}")
