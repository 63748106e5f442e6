"""Each request's timeline on this worker (shared/wire/timeline.py): the instants the service
loop sees (taken from a stream, started in the engine, each publication of its tokens), kept
while the request runs here and written to the model's timelines stream when its final event is
published (`--timelines-kept`; 0 keeps none and records nothing).

Token instants are publication times, after Redis accepted the event: a client sees a token no
sooner, so coalescing (`--publish-interval-ms`) and a slow Redis show in the gaps as they would
to the client. A request that leaves before its end (handed to a peer, fenced, cancelled before
its final event) leaves no timeline here; the worker that finishes it records its own.

With tracing on (`--otlp-traces-endpoint`) the same instants make the request's spans here
(worker/tracing.py), of a request that leaves early too; the instants are then kept even with
`--timelines-kept 0`, which still writes none to the stream.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from kvfleet.shared.wire import Usage
from kvfleet.shared.wire.timeline import RequestTimeline
from kvfleet.worker.protocol import Delivery, Publication
from kvfleet.worker.tracing import RequestSpans


@dataclass
class _Running:
    created: float
    pulled: float
    prompt_tokens: int
    deliveries: int
    traceparent: str = ""  # the gateway's span, for this worker's spans
    started: float = 0.0
    resumed: int = 0
    first: float = 0.0
    last: float = 0.0
    tokens: int = 0
    gaps: int = 0
    gap_sum_s: float = 0.0
    gap_max_s: float = 0.0


class TimelineRecorder:
    def __init__(self, worker_id: str, kept: int, clock: Callable[[], float] = time.time, *,
                 spans: RequestSpans | None = None):
        self.worker_id = worker_id
        self.stores = kept > 0  # timelines go to the stream
        self.spans = spans  # tracing on: the spans made from them
        self.enabled = self.stores or spans is not None
        self._clock = clock
        self._running: dict[str, _Running] = {}

    def pulled(self, deliveries: list[Delivery]) -> None:
        """Taken from their streams now (new, or claimed from a dead worker)."""
        if not self.enabled:
            return
        now = self._clock()
        for delivery in deliveries:
            request = delivery.request
            self._running[request.req_id] = _Running(
                request.created, now, len(request.prompt_token_ids), delivery.times_delivered,
                request.traceparent)

    def started(self, delivery: Delivery, resumed: int) -> None:
        """In the engine now, with `resumed` output tokens from a checkpoint or a peer."""
        if not self.enabled:
            return
        now = self._clock()
        request = delivery.request
        running = self._running.get(request.req_id)
        if running is None:  # a stream handed here: taken and started at once
            running = self._running[request.req_id] = _Running(
                request.created, now, len(request.prompt_token_ids), delivery.times_delivered,
                request.traceparent)
        running.started, running.resumed = now, resumed

    def forget(self, req_id: str) -> None:
        """It left this worker before its end: no timeline here (its spans, with tracing on)."""
        running = self._running.pop(req_id, None)
        if running is not None and self.spans is not None:
            timeline = self._timeline(req_id, running, self._clock(), None, "")
            self.spans.record(timeline, running.traceparent, left=True)

    def published(self, items: list[Publication], accepted: list[bool]) -> list[RequestTimeline]:
        """Redis took these events now (where `accepted`): the timelines they ended."""
        if not self.enabled:
            return []
        now = self._clock()
        ended = []
        for item, ok in zip(items, accepted):
            running = self._running.get(item.req_id)
            if running is None or not ok:
                continue
            if item.event.token_ids:
                if running.tokens:
                    gap = now - running.last
                    running.gaps += 1
                    running.gap_sum_s += gap
                    running.gap_max_s = max(running.gap_max_s, gap)
                else:
                    running.first = now
                running.last = now
                running.tokens += len(item.event.token_ids)
            if item.final_status is not None:
                del self._running[item.req_id]
                timeline = self._timeline(item.req_id, running, now, item.event.usage,
                                          item.event.finish_reason or "")
                ended.append(timeline)
                if self.spans is not None:
                    self.spans.record(timeline, running.traceparent)
        return ended if self.stores else []

    def _timeline(self, req_id: str, running: _Running, end: float, usage: Usage | None,
                  finish: str) -> RequestTimeline:
        return RequestTimeline(
            req_id=req_id, worker=self.worker_id, created=running.created,
            pulled=running.pulled, started=running.started or running.pulled,
            first=running.first, last=running.last, end=end,
            prompt_tokens=usage.prompt_tokens if usage else running.prompt_tokens,
            cached_tokens=usage.cached_tokens if usage else 0, output_tokens=running.tokens,
            resumed=running.resumed, deliveries=running.deliveries, gaps=running.gaps,
            gap_sum_ms=running.gap_sum_s * 1000, gap_max_ms=running.gap_max_s * 1000,
            finish=finish)
