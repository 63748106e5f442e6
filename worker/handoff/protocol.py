"""A worker's Redis side of KV handoffs (shared/wire/handoff.py has the protocol): offers,
takes, leases, the fence, and handing entries back. The bytes never go through Redis."""

from __future__ import annotations

import redis

from kvfleet.shared.wire import Keys
from kvfleet.shared.wire.handoff import (
    RECLAIM_HANDOFF, SENT, START_HANDOFF, TAKE_OFFER, HandoffOffer, reclaim_handoff,
    start_handoff, take_offer)
from kvfleet.shared.wire.records import text
from kvfleet.shared.wire.scripts import Started

# An entry handed back at a drain's end looks idle this long, so the next orphan check of any
# live worker claims it (its heartbeat TTL is far shorter).
GIVEN_BACK_IDLE_MS = 10**9
# XCLAIM names a consumer; one with no heartbeat key counts as gone (claim_orphan).
GIVEN_BACK_CONSUMER = "given-back"


class HandoffProtocol:
    """Redis operations of one worker's handoffs, for one model."""

    def __init__(self, client: redis.Redis, keys: Keys, model: str, worker_id: str,
                 numerics: str = ""):
        self.client = client
        self.keys = keys
        self.model = model
        self.worker_id = worker_id
        self.numerics = numerics  # this worker's numerics fingerprint (START_HANDOFF records it)
        self._take_offer = TAKE_OFFER.register(client)
        self._start_handoff = START_HANDOFF.register(client)
        self._reclaim = RECLAIM_HANDOFF.register(client)

    def load_scripts(self) -> None:
        for script in (self._take_offer, self._start_handoff, self._reclaim):
            self.client.script_load(script.script)

    # ---- the source -----------------------------------------------------------------------

    def offer(self, offer: HandoffOffer) -> None:
        self.client.hset(self.keys.handoff_offers(self.model), offer.handoff_id, offer.pack())

    def withdraw(self, handoff_ids: list[str]) -> None:
        if handoff_ids:
            self.client.hdel(self.keys.handoff_offers(self.model), *handoff_ids)

    def lease(self, req_id: str, handoff_id: str, lease_s: float) -> None:
        """The stream's KV is out of the source's engine and on its way: a taker may fence it
        within the lease."""
        self.client.set(self.keys.handoff_lease(req_id), SENT + handoff_id,
                        px=max(1, int(lease_s * 1000)))

    def resolve(self, req_id: str, handoff_id: str, take_back: bool) -> str:
        """'taken', 'sent' (only when not `take_back`) or 'back' (RECLAIM_HANDOFF)."""
        call = reclaim_handoff(self.keys, req_id, handoff_id, take_back)
        return text(self._reclaim(keys=call.keys, args=call.args))

    def give_back(self, stream: str, entry_id: str) -> None:
        """Leave an entry for any live worker's next orphan check (checkpoint resume), at once
        instead of after this worker's heartbeat TTL."""
        self.client.xclaim(stream, self.keys.group, GIVEN_BACK_CONSUMER, 0, [entry_id],
                           idle=GIVEN_BACK_IDLE_MS, justid=True)

    def drain_requested(self) -> bool:
        return bool(self.client.exists(self.keys.drain(self.worker_id)))

    def clear_drain(self) -> None:
        self.client.delete(self.keys.drain(self.worker_id))

    # ---- the taker ------------------------------------------------------------------------

    def offers(self) -> list[HandoffOffer]:
        """Standing offers of other live workers, oldest first. Offers of a worker whose
        heartbeat is gone (it died before withdrawing them: its streams resume from their
        checkpoints) and malformed ones are removed from the hash."""
        key = self.keys.handoff_offers(self.model)
        offers, stale = [], []
        for handoff_id, value in self.client.hgetall(key).items():
            try:
                offer = HandoffOffer.unpack(value)
            except (ValueError, TypeError):
                stale.append(handoff_id)
                continue
            if offer.worker_id != self.worker_id:
                offers.append(offer)
        sources = sorted({o.worker_id for o in offers})
        pipe = self.client.pipeline(transaction=False)
        for source in sources:
            pipe.exists(self.keys.worker(source))
        alive = {s for s, n in zip(sources, pipe.execute() if sources else []) if n}
        stale += [o.handoff_id for o in offers if o.worker_id not in alive]
        if stale:
            self.client.hdel(key, *stale)
        return sorted((o for o in offers if o.worker_id in alive), key=lambda o: o.created)

    def take(self, handoff_id: str) -> HandoffOffer | None:
        """Remove one offer from the hash: ours to fetch, or None when another was first."""
        call = take_offer(self.keys, self.model, handoff_id)
        raw = self._take_offer(keys=call.keys, args=call.args)
        return None if raw is None else HandoffOffer.unpack(raw)

    def fence(self, req_id: str, handoff_id: str, lease_s: float) -> Started | str:
        """START_HANDOFF: the started attempt when ours now; 'lost' when the lease was gone (the
        source keeps the stream); 'finished' when the request already ended."""
        call = start_handoff(self.keys, req_id, self.worker_id, handoff_id,
                             max(1, int(lease_s * 1000)), self.numerics)
        reply = self._start_handoff(keys=call.keys, args=call.args)
        if int(reply[0]) < 0:
            return "lost"
        return Started.decode(reply) or "finished"

    def release_lease(self, req_id: str, handoff_id: str) -> str:
        """A taker that cannot complete (the transfer failed) gives the stream back to its source
        at once: its next look finds the lease gone ('back')."""
        return self.resolve(req_id, handoff_id, take_back=True)
