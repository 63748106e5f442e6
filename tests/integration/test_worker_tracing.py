"""A worker's spans (worker/tracing.py) with a tiny model and a real Redis: opened under the
context the request carries through Redis (`GenerationRequest.traceparent`), the phases from the
timeline's instants, a resume on another worker and a drain's handoff in the same trace, a
request without a context in a trace of its own, and nothing with tracing off."""

from __future__ import annotations

import time

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kvfleet.shared.tracing import traceparent_of
from kvfleet.shared.wire import GenerationRequest, SamplingParams
from tests.engine.tiny_models import TinyModel, random_prompt
from tests.helpers.channels import fleet_keys
from tests.integration.test_worker_service import Client, make_service, run_until
from tests.helpers.otlp import exporter, provider  # noqa: F401 (fixtures)


@pytest.fixture(scope="module")
def tiny() -> TinyModel:
    return TinyModel("llama")


@pytest.fixture
def client(redis_client) -> Client:
    return Client(redis_client, fleet_keys(redis_client))


def gateway_span(provider: TracerProvider):
    """A span standing for the gateway's request span (another process in a fleet)."""
    span = provider.get_tracer("test-gateway").start_span("POST /v1/completions")
    span.end()
    return span


def spans_by_name(exporter: InMemorySpanExporter) -> dict[str, list]:
    found: dict[str, list] = {}
    for span in exporter.get_finished_spans():
        found.setdefault(span.name, []).append(span)
    return found


def test_the_workers_spans_are_children_of_the_propagated_context(redis_url, client, tiny,
                                                                  provider, exporter):
    worker = make_service(redis_url, tiny, "w1", tracer_provider=provider)
    parent = gateway_span(provider)
    prompt = random_prompt(11, seed=1)
    req_id = client.send(prompt, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True),
                         created=time.time(), traceparent=traceparent_of(parent))
    # the context is in Redis with the request (its hash and its stream entry)
    record = client.redis.hget(client.keys.request(req_id), "payload")
    assert GenerationRequest.unpack(record).traceparent == traceparent_of(parent)
    run_until(worker, lambda: client.final(req_id))

    spans = spans_by_name(exporter)
    assert sorted(spans) == ["POST /v1/completions", "decode", "prefill", "queue", "worker"]
    [queue], [mine], [prefill], [decode] = (
        spans[n] for n in ("queue", "worker", "prefill", "decode"))
    trace_id, parent_id = parent.context.trace_id, parent.context.span_id
    for span in (queue, mine, prefill, decode):
        assert span.context.trace_id == trace_id
    assert queue.parent.span_id == mine.parent.span_id == parent_id  # under the gateway's span
    assert prefill.parent.span_id == decode.parent.span_id == mine.context.span_id
    # the timeline's instants, in order
    [started] = mine.events
    assert started.name == "started"
    assert queue.start_time <= queue.end_time == mine.start_time <= started.timestamp
    assert started.timestamp == prefill.start_time <= prefill.end_time == decode.start_time
    assert decode.end_time <= mine.end_time
    attributes = mine.attributes
    assert attributes["gen_ai.request.id"] == req_id
    assert attributes["gen_ai.request.model"] == "tiny"
    assert attributes["kvfleet.worker.id"] == "w1"
    assert attributes["gen_ai.usage.input_tokens"] == len(prompt)
    assert attributes["gen_ai.usage.output_tokens"] == 5
    assert attributes["gen_ai.response.finish_reasons"] == ("length",)
    assert attributes["kvfleet.deliveries"] == 1 and attributes["kvfleet.resumed_tokens"] == 0
    assert attributes["kvfleet.left"] is False
    assert 0 <= attributes["gen_ai.latency.time_in_queue"] < \
        attributes["gen_ai.latency.time_to_first_token"]


def test_a_request_without_a_context_is_served_in_a_trace_of_its_own(redis_url, client, tiny,
                                                                     provider, exporter):
    worker = make_service(redis_url, tiny, "w1", tracer_provider=provider)
    req_id = client.send(random_prompt(7, seed=3), SamplingParams(max_tokens=3, temperature=0.0,
                                                                  ignore_eos=True))
    run_until(worker, lambda: client.final(req_id))
    assert client.final(req_id).finish_reason == "length"
    [mine] = spans_by_name(exporter)["worker"]
    assert mine.parent is None and mine.context.is_valid
    # no `created`: no queue span (an unknown enqueue time)
    assert "queue" not in spans_by_name(exporter)


def test_a_resume_on_another_worker_continues_the_same_trace(redis_url, client, tiny, provider,
                                                             exporter):
    parent = gateway_span(provider)
    dying = make_service(redis_url, tiny, "dying", tracer_provider=provider)
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    req_id = client.send(random_prompt(9, seed=2), params, created=time.time(),
                         traceparent=traceparent_of(parent))
    run_until(dying, lambda: (client.drain(), len(client.text(req_id)) >= 6)[1])
    time.sleep(0.4)  # `dying` stops without a word: its heartbeat goes, its entry idles
    rescuer = make_service(redis_url, tiny, "rescuer", tracer_provider=provider)
    run_until(rescuer, lambda: client.final(req_id))
    dying.run_once()  # it wakes up, is fenced off and drops the request: its spans end
    dying.run_once()

    workers = {s.attributes["kvfleet.worker.id"]: s for s in spans_by_name(exporter)["worker"]}
    assert sorted(workers) == ["dying", "rescuer"]
    for span in workers.values():
        assert span.context.trace_id == parent.context.trace_id
        assert span.parent.span_id == parent.context.span_id
    rescued = workers["rescuer"].attributes
    assert rescued["kvfleet.deliveries"] == 2 and rescued["kvfleet.resumed_tokens"] >= 6
    assert rescued["gen_ai.response.finish_reasons"] == ("length",)
    assert "gen_ai.latency.time_in_queue" not in rescued  # a resume's wait is no queueing
    assert workers["dying"].attributes["kvfleet.left"] is True
    assert [e.name for e in workers["dying"].events] == ["started", "left"]
    assert len(spans_by_name(exporter)["queue"]) == 1  # the first delivery's only


def test_a_drains_handoff_continues_the_same_trace_on_the_taker(redis_url, client, tiny,
                                                                provider, exporter):
    from tests.integration.test_handoff_service import metric, service, step_all, workers

    parent = gateway_span(provider)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    source = service(redis_url, tiny, "source", tracer_provider=provider)
    req_id = client.send(random_prompt(20, seed=41), params, created=time.time(),
                         traceparent=traceparent_of(parent))
    step_all(workers(source), lambda: len(client.text(req_id)) >= 3 or client.drain())
    taker = service(redis_url, tiny, "taker", tracer_provider=provider)
    source.drain.set()
    step_all(workers(source, taker), lambda: client.final(req_id))
    assert source.exited  # its drain handed the stream over with its KV
    assert metric(taker, "kvfleet_worker_handoffs_total", direction="in") == 1

    spans = {s.attributes["kvfleet.worker.id"]: s for s in spans_by_name(exporter)["worker"]}
    assert sorted(spans) == ["source", "taker"]
    for span in spans.values():
        assert span.context.trace_id == parent.context.trace_id
        assert span.parent.span_id == parent.context.span_id
    handed, took = spans["source"], spans["taker"]
    assert handed.attributes["kvfleet.left"] is True
    assert "gen_ai.response.finish_reasons" not in handed.attributes
    assert handed.end_time <= took.end_time
    assert took.attributes["kvfleet.resumed_tokens"] >= 3
    assert took.attributes["gen_ai.response.finish_reasons"] == ("length",)
    assert took.attributes["gen_ai.usage.output_tokens"] == \
        24 - took.attributes["kvfleet.resumed_tokens"]


def test_tracing_off_makes_no_spans_and_keeps_no_instants_without_timelines(redis_url, client,
                                                                            tiny):
    off = make_service(redis_url, tiny, "off", timelines_kept=0)
    assert off.timelines.spans is None and not off.timelines.enabled
    traced = make_service(redis_url, tiny, "traced", timelines_kept=0,
                          tracer_provider=TracerProvider())
    # negative control: a provider turns the instants on, the stream stays empty
    assert traced.timelines.spans is not None and traced.timelines.enabled
    req_id = client.send(random_prompt(5, seed=4), SamplingParams(max_tokens=2, temperature=0.0,
                                                                  ignore_eos=True))
    run_until(traced, lambda: client.final(req_id))
    assert client.redis.xlen(client.keys.timelines("tiny")) == 0
