"""A worker's Redis I/O of prefix-affinity routing (docs/ARCHITECTURE.md, "Prefix-affinity
routing"), beside `WorkerProtocol`, which uses it:

- `OwnStreamOwners`: the model's workers that have own streams (`Keys.worker_queue_owners`) and
  their heartbeats, read about once a heartbeat interval: whose own streams a fill reads after
  its own and the shared ones, with what minimum age and owner's room (READ_IF_FITS ARGV 5, 7),
  and the cleanup of a gone owner's empty streams. The owners due a read are probed together
  first (`with_entries`: OWN_STREAMS_WAITING in one pipelined round trip), so a fill costs a
  READ_IF_FITS round trip only per owner whose streams hold something: with N workers each
  reading the N - 1 others, N^2 round trips a steal period became N.
- `PrefixHolders`: the other live workers holding more of a prompt's opening than this one,
  with their transfer planes and numerics (a peer fetch's candidates, worker/handoff/peer_prefixes.py).
- `resume_min_idle_ms`: how long an orphaned entry must have been idle before this worker claims
  it: the heartbeat TTL when this worker holds at least as much of its prompt as any other live
  announcing worker, else `prefer_ms` longer (the best holder claims it first).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import redis

from kvfleet.shared.wire import Heartbeat, Keys, QueueEntry
from kvfleet.shared.wire import affinity
from kvfleet.shared.wire.lua import run_pipelined
from kvfleet.shared.wire.prefix_hash import BlockHash, block_hashes, pack_ids
from kvfleet.shared.wire.records import text

# A worker takes entries that only waited in another's own stream when it is idle and that
# owner carries at least this many requests: the taker recomputes what the owner has cached, so
# only an idle one is surely sooner (the router keeps the loads within its balance).
STEAL_LOAD_GAP = 2
NEVER_MS = 10 ** 12  # a minimum age no entry reaches: only the owner-room rule applies


# The heartbeat fields a fill's rules read of another owner (`due_reads`): read with HMGET, not
# the whole heartbeat (its fitted curve, URLs, counters), by every worker about once an interval.
OWNER_FIELDS = ("model", "ts", "blocks_free", "block_size", "running", "waiting", "own_queue")


def _owner_beat(values: list) -> Heartbeat | None:
    """An owner's heartbeat from its OWNER_FIELDS (None: no heartbeat, the owner is gone)."""
    if all(value is None for value in values):
        return None
    return Heartbeat.decode({name: value for name, value in zip(OWNER_FIELDS, values)
                             if value is not None})


@dataclass(frozen=True)
class ForeignRead:
    """One READ_IF_FITS over another worker's own streams."""

    owner: str
    min_age_ms: int  # its entries that waited this long (0: the owner is gone, any entry)
    owner_room: int  # the owner's free KV tokens (-1: unknown): a larger entry is taken at once


class OwnStreamOwners:
    """The other workers of the model with own streams, as this worker last read them."""

    def __init__(self, client: redis.Redis, keys: Keys, model: str, worker_id: str, *,
                 steal_after_ms: int, refresh_s: float, gone_grace_s: float):
        self.client = client
        self.keys = keys
        self.model = model
        self.worker_id = worker_id
        self.steal_after_ms = steal_after_ms
        self.refresh_s = refresh_s  # how often the owners and their heartbeats are read
        self.gone_grace_s = gone_grace_s  # an owner without heartbeat this long is cleaned up
        self.heartbeats: dict[str, Heartbeat | None] = {}  # owner -> heartbeat (None: gone)
        self.listed = True  # whether the last refresh found this worker among the owners
        self._refreshed_at = -1e9
        self._gone_since: dict[str, float] = {}
        self._read_at: dict[str, float] = {}  # owner -> when a fill last read its streams
        self.drop_script = affinity.DROP_OWN_STREAMS.register(client)
        self.waiting_script = affinity.OWN_STREAMS_WAITING.register(client)

    def streams(self) -> list[str]:
        """Every other owner's own streams (where a dead worker's entries may be pending)."""
        return [s for owner in self.heartbeats for s in self.keys.worker_queues(self.model, owner)]

    def refresh(self, force: bool = False) -> None:
        """Read the owners and their heartbeats (at most once per `refresh_s` unless `force`);
        drop the streams of owners gone for `gone_grace_s` that hold nothing. `listed` says
        whether this worker is still an owner."""
        now = time.monotonic()
        if not force and now - self._refreshed_at < self.refresh_s:
            return
        self._refreshed_at = now
        members = sorted(text(m) for m in self.client.smembers(
            self.keys.worker_queue_owners(self.model)))
        self.listed = self.worker_id in members
        members = [m for m in members if m != self.worker_id]
        pipe = self.client.pipeline(transaction=False)
        for owner in members:  # the fields the fills use, not the whole heartbeat
            pipe.hmget(self.keys.worker(owner), OWNER_FIELDS)
        beats = pipe.execute() if members else []
        self.heartbeats = {owner: _owner_beat(values) for owner, values in zip(members, beats)}
        for owner, beat in list(self.heartbeats.items()):
            if beat is not None:
                self._gone_since.pop(owner, None)
            elif now - self._gone_since.setdefault(owner, now) >= self.gone_grace_s:
                self._clean_up(owner)

    def _clean_up(self, owner: str) -> None:
        """Forget a gone owner whose streams hold nothing (best effort: any worker may do it).
        The grace before it lets gateways stop routing there; the script checks and deletes in
        one step, so an entry added before it stays and the owner stays listed."""
        streams = self.keys.worker_queues(self.model, owner)
        if not int(self.drop_script(keys=streams, args=[self.keys.group])):
            return
        self.client.srem(self.keys.worker_queue_owners(self.model), owner)
        del self.heartbeats[owner]
        self._gone_since.pop(owner, None)
        self._read_at.pop(owner, None)

    def due_reads(self, my_load: int | None = None) -> list[ForeignRead]:
        """The owners whose streams a fill reads now: those no fill read in the last
        steal_after_ms / 2 (their entries become takeable only after steal_after_ms, so reading
        more often finds nothing new), with the age and room rules of each. With `my_load`
        (this worker's requests in flight), entries that merely waited are taken only by an idle
        worker from an owner carrying at least STEAL_LOAD_GAP requests (running, waiting and in
        its own streams, by its heartbeat): a busy worker would serve them little sooner and
        without the owner's cache. Entries the owner cannot hold, and every entry of a gone
        owner, are taken at once whatever the loads."""
        now = time.monotonic()
        reads = []
        for owner, beat in self.heartbeats.items():
            if now - self._read_at.get(owner, -1e9) < self.steal_after_ms / 2000:
                continue
            self._read_at[owner] = now
            if beat is None:
                reads.append(ForeignRead(owner, 0, -1))
                continue
            room = beat.blocks_free * beat.block_size if beat.block_size > 0 else -1
            owner_load = beat.running + beat.waiting + beat.own_queue
            if my_load is not None and (my_load > 0 or owner_load < STEAL_LOAD_GAP):
                if room >= 0:  # only what the owner cannot hold
                    reads.append(ForeignRead(owner, NEVER_MS, room))
                continue
            reads.append(ForeignRead(owner, self.steal_after_ms, room))
        return reads

    def with_entries(self, reads: list[ForeignRead]) -> list[ForeignRead]:
        """The `reads` whose owner's streams hold an undelivered entry, probed for all at once
        (OWN_STREAMS_WAITING, one pipelined round trip; one per node on a cluster). Most due
        reads find nothing: one READ_IF_FITS each would cost a round trip per owner. A single
        read is returned unprobed (the probe would cost the round trip it saves). An entry that
        arrives after the probe is read at the owner's next due read, as one that arrives after
        a READ_IF_FITS would be."""
        if len(reads) < 2:
            return reads
        calls = [affinity.OWN_STREAMS_WAITING.bind(self.keys.worker_queues(self.model, r.owner),
                                                    [self.keys.group]) for r in reads]
        replies = run_pipelined(self.client, self.waiting_script, calls)
        return [read for read, waiting in zip(reads, replies) if int(waiting)]


@dataclass(frozen=True)
class ResumePreference:
    """What `resume_min_idle_ms` needs of this worker."""

    prefer_ms: int  # the extra idle time before a worker that is not the best holder claims
    block_size: int  # this worker's: prompts are hashed by it
    root: BlockHash  # prefix_hash.root_hash(served model)
    cached_blocks: Callable[[list[int]], int]  # leading blocks of a prompt cached here now


def resume_min_idle_ms(client: redis.Redis, prefix_match, keys: Keys, model: str,
                       worker_id: str, stream: str, entry_id: str, dead_consumer: str,
                       min_idle_ms: int, prefer: ResumePreference) -> int:
    """`min_idle_ms` if this worker holds at least as many leading blocks of the entry's prompt
    as every other live announcing worker (listed in `Keys.kv_workers` within `min_idle_ms`,
    the heartbeat TTL; the entry's dead consumer left out), else `min_idle_ms + prefer_ms`.
    `prefix_match`: PREFIX_MATCH registered on `client`."""
    found = client.xrange(stream, min=entry_id, max=entry_id)
    if not found:  # trimmed: the claim finds nothing to resume
        return min_idle_ms
    prompt = QueueEntry.decode(found[0][1]).request.prompt_token_ids
    hashes = block_hashes(prompt, prefer.block_size, prefer.root)
    if not hashes:
        return min_idle_ms
    listed = client.zrangebyscore(keys.kv_workers(model), time.time() * 1000 - min_idle_ms, "+inf")
    others = [w for w in (text(m) for m in listed) if w not in (worker_id, dead_consumer)]
    if not others:
        return min_idle_ms
    call = affinity.prefix_match(keys, model, others, pack_ids(hashes))
    best_other = max(int(n) for n in prefix_match(keys=call.keys, args=call.args))
    mine = prefer.cached_blocks(prompt)
    return min_idle_ms if mine >= best_other else min_idle_ms + prefer.prefer_ms


def undelivered_entries(client: redis.Redis, streams: list[str], group: str) -> int:
    """Entries of `streams` not yet delivered to any consumer of `group` (one round trip; the
    streams share a slot). A missing stream counts 0, a stream without the group every entry."""
    pipe = client.pipeline(transaction=False)
    for stream in streams:
        pipe.xinfo_groups(stream)
        pipe.xlen(stream)
    replies = pipe.execute(raise_on_error=False)
    total = 0
    for stream, groups, length in zip(streams, replies[::2], replies[1::2]):
        if isinstance(groups, Exception):  # no such stream
            continue
        state = next((g for g in groups if text(g["name"]) == group), None)
        if state is None:
            total += int(length)
        elif state.get("lag") is not None:
            total += int(state["lag"])
        else:  # Redis cannot tell the lag (entries deleted or trimmed): count them
            last = text(state.get("last-delivered-id")) or "0-0"
            total += len(client.xrange(stream, min=f"({last}" if last != "0-0" else "-"))
    return total


# The heartbeat fields a peer fetch reads of a prefix's holders (worker/handoff/peer_prefixes.py)
HOLDER_FIELDS = ("handoff_addr", "numerics", "draining")


@dataclass(frozen=True)
class PrefixHolder:
    """Another live worker holding a prompt's leading blocks, as a peer fetch needs it."""

    worker_id: str
    num_blocks: int  # leading blocks of the prompt it announced holding, in either tier
    addr: str  # its transfer plane ("" = none)
    numerics: str  # its numerics fingerprint
    draining: bool


class PrefixHolders:
    """The other live workers holding more of a prompt's opening than this one (a peer fetch's
    candidates, worker/handoff/peer_prefixes.py), most first, with their transfer planes and
    numerics. The live announcers (`Keys.kv_workers` within the heartbeat TTL) are read at most
    once per `refresh_s`: a lookup then costs one round trip (PREFIX_MATCH over them), plus one
    for the heartbeat fields of those holding more; none while no other worker announces."""

    def __init__(self, client: redis.Redis, keys: Keys, model: str, worker_id: str, *,
                 ttl_ms: int, refresh_s: float):
        self.client, self.keys, self.model, self.worker_id = client, keys, model, worker_id
        self.ttl_ms, self.refresh_s = ttl_ms, refresh_s
        self.prefix_match = affinity.PREFIX_MATCH.register(client)
        self._others: list[str] = []
        self._read_at = -1e9

    def others(self) -> list[str]:
        """The other live announcing workers, as last read."""
        now = time.monotonic()
        if now - self._read_at >= self.refresh_s:
            listed = self.client.zrangebyscore(self.keys.kv_workers(self.model),
                                               time.time() * 1000 - self.ttl_ms, "+inf")
            self._others = [w for w in (text(m) for m in listed) if w != self.worker_id]
            self._read_at = now
        return self._others

    def __call__(self, hashes: list[BlockHash], min_blocks: int) -> list[PrefixHolder]:
        """Those holding more than `min_blocks` leading blocks of `hashes`, most first (a
        holder whose heartbeat is gone is left out)."""
        others = self.others()
        if not others or not hashes:
            return []
        call = affinity.prefix_match(self.keys, self.model, others, pack_ids(hashes))
        counts = [int(n) for n in self.prefix_match(keys=call.keys, args=call.args)]
        ranked = sorted(((n, w) for w, n in zip(others, counts) if n > min_blocks),
                        reverse=True)
        if not ranked:
            return []
        pipe = self.client.pipeline(transaction=False)
        for _, holder in ranked:
            pipe.hmget(self.keys.worker(holder), HOLDER_FIELDS)
        holders = []
        for (count, holder), (addr, numerics, draining) in zip(ranked, pipe.execute()):
            if addr is None and numerics is None:  # its heartbeat is gone
                continue
            holders.append(PrefixHolder(holder, count, text(addr), text(numerics),
                                        text(draining) not in ("", "0")))
        return holders
