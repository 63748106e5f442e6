"""The gateway's traces (gateway/http/tracing.py, shared/tracing.py): a span per generation
request with OpenTelemetry's GenAI attributes, under the client's `traceparent`; its context
enqueued with every choice (into a real Redis too); nothing installed with tracing off."""

from __future__ import annotations

import asyncio
import json

import httpx
import msgpack
import pytest
import uvicorn
from opentelemetry.trace import SpanKind, StatusCode

from kvfleet.gateway.app import create_app
from kvfleet.gateway.http.tracing import TraceMiddleware
from kvfleet.shared import tracing
from kvfleet.shared.redis_server import free_port
from kvfleet.shared.settings import GatewaySettings
from kvfleet.shared.wire import Keys
from tests.gateway.fake_worker import FakeWorker
from tests.gateway.fakes import token_events
from tests.gateway.helpers import MODEL
from tests.helpers.otlp import exporter, provider  # noqa: F401 (fixtures)

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
CLIENT_TRACEPARENT = f"00-{TRACE_ID}-{CLIENT_SPAN}-01"
MESSAGES = [{"role": "user", "content": "Hi"}]


@pytest.fixture
async def traced(settings, engine, tokenizer, model_info, provider):
    app = create_app(settings, engine, tokenizer, model_info=model_info, tracer_provider=provider)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
        yield client


def traceparent_of_span(span) -> str:
    context = span.context
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{int(context.trace_flags):02x}"


async def test_a_chat_request_span_has_the_genai_attributes_under_the_clients_trace(
        traced, exporter, engine, say):
    say("Hello! How can I help?", cached_tokens=4)
    response = await traced.post("/v1/chat/completions", headers={
        "traceparent": CLIENT_TRACEPARENT}, json={"model": MODEL, "messages": MESSAGES,
                                                  "max_tokens": 20, "temperature": 0.5})
    assert response.status_code == 200
    body = response.json()
    [span] = exporter.get_finished_spans()
    assert span.name == "POST /v1/chat/completions" and span.kind == SpanKind.SERVER
    assert f"{span.context.trace_id:032x}" == TRACE_ID  # the client's trace
    assert f"{span.parent.span_id:016x}" == CLIENT_SPAN and span.parent.is_remote
    attributes = span.attributes
    assert attributes["gen_ai.operation.name"] == "chat"
    assert attributes["gen_ai.request.model"] == MODEL
    assert attributes["gen_ai.request.max_tokens"] == 20
    assert attributes["gen_ai.request.temperature"] == 0.5
    assert attributes["gen_ai.request.id"] == body["id"]
    assert attributes["gen_ai.usage.input_tokens"] == body["usage"]["prompt_tokens"] > 0
    assert attributes["gen_ai.usage.output_tokens"] == body["usage"]["completion_tokens"] > 0
    assert attributes["gen_ai.response.finish_reasons"] == ("stop",)
    assert attributes["http.response.status_code"] == 200
    assert attributes["gen_ai.latency.e2e"] > 0
    assert "x-request-id" in response.headers
    assert attributes["http.request.header.x-request-id"] == (response.headers["x-request-id"],)
    # the context each enqueued choice carries is this span's
    assert [r.traceparent for r in engine.submitted] == [traceparent_of_span(span)]


async def test_a_streamed_completion_span_has_its_ttft_and_each_choices_finish(
        traced, exporter, engine, say):
    ids = say("one two three", eos=False, per_event=1, finish_reason="length")
    response = await traced.post("/v1/completions", json={
        "model": MODEL, "prompt": "Count:", "stream": True, "n": 2, "max_tokens": len(ids)})
    assert response.status_code == 200 and "[DONE]" in response.text
    [span] = exporter.get_finished_spans()
    assert span.parent is None  # no traceparent: a trace of its own
    assert span.attributes["gen_ai.operation.name"] == "text_completion"
    assert span.attributes["gen_ai.request.choice.count"] == 2
    assert span.attributes["gen_ai.response.finish_reasons"] == ("length", "length")
    assert span.attributes["gen_ai.usage.output_tokens"] == 2 * len(ids)
    assert 0 < span.attributes["gen_ai.latency.time_to_first_token"] <= \
        span.attributes["gen_ai.latency.e2e"]
    assert [event.name for event in span.events] == ["first_token"]
    assert {r.traceparent for r in engine.submitted} == {traceparent_of_span(span)}


async def test_a_refused_request_still_has_its_span(traced, exporter, engine):
    response = await traced.post("/v1/chat/completions", headers={
        "traceparent": CLIENT_TRACEPARENT}, json={"model": "no-such-model", "messages": MESSAGES})
    assert response.status_code == 404
    [span] = exporter.get_finished_spans()
    assert span.attributes["http.response.status_code"] == 404
    assert f"{span.context.trace_id:032x}" == TRACE_ID
    assert "gen_ai.usage.input_tokens" not in span.attributes and not engine.submitted
    assert span.status.status_code != StatusCode.ERROR  # the client's error, not the server's


async def test_a_fleet_that_cannot_take_the_request_marks_the_span_an_error(traced, exporter,
                                                                           engine):
    engine.unavailable = True  # Redis refuses the enqueue: 503
    response = await traced.post("/v1/chat/completions", json={"model": MODEL,
                                                                "messages": MESSAGES})
    assert response.status_code == 503
    [span] = exporter.get_finished_spans()
    assert span.attributes["http.response.status_code"] == 503
    assert span.status.status_code == StatusCode.ERROR


async def test_other_routes_make_no_span(traced, exporter):
    assert (await traced.get("/v1/models")).status_code == 200
    assert exporter.get_finished_spans() == ()


async def test_tracing_off_installs_nothing_and_enqueues_no_context(http, app, engine, say):
    # `http` serves the default app: no --otlp-traces-endpoint, no provider given
    assert GatewaySettings().otlp_traces_endpoint == ""
    assert tracing.tracer_provider("", tracing.GATEWAY_SERVICE) is None
    assert not any(m.cls is TraceMiddleware for m in app.user_middleware)
    say("Hi")
    response = await http.post("/v1/chat/completions", headers={
        "traceparent": CLIENT_TRACEPARENT}, json={"model": MODEL, "messages": MESSAGES})
    assert response.status_code == 200
    [request] = engine.submitted
    assert request.traceparent == ""
    assert "traceparent" not in msgpack.unpackb(request.pack())  # the record as before


async def test_the_context_goes_into_redis_with_the_request(redis_url, tokenizer, model_info,
                                                            provider, exporter):
    settings = GatewaySettings(redis_url=redis_url, model=MODEL, key_prefix="kvtr:",
                               request_timeout_s=30, first_event_timeout_s=5)
    app = create_app(settings, None, tokenizer, model_info=model_info, tracer_provider=provider)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    task = asyncio.create_task(server.serve())
    ids = tokenizer.encode("Hello there!")

    def script(request):
        return token_events(ids + [2], prompt_tokens=len(request.prompt_token_ids))
    try:
        while not server.started:
            await asyncio.sleep(0.02)
        async with FakeWorker(redis_url, Keys("kvtr:"), MODEL, script) as worker:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as http:
                response = await http.post("/v1/chat/completions", headers={
                    "traceparent": CLIENT_TRACEPARENT}, json={"model": MODEL,
                                                              "messages": MESSAGES})
            assert response.status_code == 200, response.text
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 10)
    [span] = exporter.get_finished_spans()
    [entry] = worker.entries
    payload = msgpack.unpackb(entry[b"payload"], raw=False)
    assert payload["traceparent"] == traceparent_of_span(span)
    assert payload["traceparent"].split("-")[1] == TRACE_ID
    assert worker.received[0].traceparent == payload["traceparent"]
    assert json.loads(response.text)["usage"]["completion_tokens"] == span.attributes[
        "gen_ai.usage.output_tokens"]
