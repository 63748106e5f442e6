"""OpenTelemetry traces of the gateway and the workers (docs/OPERATIONS.md, "Traces").

Off unless `--otlp-traces-endpoint` is set: then a process has its own tracer provider (not the
global one) with service name `kvfleet-gateway` or `kvfleet-worker` (`OTEL_SERVICE_NAME` wins)
and a batch span processor sending OTLP to that endpoint over HTTP/protobuf, or gRPC where
`OTEL_EXPORTER_OTLP_TRACES_PROTOCOL` (or `OTEL_EXPORTER_OTLP_PROTOCOL`) says `grpc`. The SDK and
the exporter are imported only then: a process without the setting makes no provider, no
exporter and no thread, and its spans are the API's non-recording ones.

Across Redis the context travels as a W3C `traceparent` text in the request
(`GenerationRequest.traceparent`): the gateway writes its request span's, a worker reads it to
open its spans under that span, whichever attempt it serves.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter

GATEWAY_SERVICE = "kvfleet-gateway"
WORKER_SERVICE = "kvfleet-worker"
TRACEPARENT = "traceparent"
PROTOCOL_VARIABLES = ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL")

_PROPAGATOR = TraceContextTextMapPropagator()
log = logging.getLogger(__name__)


def tracer_provider(endpoint: str, service_name: str, instance: str = ""
                    ) -> TracerProvider | None:
    """The process's tracer provider exporting to `endpoint` (`--otlp-traces-endpoint`); None
    when it is empty (tracing off). `instance`: `service.instance.id` (a worker's id). The
    sampler is the SDK's from `OTEL_TRACES_SAMPLER` (default: every trace, or as its parent)."""
    if not endpoint:
        return None
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    attributes = {}
    if not _service_name_given():
        attributes["service.name"] = service_name
    if instance:
        attributes["service.instance.id"] = instance
    provider = TracerProvider(resource=Resource.create(attributes))
    provider.add_span_processor(BatchSpanProcessor(span_exporter(endpoint)))
    log.info("OpenTelemetry traces of %s to %s", attributes.get("service.name", service_name),
             endpoint)
    return provider


def _service_name_given() -> bool:
    resource = os.environ.get("OTEL_RESOURCE_ATTRIBUTES", "")
    return bool(os.environ.get("OTEL_SERVICE_NAME")) or any(
        entry.strip().startswith("service.name=") for entry in resource.split(","))


def span_exporter(endpoint: str) -> SpanExporter:
    """The OTLP exporter of the protocol the standard variables name (default `http/protobuf`).
    Over HTTP an endpoint without a path gets `/v1/traces` (`http://collector:4318`); its other
    settings (headers, timeout, compression, certificates) are read from the `OTEL_EXPORTER_OTLP_*`
    variables by the exporter itself. ValueError: a protocol that cannot be served here."""
    protocol = next((os.environ[name] for name in PROTOCOL_VARIABLES if os.environ.get(name)),
                    "http/protobuf").strip().lower()
    if protocol == "grpc":
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        except ImportError:
            raise ValueError("OTLP over gRPC needs the opentelemetry-exporter-otlp-proto-grpc "
                             "package (not installed); or leave OTEL_EXPORTER_OTLP_TRACES_PROTOCOL "
                             "unset for OTLP over HTTP") from None
        return OTLPSpanExporter(endpoint=endpoint)
    if protocol != "http/protobuf":
        raise ValueError(f"OTLP protocol {protocol!r}: expected http/protobuf or grpc")
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter(endpoint=traces_url(endpoint))


def traces_url(endpoint: str) -> str:
    """An OTLP/HTTP traces URL: the endpoint as given, `/v1/traces` added where it has no path."""
    parts = urlsplit(endpoint)
    if not parts.scheme:
        raise ValueError(f"--otlp-traces-endpoint {endpoint!r}: a URL expected "
                         f"(http://collector:4318)")
    return endpoint.rstrip("/") + "/v1/traces" if parts.path in ("", "/") else endpoint


def traceparent_of(span: trace.Span) -> str:
    """The W3C `traceparent` of `span` ('' for a span that is not recorded)."""
    context = span.get_span_context()
    if not context.is_valid:
        return ""
    # what TraceContextTextMapPropagator.inject writes (version 00), without its carrier
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{int(context.trace_flags):02x}"


def context_of(headers: dict[str, str]) -> Context:
    """The context a `traceparent` (and `tracestate`) header names; an empty one without a valid
    header (a new trace then)."""
    return _PROPAGATOR.extract(headers)
