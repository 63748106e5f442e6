"""benchmarks/tracing_cost.py's OTLP receiver takes what the fleet's own exporter sends."""

from __future__ import annotations

import httpx

from benchmarks.tracing_cost import OtlpSink
from kvfleet.shared.tracing import tracer_provider


def test_the_sink_receives_the_fleets_exports():
    sink = OtlpSink()
    try:
        provider = tracer_provider(sink.url, "kvfleet-test")
        with provider.get_tracer("t").start_as_current_span("request"):
            pass
        provider.force_flush()
        provider.shutdown()
        assert sink.exports == 1 and sink.bytes > 20  # one protobuf export with the span
        answer = httpx.post(sink.url, content=b"\x00" * 7)
        assert answer.status_code == 200 and sink.exports == 2 and sink.bytes > 27
    finally:
        sink.close()
