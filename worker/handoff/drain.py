"""A worker's drain (SIGTERM, or the drain key): take nothing new, hand its streams to peers with
their KV (`Handoffs.offer_streams` each turn), finish the rest, leave within --drain-timeout-s
(docs/RELIABILITY.md, "A worker told to stop")."""

from __future__ import annotations

import logging
import time

from kvfleet.shared.redis_connect import REDIS_FAILURES
from kvfleet.worker.engine.engine import Engine
from kvfleet.worker.handoff.coordinator import Handoffs
from kvfleet.worker.inflight import InflightTable, StreamCalls
from kvfleet.worker.metrics import WorkerMetrics

log = logging.getLogger(__name__)


class Drain:
    """The drain of one worker (`WorkerService.drainer`); the loop thread calls it."""

    def __init__(self, timeout_s: float, engine: Engine, metrics: WorkerMetrics,
                 inflight: InflightTable, handoffs: Handoffs, streams: StreamCalls):
        """`inflight`: the streams the loop serves (shared with it and the handoffs)."""
        self.timeout_s, self.engine, self.metrics = timeout_s, engine, metrics
        self.inflight, self.handoffs, self.streams = inflight, handoffs, streams
        self.deadline: float | None = None  # time.monotonic() when the drain ends at the latest

    @property
    def active(self) -> bool:
        return self.deadline is not None

    def begin(self) -> None:
        """Give back what holds no KV yet (a peer starts it at once); the rest is offered to
        peers with room turn by turn, or finished here."""
        self.deadline = time.monotonic() + self.timeout_s
        self.metrics.draining.set(1)
        log.info("draining: %d requests here; handing them to peers within %.0f s",
                 len(self.inflight), self.timeout_s)
        for req_id, inflight in self.inflight.items():
            if self.engine.kv_bytes_of(req_id) == 0:  # queued, or preempted for recompute
                self.engine.abort(req_id)
                self.inflight.pop(req_id)
                self.streams.give_back(inflight)

    def over(self) -> bool:
        """Whether the drain is over: nothing left here, or its time is up (then what is left
        resumes elsewhere from its checkpoint, at once)."""
        handoffs = self.handoffs
        if not self.inflight and not handoffs.busy:
            log.info("drained: %d streams handed to peers with their KV", handoffs.num_out)
            self._end()
            return True
        if time.monotonic() < self.deadline:
            return False
        log.warning("drain timeout: %d requests left resume elsewhere from their checkpoints",
                    len(self.inflight) + len(handoffs.handed))
        handoffs.withdraw_all()
        handoffs.give_back_handed()
        for req_id, inflight in self.inflight.items():
            self.engine.abort(req_id)
            self.inflight.pop(req_id)
            self.metrics.handoff_fallback("given_back")
            self.streams.give_back(inflight)
        self._end()
        return True

    def _end(self) -> None:
        try:
            self.handoffs.redis.clear_drain()
        except REDIS_FAILURES:
            pass
