"""The gateway's spans (docs/OPERATIONS.md, "Traces"; shared/tracing.py sets tracing up).

`TraceMiddleware` opens one SERVER span per generation request (`POST /v1/chat/completions`,
`POST /v1/completions`), under the client's W3C `traceparent` when it sends one, and keeps it
current while the handler runs and the answer streams; the HTTP status ends it. The handler
fills it in through a `RequestSpan` (OpenTelemetry's GenAI attributes: model, token counts,
finish reasons; vLLM's names where those have none: request id, TTFT, end to end) and passes
the span's context on with every choice it enqueues (`GenerationRequest.traceparent`), so the
workers' spans join the trace. The middleware is installed only with tracing on; with it off
`RequestSpan.current` finds the API's non-recording span and answers None.
"""

from __future__ import annotations

from collections.abc import Mapping

from opentelemetry import context, trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvfleet.shared.tracing import context_of, traceparent_of
from kvfleet.shared.wire import GenerationRequest

PROPAGATED = (b"traceparent", b"tracestate")
# gen_ai.operation.name of each endpoint (OpenTelemetry's GenAI semantic conventions)
OPERATIONS = {"chat": "chat", "completions": "text_completion"}


class TraceMiddleware:
    """ASGI middleware: a span per request to one of `paths` (path -> metrics endpoint)."""

    def __init__(self, app: ASGIApp, tracer: trace.Tracer, paths: Mapping[str, str]):
        self.app = app
        self.tracer = tracer
        self.paths = dict(paths)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "") if scope["type"] == "http" else ""
        if path not in self.paths:
            await self.app(scope, receive, send)
            return
        carrier = {name.decode("latin-1"): value.decode("latin-1")
                   for name, value in scope.get("headers") or () if name in PROPAGATED}
        method = scope.get("method", "POST")
        attributes = {"http.request.method": method, "http.route": path, "url.path": path,
                      "gen_ai.operation.name": OPERATIONS.get(self.paths[path], "")}
        request_id = (scope.get("state") or {}).get("request_id")
        if request_id:
            attributes["http.request.header.x-request-id"] = [request_id]
        span = self.tracer.start_span(f"{method} {path}", context_of(carrier), SpanKind.SERVER,
                                      attributes)

        async def send_traced(message: Message) -> None:
            if message["type"] == "http.response.start":
                status = message["status"]
                span.set_attribute("http.response.status_code", status)
                if status >= 500:
                    span.set_status(Status(StatusCode.ERROR, f"HTTP {status}"))
            await send(message)

        token = context.attach(trace.set_span_in_context(span))  # the handler's current span
        try:
            await self.app(scope, receive, send_traced)
        except BaseException as exc:
            span.record_exception(exc)
            span.set_status(Status(StatusCode.ERROR, type(exc).__name__))
            raise
        finally:
            context.detach(token)
            span.end()


class RequestSpan:
    """The handler's view of its request's span (the current one, the middleware's)."""

    def __init__(self, span: trace.Span):
        self.span = span
        self.traceparent = traceparent_of(span)

    @classmethod
    def current(cls) -> RequestSpan | None:
        """The current request's span; None when none is recorded (tracing off, not sampled)."""
        span = trace.get_current_span()
        return cls(span) if span.is_recording() else None

    def submitted(self, model: str, response_id: str, stream: bool,
                  requests: list[GenerationRequest]) -> None:
        """Its choices, as enqueued: they carry the span's context to the workers."""
        params = requests[0].params
        self.span.set_attributes({
            "gen_ai.request.model": model, "gen_ai.response.model": model,
            "gen_ai.request.id": response_id, "gen_ai.response.id": response_id,
            "gen_ai.request.max_tokens": params.max_tokens,
            "gen_ai.request.temperature": params.temperature,
            "gen_ai.request.top_p": params.top_p,
            "gen_ai.request.choice.count": len(requests), "kvfleet.stream": stream})
        if params.seed is not None:
            self.span.set_attribute("gen_ai.request.seed", params.seed)
        for request in requests:
            request.traceparent = self.traceparent

    def first_token(self, ttft_s: float) -> None:
        """The first output tokens went to the client now."""
        self.span.set_attribute("gen_ai.latency.time_to_first_token", ttft_s)
        self.span.add_event("first_token")

    def finish(self, outcome: str, prompt_tokens: int, completion_tokens: int, e2e_s: float,
               reasons: list[str | None] | None = None) -> None:
        """The answer ended: `outcome` as the metrics count it, the usage, each choice's finish
        reason (a choice without one: ``)."""
        self.span.set_attributes({
            "gen_ai.usage.input_tokens": prompt_tokens,
            "gen_ai.usage.output_tokens": completion_tokens,
            "gen_ai.response.finish_reasons": [r or "" for r in reasons] if reasons
            else [outcome],
            "gen_ai.latency.e2e": e2e_s, "kvfleet.outcome": outcome})
        if outcome == "error":
            self.span.set_status(Status(StatusCode.ERROR, "the fleet failed mid-answer"))
