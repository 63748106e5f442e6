"""An OTLP/HTTP traces receiver in the test process: what a collector would get from a fleet
with `--otlp-traces-endpoint` (tests/test_tracing.py, tests/e2e/test_traces.py); and an in-memory
exporter with its tracer provider, as fixtures (the gateway's and the worker's tracing tests)."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter


@pytest.fixture
def exporter() -> InMemorySpanExporter:
    """The spans a test's tracer provider ends, in memory."""
    return InMemorySpanExporter()


@pytest.fixture
def provider(exporter) -> TracerProvider:
    """A tracer provider exporting every span to `exporter` as it ends."""
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield provider
    provider.shutdown()


class Receiver:
    """An OTLP/HTTP traces receiver: each POST's ExportTraceServiceRequest, with its path."""

    def __init__(self):
        self.requests: list[tuple[str, ExportTraceServiceRequest]] = []
        received = self.requests

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers["Content-Length"]))
                received.append((self.path, ExportTraceServiceRequest.FromString(body)))
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def spans(self) -> list[tuple[dict, object]]:
        """(resource attributes, span) of every span received."""
        found = []
        for _path, request in self.requests:
            for resource_spans in request.resource_spans:
                attributes = {a.key: a.value.string_value
                              for a in resource_spans.resource.attributes}
                for scope_spans in resource_spans.scope_spans:
                    found.extend((attributes, span) for span in scope_spans.spans)
        return found

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def span_attributes(span) -> dict:
    """A received span's attributes as Python values (arrays as tuples)."""
    found = {}
    for attribute in span.attributes:
        value = attribute.value
        kind = value.WhichOneof("value")
        if kind == "array_value":
            found[attribute.key] = tuple(getattr(v, v.WhichOneof("value"))
                                         for v in value.array_value.values)
        else:
            found[attribute.key] = getattr(value, kind)
    return found
