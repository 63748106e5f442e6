"""`--served-model-name` at the gateway, against a real Redis: /v1/models lists the model by its
first name, a request naming any of its names is served as the first (its answer, queues and
metrics label), adapters of an alias have the first name as `parent`, and the model's directory
name or any other name is OpenAI's 404."""

from __future__ import annotations

import httpx
import pytest

from kvfleet.gateway.app import create_app
from kvfleet.gateway.fleet.redis_context import RedisContext
from kvfleet.shared.settings import GatewaySettings
from tests.gateway.helpers import MODEL
from tests.gateway.model_dirs import default_model_config, save_adapter
from tests.gateway.test_models_catalog import sample

PREFIX = "kvnames:"
HUB = "HuggingFaceTB/SmolLM2-135M-Instruct"
NAMES = [HUB, "smol"]


@pytest.fixture
def names_settings(redis_url) -> GatewaySettings:
    return GatewaySettings(redis_url=redis_url, model=MODEL, served_model_name=NAMES,
                           key_prefix=PREFIX, default_max_tokens=8, request_timeout_s=30,
                           first_event_timeout_s=5)


@pytest.fixture
async def gateway(names_settings, engine, tokenizer):
    """(app, http client): the model's info read as `kvfleet gateway` reads it (no model_info
    given), a fake engine, the fleet's Redis for the catalog and adapters; lifespan running."""
    context = RedisContext.from_settings(names_settings)
    app = create_app(names_settings, engine, tokenizer, redis=context)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as http:
            yield app, http
    await context.aclose()


async def test_the_first_name_is_listed_and_every_name_is_served_as_it(gateway, engine, say):
    app, http = gateway
    say("Hello")
    listed = (await http.get("/v1/models")).json()["data"]
    assert [m["id"] for m in listed] == [HUB]
    assert listed[0]["root"] == MODEL and listed[0]["max_model_len"] > 0
    by_alias = await http.post("/v1/completions", json={"model": "smol", "prompt": "Hi"})
    assert by_alias.status_code == 200, by_alias.text
    assert by_alias.json()["model"] == HUB and by_alias.json()["choices"][0]["text"] == "Hello"
    chat = await http.post("/v1/chat/completions", json={
        "model": HUB, "messages": [{"role": "user", "content": "hi"}]})
    assert chat.status_code == 200 and chat.json()["model"] == HUB
    tokens = await http.post("/tokenize", json={"model": "smol", "prompt": "Hello"})
    assert tokens.status_code == 200 and tokens.json()["count"] > 0
    # both went to the first name's queues, counted under its label
    assert [r.model for r in engine.submitted] == [HUB, HUB]
    assert set(app.state.admission.queues) == {HUB}
    metrics = (await http.get("/metrics")).text
    assert sample(metrics, "kvfleet_gateway_requests_total", model=HUB, endpoint="completions",
                  outcome="stop") == 1
    assert 'model="smol"' not in metrics and f'model="{MODEL}"' not in metrics


async def test_the_directory_name_and_unknown_names_are_a_404_in_openai_shape(gateway):
    _app, http = gateway
    for name in (MODEL, "no-such-model"):
        response = await http.post("/v1/completions", json={"model": name, "prompt": "x"})
        assert response.status_code == 404
        assert response.json() == {"error": {
            "message": f"The model `{name}` does not exist.", "type": "not_found_error",
            "param": "model", "code": "model_not_found"}}


async def test_an_adapter_of_an_alias_has_the_first_name_as_parent(gateway, engine, say,
                                                                    tmp_path):
    _app, http = gateway
    say("Hi")
    path = save_adapter(tmp_path / "sql", default_model_config())
    loaded = await http.post("/v1/load_lora_adapter", json={
        "lora_name": "sql", "lora_path": str(path), "base_model_name": "smol"})
    assert loaded.status_code == 200, loaded.text
    taken = await http.post("/v1/load_lora_adapter", json={
        "lora_name": "smol", "lora_path": str(path)})
    assert taken.status_code == 400  # an alias is a served model's name
    cards = {m["id"]: m for m in (await http.get("/v1/models")).json()["data"]}
    assert set(cards) == {HUB, "sql"} and cards["sql"]["parent"] == HUB
    response = await http.post("/v1/completions", json={"model": "sql", "prompt": "Hi"})
    assert response.status_code == 200, response.text
    assert [(r.model, r.lora) for r in engine.submitted] == [(HUB, "sql")]
