"""Metrics and the dashboard as `create_app` wires them: a real completion through the app moves
the TTFT and token counters; `/dashboard` is served when the engine client is a Redis one."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvfleet.gateway.app import create_app
from kvfleet.shared.settings import GatewaySettings
from tests.gateway.helpers import MODEL, sse_events


def samples(text: str) -> dict[tuple[str, frozenset], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(text: str, name: str, **labels: str) -> float:
    return samples(text).get((name, frozenset({"model": MODEL, **labels}.items())), 0.0)


async def test_completion_moves_ttft_and_token_counters(http, say):
    ids = say("Hello there, friend!")
    response = await http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi"})
    assert response.status_code == 200, response.text
    streamed = await http.post("/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True})
    assert sse_events(streamed.text)[-1] == "[DONE]"
    metrics = (await http.get("/metrics")).text
    assert value(metrics, "kvfleet_gateway_time_to_first_token_seconds_count") == 2
    assert value(metrics, "kvfleet_gateway_output_tokens_total") == 2 * len(ids)
    assert value(metrics, "kvfleet_gateway_prompt_tokens_total") > 0
    assert value(metrics, "kvfleet_gateway_requests_total", endpoint="completions",
                 outcome="stop") == 1
    assert value(metrics, "kvfleet_gateway_requests_total", endpoint="chat", outcome="stop") == 1
    assert value(metrics, "kvfleet_gateway_requests_in_flight") == 0
    assert value(metrics, "kvfleet_gateway_inter_token_latency_seconds_count") > 0


async def test_rejections_are_counted_and_leave_nothing_in_flight(http, say):
    say("x")
    assert (await http.post("/v1/completions", json={"model": "nope", "prompt": "Hi"})
            ).status_code == 404
    assert (await http.post("/v1/completions", content=b"{bad json")).status_code == 400
    metrics = (await http.get("/metrics")).text
    assert value(metrics, "kvfleet_gateway_requests_total", endpoint="completions",
                 outcome="404") == 1
    assert value(metrics, "kvfleet_gateway_requests_total", endpoint="completions",
                 outcome="400") == 1
    assert value(metrics, "kvfleet_gateway_requests_in_flight") == 0


async def test_length_outcome_when_any_choice_hits_its_limit(http, say):
    say("one two three four five six seven", eos=False, finish_reason="length")
    response = await http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "n": 2})
    assert response.status_code == 200
    metrics = (await http.get("/metrics")).text
    assert value(metrics, "kvfleet_gateway_requests_total", endpoint="completions",
                 outcome="length") == 1


async def test_dashboard_is_served_with_a_redis_client(redis_url, tokenizer, model_info):
    settings = GatewaySettings(redis_url=redis_url, model=MODEL, key_prefix="kvdash:")
    app = create_app(settings, None, tokenizer, model_info=model_info)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as http:
            page = await http.get("/dashboard")
            data = await http.get("/dashboard/data")
    assert page.status_code == 200 and "<html" in page.text.lower()
    assert data.status_code == 200, data.text
    assert data.json()["model"] == MODEL and data.json()["workers"] == []


async def test_no_dashboard_without_redis(http):
    assert (await http.get("/dashboard")).status_code == 404
