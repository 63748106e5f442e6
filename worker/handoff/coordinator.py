"""The worker loop's side of KV handoffs: offering streams, handing them over between two steps,
taking offered streams when the pool has room, and every fallback (shared/wire/handoff.py has
the protocol, worker/handoff/transfer.py the bytes).

Threads: the loop thread calls every method but `_provide` (a transfer-plane connection's thread:
it queues an ask and waits for the loop to answer it between two steps) and `_fetch` (a fetch
thread: the transfer and the decoding of a taken stream, off the loop, so the taker's own
streams keep stepping meanwhile).
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from collections.abc import Callable
from dataclasses import dataclass, field

from kvfleet.shared.redis_connect import REDIS_FAILURES
from kvfleet.shared.settings import WorkerSettings
from kvfleet.shared.wire.handoff import HandoffOffer, new_handoff_id
from kvfleet.worker.engine.engine import Engine
from kvfleet.worker.engine.core.handoff import HandoffError, SequenceState
from kvfleet.worker.handoff.peer_prefixes import PREFIX_ID
from kvfleet.worker.handoff.protocol import HandoffProtocol
from kvfleet.worker.handoff.transfer import Outgoing, TransferError, TransferPlane
from kvfleet.worker.inflight import Inflight, InflightTable, StreamCalls
from kvfleet.worker.metrics import WorkerMetrics
from kvfleet.worker.numerics import FleetNumerics
from kvfleet.worker.protocol import Delivery

log = logging.getLogger(__name__)

ASK_TIMEOUT_S = 5.0  # a taker's ask waits this long for the source's loop to export the stream
OFFER_POLL_S = 0.02  # a taker with room reads the offers at most this often


@dataclass
class _Ask:
    """A taker's request for one offer, answered by the loop between two steps."""

    handoff_id: str
    done: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)
    reply: Outgoing | None = None
    abandoned: bool = False  # the asking thread gave up: export nothing


@dataclass
class _Handed:
    """A stream out of this engine, its KV sent, until its taker fences it or the lease ends."""

    offer: HandoffOffer
    inflight: Inflight
    state: SequenceState
    deadline: float  # time.monotonic() at the lease's end


@dataclass
class _Incoming:
    offer: HandoffOffer
    started: float  # time.monotonic() when the offer was taken
    future: Future


class Handoffs:
    """Offers, hand-overs and takes of one worker (`WorkerService.handoffs`)."""

    def __init__(self, settings: WorkerSettings, engine: Engine, metrics: WorkerMetrics,
                 redis: HandoffProtocol, numerics: FleetNumerics, inflight: InflightTable,
                 streams: StreamCalls, claim_handed: Callable[[str, str], Delivery | None],
                 plane: TransferPlane | None):
        """`inflight`: the streams the loop serves (shared with it and the drain); `streams`:
        the loop's operations on one; `claim_handed`: the protocol's claim of a handed entry."""
        self.settings, self.engine, self.metrics = settings, engine, metrics
        self.redis = redis
        self.numerics = numerics  # whose offers this worker lets others take first
        self.inflight, self.streams, self.claim_handed = inflight, streams, claim_handed
        self.plane = plane
        self.offered: dict[str, HandoffOffer] = {}  # req_id -> its standing offer
        self.handed: dict[str, _Handed] = {}  # req_id -> sent, not yet resolved
        self.incoming: dict[str, _Incoming] = {}  # handoff id -> being fetched
        self.num_out = self.num_in = 0
        self._asks: queue.SimpleQueue[_Ask] = queue.SimpleQueue()
        self._serial = itertools.count()
        self._offers_read_at = 0.0
        self._fetchers = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kv-fetch")
        # a peer's ask for prefix blocks (worker/handoff/peer_prefixes.py), answered between two steps
        self.prefix_provider: Callable[[str], Outgoing | None] | None = None
        self.addr = plane.start(self._provide) if plane is not None else ""

    @property
    def enabled(self) -> bool:
        return self.plane is not None

    def close(self) -> None:
        self._fetchers.shutdown(wait=False, cancel_futures=True)
        if self.plane is not None:
            self.plane.close()

    @property
    def busy(self) -> bool:
        """Streams sent and not yet resolved, or being fetched."""
        return bool(self.handed or self.incoming)

    def reserved_tokens(self) -> int:
        """Room promised to streams being fetched (admission subtracts it)."""
        block = self.engine.config.cache.block_size
        return sum(i.offer.num_tokens + block for i in self.incoming.values())

    # ---- the source -----------------------------------------------------------------------

    def offer_streams(self, reason: str, first_token_out: bool) -> None:
        """Offer every stream here that holds KV and is not offered yet (`first_token_out`:
        only those whose first token went out)."""
        for req_id, inflight in self.inflight.items():
            if req_id in self.offered or req_id in self.handed:
                continue
            if first_token_out and inflight.num_output_tokens == 0:
                continue
            num_bytes = self.engine.kv_bytes_of(req_id)
            if num_bytes == 0:
                continue
            delivery = inflight.delivery
            request = delivery.request
            offer = HandoffOffer(
                new_handoff_id(req_id, self.redis.worker_id, next(self._serial)), req_id,
                self.redis.worker_id, self.addr, delivery.stream, delivery.entry_id,
                num_tokens=len(request.prompt_token_ids) + inflight.num_output_tokens,
                num_bytes=num_bytes, reason=reason, lora=request.lora, created=time.time(),
                numerics=self.redis.numerics)
            self.redis.offer(offer)
            self.offered[req_id] = offer
        self.metrics.handoff_offers.set(len(self.offered))

    def forget(self, req_ids: list[str]) -> None:
        """These requests left this worker (finished, failed, fenced): withdraw their offers."""
        gone = [self.offered.pop(r).handoff_id for r in req_ids if r in self.offered]
        if gone:
            self.redis.withdraw(gone)
            self.metrics.handoff_offers.set(len(self.offered))

    def withdraw_all(self) -> None:
        self.forget(list(self.offered))

    def _provide(self, handoff_id: str) -> Outgoing | None:
        """A transfer-plane thread: ask the loop for the stream, wait for its answer."""
        ask = _Ask(handoff_id)
        self._asks.put(ask)
        if ask.done.wait(ASK_TIMEOUT_S):
            return ask.reply
        with ask.lock:
            if ask.done.is_set():
                return ask.reply
            ask.abandoned = True
            return None

    def serve_asks(self) -> None:
        """Between two steps: hand over every stream a taker asked for, copy every prefix a
        peer asked for."""
        while True:
            try:
                ask = self._asks.get_nowait()
            except queue.Empty:
                return
            with ask.lock:
                if ask.abandoned:
                    continue
                try:
                    if ask.handoff_id.startswith(PREFIX_ID):
                        provide = self.prefix_provider
                        ask.reply = None if provide is None else provide(ask.handoff_id)
                    else:
                        ask.reply = self._hand_over(ask.handoff_id)
                finally:
                    ask.done.set()

    def _hand_over(self, handoff_id: str) -> Outgoing | None:
        """Publish the stream's pending events (the checkpoint then holds all its tokens), take
        it out of the engine with a host copy of its KV, lease it to the taker."""
        req_id = next((r for r, o in self.offered.items() if o.handoff_id == handoff_id), None)
        if req_id is None or req_id not in self.inflight:
            return None
        offer = self.offered.pop(req_id)
        self.metrics.handoff_offers.set(len(self.offered))
        try:
            self.streams.flush(req_id)
        except REDIS_FAILURES as exc:
            log.warning("handoff of %s: could not publish its pending tokens (%r)", req_id, exc)
            return None
        if req_id not in self.inflight:  # fenced meanwhile, or finished
            return None
        state = self.engine.export_sequence(req_id)
        if state is None:  # holds no KV now (preempted for recompute): it stays here
            return None
        inflight = self.inflight.pop(req_id)
        try:
            self.redis.lease(req_id, handoff_id, self.settings.handoff_lease_s)
        except REDIS_FAILURES as exc:
            log.warning("handoff of %s: no lease (%r); it stays here", req_id, exc)
            self._take_back(req_id, inflight, state)
            return None
        self.handed[req_id] = _Handed(offer, inflight, state,
                                      time.monotonic() + self.settings.handoff_lease_s)
        header, buffers = state.encode()
        return Outgoing(header, buffers)

    def resolve_handed(self) -> None:
        """Streams sent: taken (drop the copy, stop refreshing the entry), still waiting, or
        back (the taker failed or the lease ended: continue from the copy, no recompute)."""
        now = time.monotonic()
        for req_id, handed in list(self.handed.items()):
            verdict = self.redis.resolve(req_id, handed.offer.handoff_id,
                                         take_back=now >= handed.deadline)
            if verdict == "sent":
                continue
            del self.handed[req_id]
            if verdict == "taken":
                self.streams.left(handed.inflight)
                self.num_out += 1
                self.metrics.handoff("out", handed.state.num_bytes)
                log.info("handed %s to a peer with its KV (%d tokens, %.1f MB)", req_id,
                         handed.state.num_computed_tokens, handed.state.num_bytes / 1e6)
            else:
                self.metrics.handoff_fallback("lease_expired")
                log.warning("handoff of %s not taken within its lease: continuing it here",
                            req_id)
                self._take_back(req_id, handed.inflight, handed.state)

    def _take_back(self, req_id: str, inflight: Inflight, state: SequenceState) -> None:
        try:
            self.engine.import_sequence(state)
        except HandoffError as exc:  # cannot happen with our own copy; resume elsewhere then
            log.error("handoff of %s: cannot take back its KV (%s); it resumes elsewhere",
                      req_id, exc)
            self.streams.give_back(inflight)
            return
        self.inflight.put(req_id, inflight)

    def give_back_handed(self) -> None:
        """A drain's end: streams still waiting for their taker are left to it if it fenced
        them, else to checkpoint resume elsewhere."""
        for req_id, handed in list(self.handed.items()):
            verdict = self.redis.resolve(req_id, handed.offer.handoff_id, take_back=True)
            del self.handed[req_id]
            if verdict == "taken":
                self.streams.left(handed.inflight)
                self.num_out += 1
                self.metrics.handoff("out", handed.state.num_bytes)
            else:
                self.metrics.handoff_fallback("given_back")
                self.streams.give_back(handed.inflight)

    # ---- the taker ------------------------------------------------------------------------

    def take_offers(self, budget_tokens: int, slots: int) -> None:
        """Take offered streams while the pool holds them (`budget_tokens`, what admission
        would take now) and the running group has `slots` left."""
        now = time.monotonic()
        if slots <= 0 or now - self._offers_read_at < OFFER_POLL_S:
            return
        self._offers_read_at = now
        offers = self.redis.offers()
        budget = budget_tokens - self.reserved_tokens()
        block = self.engine.config.cache.block_size
        for offer in offers:
            if slots <= 0:
                break
            if offer.lora and self.engine.lora is None:
                continue
            if offer.num_tokens + block > budget:
                continue  # pull: only what fits now
            if (time.time() - offer.created) * 1000 < self.numerics.wait_ms(
                    offer.numerics, gone=offer.worker_id):
                continue  # a live worker of the offer's numerics goes first, for a while
            taken = self.redis.take(offer.handoff_id)
            if taken is None:
                continue  # another taker was first
            budget -= taken.num_tokens + block
            slots -= 1
            self.incoming[taken.handoff_id] = _Incoming(
                taken, time.monotonic(), self._fetchers.submit(self._fetch, taken))

    def _fetch(self, offer: HandoffOffer) -> SequenceState:
        """A fetch thread: the stream's KV from its source."""
        header, payload = self.plane.fetch(offer.addr, offer.handoff_id,
                                           self.settings.handoff_lease_s)
        return SequenceState.decode(header, payload)

    def complete_incoming(self) -> None:
        """Streams fetched: fence them, claim their entries, continue them here."""
        for handoff_id, incoming in list(self.incoming.items()):
            if not incoming.future.done():
                continue
            del self.incoming[handoff_id]
            offer = incoming.offer
            try:
                state = incoming.future.result()
            except (TransferError, HandoffError, OSError) as exc:
                log.warning("handoff %s from %s failed (%s): its source continues it",
                            handoff_id, offer.worker_id, exc)
                self.metrics.handoff_fallback("transfer_failed")
                self.redis.release_lease(offer.req_id, handoff_id)
                continue
            self._continue(offer, state, incoming.started)

    def _continue(self, offer: HandoffOffer, state: SequenceState, started: float) -> None:
        fenced = self.redis.fence(offer.req_id, offer.handoff_id, self.settings.handoff_lease_s)
        if fenced == "lost":  # the source took it back (lease over): nothing to do here
            self.metrics.handoff_fallback("lost")
            return
        if fenced == "finished":
            return
        checkpoint = fenced.checkpoint
        delivery = self.claim_handed(offer.stream, offer.entry_id)
        if delivery is None:  # acked meanwhile: nothing left to serve
            return
        if checkpoint != state.output_token_ids:
            log.warning("handoff of %s: checkpoint (%d tokens) differs from its KV's (%d): "
                        "resuming from the checkpoint", offer.req_id, len(checkpoint),
                        len(state.output_token_ids))
            self.metrics.handoff_fallback("checkpoint_mismatch")
            self.streams.resume(delivery, fenced)
            return
        try:
            self.engine.import_sequence(state)
        except HandoffError as exc:
            log.warning("handoff of %s: %s; resuming from the checkpoint", offer.req_id, exc)
            self.metrics.handoff_fallback("incompatible")
            self.streams.resume(delivery, fenced)
            return
        self.streams.adopt(delivery, fenced)
        self.num_in += 1
        stats = getattr(self.plane, "stats", None)
        if stats is not None:
            self.metrics.transfer_totals(stats.bytes_received, stats.payload_seconds)
        seconds = time.monotonic() - started
        self.metrics.handoff("in", state.num_bytes, seconds)
        log.info("took %s from %s with its KV (%d tokens, %.1f MB in %.3f s)", offer.req_id,
                 offer.worker_id, state.num_computed_tokens, state.num_bytes / 1e6, seconds)
