"""A worker's spans of its requests (docs/OPERATIONS.md, "Traces"; shared/tracing.py sets
tracing up), made from the instants its timeline recorder keeps (worker/timelines.py): no
timing of their own, no span per token or per step, nothing in the loop until a request leaves.

When a request's final event is published, or it leaves this worker before its end (handed to
a peer, given back in a drain, fenced by a newer attempt, refused), its spans are made at once,
with the times they had, under the context the gateway put in the request
(`GenerationRequest.traceparent`; none: a trace of their own):

    queue        created -> pulled   in a stream until this worker took it (first delivery only)
    worker       pulled  -> end      this worker's part, with the request's attributes; an
                                     event `started` when it entered the engine (after fencing
                                     its attempt), `left` when it left before its end
      prefill    started -> first    the engine's wait, the prompt's chunks, the first token
      decode     first   -> last     the later tokens (published)

A resume (after a dead worker, a drain's give-back, a handoff) is a second `worker` span of the
same trace, from the worker that continued it, with `kvfleet.resumed_tokens` and
`kvfleet.deliveries` saying so.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from opentelemetry.trace import SpanKind, Status, StatusCode, set_span_in_context

from kvfleet.shared.tracing import context_of

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider

    from kvfleet.shared.wire.timeline import RequestTimeline


def _ns(unix_s: float) -> int:
    return int(unix_s * 1e9)


class RequestSpans:
    """Makes the spans of the requests that end or leave here."""

    def __init__(self, provider: TracerProvider, model: str):
        self._tracer = provider.get_tracer("kvfleet.worker")
        self.model = model

    @classmethod
    def of(cls, provider: TracerProvider | None, model: str) -> RequestSpans | None:
        """None without a provider: tracing off."""
        return cls(provider, model) if provider is not None else None

    def record(self, timeline: RequestTimeline, traceparent: str, left: bool = False) -> None:
        """The spans of one request's time here; `left`: it left before its end."""
        parent = context_of({"traceparent": traceparent} if traceparent else {})
        first_here = timeline.deliveries <= 1 and not timeline.resumed
        if first_here and 0 < timeline.created <= timeline.pulled:
            self._tracer.start_span(
                "queue", parent, kind=SpanKind.CONSUMER, start_time=_ns(timeline.created),
                attributes={"gen_ai.request.id": timeline.req_id}).end(_ns(timeline.pulled))
        worker = self._tracer.start_span(
            "worker", parent, kind=SpanKind.CONSUMER, start_time=_ns(timeline.pulled),
            attributes=self._attributes(timeline, left))
        if timeline.started:
            worker.add_event("started", timestamp=_ns(timeline.started))
        if left:
            worker.add_event("left", timestamp=_ns(timeline.end))
        elif timeline.finish == "error":
            worker.set_status(Status(StatusCode.ERROR, "the request failed here"))
        inside = set_span_in_context(worker)
        started = timeline.started or timeline.pulled
        phases = []
        if timeline.first:
            phases.append(("prefill", started, timeline.first))
            if timeline.last > timeline.first:
                phases.append(("decode", timeline.first, timeline.last))
        elif timeline.started and not left:  # no token here: its prefill ran to the end
            phases.append(("prefill", started, timeline.end))
        for name, start, end in phases:
            self._tracer.start_span(name, inside, start_time=_ns(start)).end(_ns(end))
        worker.end(_ns(timeline.end))

    def _attributes(self, timeline: RequestTimeline, left: bool) -> dict:
        attributes = {
            "gen_ai.request.id": timeline.req_id, "gen_ai.request.model": self.model,
            "kvfleet.worker.id": timeline.worker,
            "gen_ai.usage.input_tokens": timeline.prompt_tokens,
            "gen_ai.usage.output_tokens": timeline.output_tokens,
            "gen_ai.usage.cache_read.input_tokens": timeline.cached_tokens,
            "kvfleet.resumed_tokens": timeline.resumed,
            "kvfleet.deliveries": timeline.deliveries, "kvfleet.left": left}
        if timeline.finish:
            attributes["gen_ai.response.finish_reasons"] = [timeline.finish]
        if timeline.created and timeline.deliveries <= 1 and not timeline.resumed:
            attributes["gen_ai.latency.time_in_queue"] = timeline.pulled - timeline.created
            if timeline.first:
                attributes["gen_ai.latency.time_to_first_token"] = (
                    timeline.first - timeline.created)
        if timeline.gaps:
            attributes["kvfleet.gap_max_ms"] = timeline.gap_max_ms
        return attributes
