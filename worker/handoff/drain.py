"""A worker's drain (SIGTERM, or the drain key): take nothing new, hand its streams to peers with
their KV (`Handoffs.offer_streams` each turn), finish the rest, leave within --drain-timeout-s
(docs/RELIABILITY.md, "A worker told to stop")."""

from __future__ import annotations

import logging
import time

from shared.redis_connect import REDIS_FAILURES

log = logging.getLogger(__name__)


class Drain:
    """The drain of one worker (`WorkerService.drainer`); the loop thread calls it."""

    def __init__(self, service):
        """`service`: the worker.service.WorkerService it drains (which imports this module)."""
        self.service = service
        self.deadline: float | None = None  # time.monotonic() when the drain ends at the latest

    @property
    def active(self) -> bool:
        return self.deadline is not None

    def begin(self) -> None:
        """Give back what holds no KV yet (a peer starts it at once); the rest is offered to
        peers with room turn by turn, or finished here."""
        service = self.service
        timeout_s = service.settings.drain_timeout_s
        self.deadline = time.monotonic() + timeout_s
        service.metrics.draining.set(1)
        log.info("draining: %d requests here; handing them to peers within %.0f s",
                 len(service.inflight), timeout_s)
        for req_id, inflight in list(service.inflight.items()):
            if service.engine.kv_bytes_of(req_id) == 0:  # queued, or preempted for recompute
                service.engine.abort(req_id)
                del service.inflight[req_id]
                service.give_back(inflight)

    def over(self) -> bool:
        """Whether the drain is over: nothing left here, or its time is up (then what is left
        resumes elsewhere from its checkpoint, at once)."""
        service, handoffs = self.service, self.service.handoffs
        if not service.inflight and not handoffs.busy:
            log.info("drained: %d streams handed to peers with their KV", handoffs.num_out)
            self._end()
            return True
        if time.monotonic() < self.deadline:
            return False
        log.warning("drain timeout: %d requests left resume elsewhere from their checkpoints",
                    len(service.inflight) + len(handoffs.handed))
        handoffs.withdraw_all()
        handoffs.give_back_handed()
        for req_id, inflight in list(service.inflight.items()):
            service.engine.abort(req_id)
            del service.inflight[req_id]
            service.metrics.handoff_fallback("given_back")
            service.give_back(inflight)
        self._end()
        return True

    def _end(self) -> None:
        try:
            self.service.handoffs.redis.clear_drain()
        except REDIS_FAILURES:
            pass
