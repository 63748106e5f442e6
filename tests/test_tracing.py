"""Tracing's setup (shared/tracing.py): off without an endpoint; with one, real OTLP/HTTP
requests reach a receiver (an in-process HTTP server decoding the protobuf) with the process's
service name; the standard variables choose the protocol and the name."""

from __future__ import annotations

import pytest

from kvfleet.shared import tracing
from kvfleet.shared.settings import WorkerSettings
from tests.helpers.otlp import Receiver


@pytest.fixture
def receiver():
    receiver = Receiver()
    yield receiver
    receiver.close()


@pytest.fixture(autouse=True)
def no_otel_variables(monkeypatch):
    for name in ("OTEL_SERVICE_NAME", "OTEL_RESOURCE_ATTRIBUTES", "OTEL_TRACES_SAMPLER",
                 *tracing.PROTOCOL_VARIABLES):
        monkeypatch.delenv(name, raising=False)


def test_off_by_default_no_provider():
    assert WorkerSettings().otlp_traces_endpoint == ""
    assert tracing.tracer_provider("", tracing.WORKER_SERVICE) is None


def test_spans_reach_an_otlp_http_receiver_with_the_service_name(receiver):
    provider = tracing.tracer_provider(receiver.url, tracing.WORKER_SERVICE, "w-7")
    with provider.get_tracer("test").start_as_current_span("worker") as span:
        traceparent = tracing.traceparent_of(span)
    provider.shutdown()  # exports what is left
    [(path, _)] = receiver.requests
    assert path == "/v1/traces"  # added to an endpoint without a path
    [(resource, received)] = receiver.spans()
    assert resource["service.name"] == "kvfleet-worker"
    assert resource["service.instance.id"] == "w-7"
    assert received.name == "worker"
    assert traceparent.startswith(f"00-{received.trace_id.hex()}-{received.span_id.hex()}-")


def test_otel_service_name_wins(receiver, monkeypatch):
    monkeypatch.setenv("OTEL_SERVICE_NAME", "gateway-eu-1")
    provider = tracing.tracer_provider(receiver.url + "/custom/path", tracing.GATEWAY_SERVICE)
    provider.get_tracer("test").start_span("x").end()
    provider.shutdown()
    [(path, _)] = receiver.requests
    assert path == "/custom/path"  # a path given is used as it is
    assert receiver.spans()[0][0]["service.name"] == "gateway-eu-1"


def test_the_protocol_variables(monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/json")
    with pytest.raises(ValueError, match="http/json"):
        tracing.span_exporter("http://collector:4318")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "grpc")
    try:
        import opentelemetry.exporter.otlp.proto.grpc  # noqa: F401
    except ImportError:
        with pytest.raises(ValueError, match="opentelemetry-exporter-otlp-proto-grpc"):
            tracing.span_exporter("http://collector:4317")
    else:
        assert "grpc" in type(tracing.span_exporter("http://collector:4317")).__module__
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")  # the general variable
    assert "http" in type(tracing.span_exporter("http://collector:4318")).__module__


def test_traces_url():
    assert tracing.traces_url("http://collector:4318") == "http://collector:4318/v1/traces"
    assert tracing.traces_url("http://collector:4318/") == "http://collector:4318/v1/traces"
    assert tracing.traces_url("https://c/otlp/v1/traces") == "https://c/otlp/v1/traces"
    with pytest.raises(ValueError, match="a URL expected"):
        tracing.traces_url("/v1/traces")


def test_a_context_round_trips_and_garbage_is_no_context():
    from opentelemetry import trace

    parent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    context = trace.get_current_span(tracing.context_of({"traceparent": parent}))
    assert f"{context.get_span_context().span_id:016x}" == "00f067aa0ba902b7"
    garbage = trace.get_current_span(tracing.context_of({"traceparent": "not-a-context"}))
    assert not garbage.get_span_context().is_valid
    assert tracing.traceparent_of(trace.INVALID_SPAN) == ""
