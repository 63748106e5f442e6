"""A gateway's in-memory prefix index of one model: which live worker holds which prefix-cache
block, by announce id (docs/ARCHITECTURE.md, "Prefix-affinity routing").

Fed from Redis only: `PREFIX_SNAPSHOT` gives the last announcement event's id and every listed
worker's block set at one moment; the index then follows the model's event stream
(`Keys.kv_events`) with `XREAD BLOCK` from that id, applying each worker's stored, removed and
host-tier ids in order. Applying the events after the snapshot's id to the snapshot is exact. It
takes a snapshot again when its position is no longer in the stream (trimmed past it, or the
stream gone or reset: a Redis restart) and after any Redis failure. A lookup never touches Redis.

Each (worker, block) is kept with its tier: `sets` holds every block a worker holds, `host` the
subset held only in its host tier (`--kv-offloading-size`): a block the worker's pool evicts into
the tier moves into `host`, one brought back leaves it, one the tier drops leaves both.
"""

from __future__ import annotations

import asyncio
import logging
import time

from redis.asyncio import Redis
from redis.exceptions import ResponseError

from kvfleet.shared.redis_connect import REDIS_FAILURES
from kvfleet.shared.wire import Keys
from kvfleet.shared.wire.affinity import PREFIX_SNAPSHOT, KvEvent, prefix_snapshot
from kvfleet.shared.wire.records import text

log = logging.getLogger(__name__)

SNAPSHOT_TRIES = 4  # a worker may join between reading the listing and the snapshot
EVENTS_PER_READ = 1000
GAP_CHECK_S = 2.0  # how often the index checks that its position is still in the stream
RETRY_S = (0.1, 2.0)  # backoff after a Redis failure: first wait, longest wait


def _stream_id(value: str) -> tuple[int, int]:
    ms, _, seq = value.partition("-")
    return int(ms), int(seq or 0)


class PrefixIndex:
    """One model's blocks per announcing worker, as Redis last told this gateway."""

    def __init__(self, redis: Redis, keys: Keys, model: str, *, listing_ttl_ms: int,
                 block_ms: int = 1000):
        self.redis = redis
        self.keys = keys
        self.model = model
        self.listing_ttl_ms = listing_ttl_ms
        self.block_ms = block_ms
        self.sets: dict[str, set[bytes]] = {}  # worker id -> announce ids it holds (either tier)
        self.host: dict[str, set[bytes]] = {}  # worker id -> of those, held in its host tier
        self.last_id: str | None = None  # position in the event stream (None: not in sync)
        self.events_applied = 0
        self.snapshots = 0
        self._snapshot = PREFIX_SNAPSHOT.register(redis)
        self._gap_checked_at = 0.0
        self.resync = False  # set by `apply`: take a snapshot before the next read

    @property
    def synced(self) -> bool:
        return self.last_id is not None

    @property
    def num_blocks(self) -> int:
        return sum(len(ids) for ids in self.sets.values())

    @property
    def num_host_blocks(self) -> int:
        """Of `num_blocks`, those held in a worker's host tier."""
        return sum(len(ids) for ids in self.host.values())

    # ---- lookups (no Redis) -----------------------------------------------------------------

    def leading(self, worker_id: str, ids: list[bytes]) -> int:
        """How many of `ids` (a prompt's announce ids, in order) the worker holds from the
        first on."""
        held = self.sets.get(worker_id)
        if not held:
            return 0
        count = 0
        for block_id in ids:
            if block_id not in held:
                break
            count += 1
        return count

    def forget_except(self, live: set[str]) -> None:
        """Drop the blocks of workers that are not live (their heartbeat is gone)."""
        for worker_id in [w for w in self.sets if w not in live]:
            del self.sets[worker_id]
            self.host.pop(worker_id, None)

    # ---- following Redis --------------------------------------------------------------------

    async def take_snapshot(self) -> None:
        """Every listed worker's set and the last event id, read at one moment."""
        passed: list[str] = []
        for _ in range(SNAPSHOT_TRIES):
            call = prefix_snapshot(self.keys, self.model, passed, ttl_ms=self.listing_ttl_ms)
            last, listed, *members = await self._snapshot(keys=call.keys, args=call.args)
            listed = [text(w) for w in listed]
            if set(listed) <= set(passed):
                break
            passed = sorted(set(passed) | set(listed))
        held, host = members[0::2], members[1::2]  # each worker's set, then its host subset
        self.sets = {w: set(ids) for w, ids in zip(passed, held) if w in listed}
        # a host-tier id outside the set is a leftover (an older worker started under this id)
        self.host = {w: self.sets[w] & set(ids) for w, ids in zip(passed, host)
                     if w in listed and ids}
        self.last_id = text(last)
        self.snapshots += 1
        self._gap_checked_at = time.monotonic()

    def apply(self, event: KvEvent) -> None:
        if event.worker_id not in self.sets and not event.cleared:
            # a worker this index dropped (its heartbeat was missing) announces again: its
            # changes alone would leave out what it held before; the next read takes a snapshot
            self.resync = True
        held = self.sets.setdefault(event.worker_id, set())
        host = self.host.setdefault(event.worker_id, set())
        if event.cleared:
            held.clear()
            host.clear()
        held.difference_update(event.removed)
        host.difference_update(event.removed)
        held.update(event.stored)
        host.difference_update(event.stored)
        held.update(event.host)
        host.update(event.host)
        self.events_applied += 1

    async def read_events(self) -> int:
        """Apply the events after `last_id` (waiting up to `block_ms` for one); how many."""
        reply = await self.redis.xread({self.keys.kv_events(self.model): self.last_id},
                                       count=EVENTS_PER_READ, block=self.block_ms)
        applied = 0
        for _stream, entries in reply or []:
            for entry_id, fields in entries:
                self.apply(KvEvent.decode(fields))
                self.last_id = text(entry_id)
                applied += 1
        return applied

    async def position_lost(self) -> bool:
        """Whether events after `last_id` may be missing from the stream: trimmed past it, or
        the stream gone or reset while the index had read some."""
        try:
            info = await self.redis.xinfo_stream(self.keys.kv_events(self.model))
        except ResponseError:  # no such key: expired (no worker announced for an hour) or lost
            return self.last_id not in (None, "0-0")
        mine = _stream_id(self.last_id or "0-0")
        if _stream_id(text(info["last-generated-id"])) < mine:
            return True  # a new stream under the same name (Redis restarted without its data)
        # entries were trimmed, and the oldest one left is past this position: some of those
        # trimmed may have come after it
        trimmed = int(info.get("entries-added") or 0) > int(info.get("length") or 0)
        first = info.get("first-entry")
        return trimmed and first is not None and _stream_id(text(first[0])) > mine

    async def run(self) -> None:
        """Follow Redis until cancelled; never raises for a Redis failure (it waits, then takes
        a snapshot again)."""
        wait_s = RETRY_S[0]
        while True:
            try:
                if self.last_id is None or self.resync:
                    self.resync = False
                    await self.take_snapshot()
                await self.read_events()
                if time.monotonic() - self._gap_checked_at >= GAP_CHECK_S:
                    self._gap_checked_at = time.monotonic()
                    if await self.position_lost():
                        log.info("prefix index of %s: events were trimmed or lost; taking a "
                                 "snapshot again", self.model)
                        self.last_id = None
                wait_s = RETRY_S[0]
            except asyncio.CancelledError:
                raise
            except (*REDIS_FAILURES, OSError) as exc:
                log.warning("prefix index of %s: %r; retrying in %.1f s", self.model, exc, wait_s)
                self.last_id = None
                await asyncio.sleep(wait_s)
                wait_s = min(wait_s * 2, RETRY_S[1])
