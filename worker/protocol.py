"""The worker's side of the fleet protocol: the Redis reads and writes of the loop and the
heartbeat, through the scripts and records of the wire contract (shared/wire/). The others are
beside it, each with its part: prefix-affinity routing's in affinity.py, the prefix cache's
announcements in announcer.py, the numerics view in numerics.py, the handoffs' in
handoff/protocol.py.

Ordering guarantees (docs/ARCHITECTURE.md, "The Redis protocol"):
- `read_batch` delivers the next requests (by priority, up to a count) only while their prompts
  fit this worker's budget, in one round trip per shard (READ_IF_FITS): the entries tested are
  the entries delivered.
- `start_attempt` increments the request's `attempt` (the fencing token) and reads its checkpoint
  in one atomic script, so the claimer resumes exactly after the last token any earlier attempt
  recorded.
- `publish` writes new tokens into the checkpoint (at their offset), publishes them and, on the
  final event, records the status — all requests of a step in one script call (PUBLISH_STEP),
  one per node on a cluster, one message per reply channel (a gateway's inbox: every event of
  the step for that gateway); the final events' stream entries are XACKed after their scripts
  returned 1 (a second round trip, only in steps where something finished: on a cluster the
  stream lives in another slot). The script does nothing and returns 0 when the attempt is
  stale: that worker must stop the request.
- Stream shards (Keys.queue_shards): the worker reads every shard of its model, its home shards
  first (`update_roster`: from its place among the model's live workers, so every shard has a
  home worker), the others only for entries that have waited `steal_after_ms` (0: no homes,
  every shard alike). A request's keys live on its shard's primary (Keys.shard_of), so a worker
  serving its home shard sends a step's events to one node. Within each group the first shard
  rotates from read to read so none waits behind another; priority holds within a shard. On a
  cluster token events and cancels travel by sharded pub/sub (SPUBLISH/SSUBSCRIBE).
- Own streams (prefix-affinity routing, worker/affinity.py): a gateway may route a request to
  the own stream of the worker holding most of its prompt. A fill reads this worker's own streams
  first (an entry counts its prompt less the tokens the router expects cached here), then the
  shared shards, then the other owners' own streams for entries that waited
  `affinity_steal_after_ms` (at once when the owner is gone or its free KV cannot hold them).
  Every worker creates its own streams and group at start, whatever its routing setting, so no
  entry routed to it is stranded.
- `claim_orphan` takes over an entry only when the worker holding it has no heartbeat key; the
  holder keeps its entries' idle time low (`refresh_pending`) from the moment each is delivered.
  With a `ResumePreference` the worker holding most of the entry's prompt claims it first.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass

import redis

from kvfleet.shared.wire import (
    DeadLetterEntry,
    GenerationRequest,
    Heartbeat,
    Keys,
    QueueEntry,
    RequestStatus,
    TokenEvent,
)
from kvfleet.shared.redis_connect import is_cluster
from kvfleet.shared.wire import affinity, scripts
from kvfleet.shared.wire.lua import run_per_node, run_pipelined
from kvfleet.shared.wire.prefix_hash import BlockHash, pack_ids
from kvfleet.shared.wire.records import field_value, text
from kvfleet.shared.wire.scripts import Started
from kvfleet.shared.wire.timeline import RequestTimeline
from kvfleet.worker.affinity import (
    OwnStreamOwners, ResumePreference, resume_min_idle_ms, undelivered_entries)
from kvfleet.worker.numerics import FleetNumerics

log = logging.getLogger(__name__)

# Idle pending entries looked at per stream per orphan check: entries of live workers are skipped,
# so the scan must see past them.
ORPHAN_SCAN_COUNT = 100


@dataclass
class Delivery:
    """A request this worker took from a stream (new, or claimed from a dead worker)."""

    request: GenerationRequest
    stream: str
    entry_id: str
    times_delivered: int = 1
    source: str = "shared"  # "own" (this worker's own streams), "shared", "other" (another's own)
    cached_tokens: int = 0  # from its own stream: the tokens the router expects cached here


@dataclass(frozen=True)
class TooLarge:
    """The next request (by priority) does not fit this worker's budget: it stays in its stream
    for a worker with room."""

    stream: str
    prompt_len: int


@dataclass
class Admission:
    """What one `read_batch` took: the requests delivered, in order; when none, TooLarge if the
    next request (by priority) of some shard did not fit."""

    deliveries: list[Delivery]
    too_large: TooLarge | None = None


@dataclass(frozen=True)
class _Read:
    """One READ_IF_FITS call of a fill."""

    streams: list[str]
    min_age_ms: int
    source: str  # Delivery.source of what it takes
    use_cached: bool = False
    owner_room: int = -1


@dataclass
class Publication:
    """What one step produced for one request, to be checkpointed and published."""

    req_id: str
    attempt: int
    event: TokenEvent
    final_status: RequestStatus | None
    stream: str
    entry_id: str
    reply_to: str = ""  # GenerationRequest.reply_to: the inbox its events go to


class WorkerProtocol:
    """Redis operations of one worker, for one model."""

    def __init__(self, client: redis.Redis, keys: Keys, model: str, worker_id: str,
                 result_ttl_s: int = 3600, steal_after_ms: int = 0, *,
                 affinity_steal_after_ms: int = 250, owners_refresh_s: float = 1.0,
                 owner_gone_grace_s: float = 5.0, numerics: str = ""):
        self.client = client
        self.keys = keys
        self.model = model
        self.worker_id = worker_id
        self.numerics = numerics  # this worker's numerics fingerprint (START_ATTEMPT records it)
        self.result_ttl_s = result_ttl_s
        self.sharded = is_cluster(client)  # sharded pub/sub
        self._start_attempt = scripts.START_ATTEMPT.register(client)
        self._publish = scripts.PUBLISH.register(client)
        self._publish_step = scripts.PUBLISH_STEP.register(client)
        self._read_if_fits = scripts.READ_IF_FITS.register(client)
        self._roster = scripts.ROSTER.register(client)
        self._announce = affinity.ANNOUNCE_BLOCKS.register(client)
        self._prefix_match = affinity.PREFIX_MATCH.register(client)
        self._next_shard = 0
        # Home shards (read first, entries of any age); the others' entries only once they have
        # waited steal_after_ms. Every shard is home until update_roster places this worker.
        self.steal_after_ms = steal_after_ms
        self.home_shards: tuple[int, ...] = tuple(range(keys.queue_shards))
        self._roster_ttl_s = 0.0  # the TTL of the last update_roster (0: not on the roster)
        self._foreign_read_at: dict[int, float] = {}  # shard -> when a fill last read it
        self._stream_shard = {stream: shard for shard in range(keys.queue_shards)
                              for stream in keys.queues(model, shard)}
        # This worker's own streams (read first) and the other owners' (read after a wait).
        self.own_streams = keys.worker_queues(model, worker_id)
        self.owners = OwnStreamOwners(client, keys, model, worker_id,
                                      steal_after_ms=affinity_steal_after_ms,
                                      refresh_s=owners_refresh_s, gone_grace_s=owner_gone_grace_s)

    @property
    def uses_homes(self) -> bool:
        """Whether this worker prefers home shards (several shards and a steal delay)."""
        return self.keys.queue_shards > 1 and self.steal_after_ms > 0

    def update_roster(self, ttl_s: float, join: bool = True) -> tuple[int, ...]:
        """Stay on (or leave) the model's roster of live workers and take the home shards of this
        worker's place on it; `ttl_s`: how long an absent worker stays listed."""
        self._roster_ttl_s = ttl_s
        call = scripts.roster(self.keys, self.model, self.worker_id, int(ttl_s * 1000), join)
        index, count = (int(v) for v in self._roster(keys=call.keys, args=call.args))
        self.home_shards = scripts.home_shards(index, count, self.keys.queue_shards)
        return self.home_shards

    @property
    def streams(self) -> list[str]:
        """Every request stream of the model, shard by shard, interactive before batch."""
        return self.keys.all_queues(self.model)

    def source_of(self, stream: str) -> str:
        """Delivery.source of an entry of `stream`."""
        if stream in self.own_streams:
            return "own"
        return "shared" if stream in self._stream_shard else "other"

    def from_home(self, delivery: Delivery) -> bool:
        """Whether `delivery` came from one of this worker's home shards."""
        return self._stream_shard.get(delivery.stream) in self.home_shards

    def _shard_order(self) -> list[int]:
        """All shards, starting at the next one in rotation."""
        n = self.keys.queue_shards
        first, self._next_shard = self._next_shard, (self._next_shard + 1) % n
        return [(first + i) % n for i in range(n)]

    def _read_order(self) -> list[tuple[int, int]]:
        """(shard, minimum entry age in ms) in the order a fill reads them: home shards first
        (any age), then the others (entries that waited steal_after_ms) that no fill read in
        the last steal_after_ms / 2, each group in rotation. Without homes: every shard, any
        age."""
        order = self._shard_order()
        if not self.uses_homes:
            return [(shard, 0) for shard in order]
        homes = set(self.home_shards)
        # A shard that is not home gives only entries older than steal_after_ms, so reading it
        # more often than every half of that finds nothing new to take: at most 1.5 x
        # steal_after_ms of waiting, and a busy worker's fill reads its home shards only.
        now = time.monotonic()
        due = [shard for shard in order if shard not in homes
               and now - self._foreign_read_at.get(shard, -1e9) >= self.steal_after_ms / 2000]
        for shard in due:
            self._foreign_read_at[shard] = now
        return ([(shard, 0) for shard in order if shard in homes]
                + [(shard, self.steal_after_ms) for shard in due])

    def ensure_groups(self) -> None:
        for script in (self._start_attempt, self._publish, self._publish_step,
                       self._read_if_fits, self._roster, self._announce, self._prefix_match,
                       self.owners.drop_script, self.owners.waiting_script):
            self.client.script_load(script.script)  # every primary of a cluster
        self._create_groups(self.streams)
        self._ensure_own_streams()

    def _create_groups(self, streams: list[str]) -> None:
        for stream in streams:
            try:
                # id 0: entries added before any worker existed are delivered too.
                self.client.xgroup_create(stream, self.keys.group, id="0", mkstream=True)
            except redis.ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise

    def _ensure_own_streams(self) -> None:
        """This worker's own streams with their group, and its place among the owners (listed
        after its streams exist: others read them once listed). Again whenever it finds itself
        unlisted: another worker took it for gone (a long stall) and dropped its empty streams."""
        self._create_groups(self.own_streams)
        self.client.sadd(self.keys.worker_queue_owners(self.model), self.worker_id)
        self.owners.listed = True

    def read_if_fits(self, budget_tokens: int) -> Delivery | TooLarge | None:
        """Take the next new request, highest priority first, if its prompt is at most
        `budget_tokens`; TooLarge when it is not (it stays queued); None when none waits."""
        admission = self.read_batch(budget_tokens, 1)
        return admission.deliveries[0] if admission.deliveries else admission.too_large

    def read_batch(self, budget_tokens: int, max_requests: int,
                   load: int | None = None) -> Admission:
        """Take up to `max_requests` new requests whose prompts together fit `budget_tokens`,
        highest priority first, with one READ_IF_FITS call per stream group visited
        (`_fill_plan`): this worker's own streams, the home shards, the other shards' entries
        that waited `steal_after_ms`, the other owners' own streams (those where something
        waits, `OwnStreamOwners.with_entries`), until `max_requests` are
        taken (`load`: this worker's requests running and waiting, for the rule of taking from
        another owner, `OwnStreamOwners.due_reads`). A request from the own streams needs its
        prompt less its `cached` tokens. A group
        stops at its first request that does not fit what is left of the budget (it stays
        queued, head of line); `too_large` names the first such request when nothing at all was
        taken."""
        deliveries: list[Delivery] = []
        too_large = None
        for read in self._fill_plan(load):
            want = max_requests - len(deliveries)
            if want <= 0:
                break
            call = scripts.read_if_fits(read.streams, self.keys.group, self.worker_id,
                                        budget_tokens, want, read.min_age_ms,
                                        use_cached=read.use_cached, owner_room=read.owner_room)
            reply = self._read_if_fits(keys=call.keys, args=call.args)
            for i in range(2, len(reply), 3):
                flat = reply[i + 2]
                entry = QueueEntry.decode(dict(zip(flat[::2], flat[1::2])))
                cached = entry.cached_tokens if read.use_cached else 0
                deliveries.append(Delivery(entry.request, read.streams[int(reply[i]) - 1],
                                           text(reply[i + 1]), source=read.source,
                                           cached_tokens=cached))
                budget_tokens -= max(len(entry.request.prompt_token_ids) - cached, 0)
            if int(reply[0]) and too_large is None:
                too_large = TooLarge(read.streams[int(reply[0]) - 1], int(reply[1]))
        return Admission(deliveries, None if deliveries else too_large)

    def _fill_plan(self, load: int | None = None) -> list[_Read]:
        """The reads of one fill, in order: own streams (any age, cached tokens discounted),
        the shared shards (`_read_order`), then the other owners' own streams that are due
        (`OwnStreamOwners.due_reads`)."""
        self._refresh_owners()
        plan = [_Read(self.own_streams, 0, "own", use_cached=True)]
        plan += [_Read(self.keys.queues(self.model, shard), min_age_ms, "shared")
                 for shard, min_age_ms in self._read_order()]
        due = self.owners.with_entries(self.owners.due_reads(load))
        plan += [_Read(self.keys.worker_queues(self.model, read.owner), read.min_age_ms, "other",
                       owner_room=read.owner_room) for read in due]
        return plan

    def _refresh_owners(self) -> None:
        self.owners.refresh()
        if not self.owners.listed:
            self._ensure_own_streams()

    def blocking_streams(self) -> list[str]:
        """The interactive stream of each shard, in rotation (what an idle worker blocks on,
        beside its own stream: `blocking_reads`)."""
        return [self.keys.queue(self.model, "interactive", shard) for shard in self._shard_order()]

    def blocking_reads(self) -> list[list[str]]:
        """What an idle worker blocks on, one XREADGROUP per list: its own interactive stream
        and each shard's interactive stream (in rotation). On a single Redis all in one call,
        which wakes for whichever gets an entry first; on a cluster one call each in turn (a
        blocking read spans one slot)."""
        shared = self.blocking_streams()
        if self.sharded:
            return [[self.own_streams[0]]] + [[stream] for stream in shared]
        return [[self.own_streams[0], *shared]]

    def idle_streams(self) -> list[str]:
        """The streams an idle worker looks at without blocking: the batch ones, own first."""
        blocking = {s for streams in self.blocking_reads() for s in streams}
        return [s for s in self.own_streams + self.streams if s not in blocking]

    def read_new(self, stream: str, block_ms: int | None) -> Delivery | None:
        """Take one new request from `stream` (XREADGROUP) whatever its size, waiting at most
        `block_ms`: for an idle worker, whose whole pool is free."""
        deliveries = self.read_new_any([stream], block_ms)
        return deliveries[0] if deliveries else None

    def read_new_any(self, streams: list[str], block_ms: int | None) -> list[Delivery]:
        """Take the next new request of each of `streams` (one slot) that has one, whatever their
        sizes, in one XREADGROUP that waits at most `block_ms` for the first: for an idle
        worker."""
        try:
            reply = self.client.xreadgroup(self.keys.group, self.worker_id,
                                           {stream: ">" for stream in streams}, count=1,
                                           block=block_ms)
        except redis.ResponseError as exc:
            # a stream (or its group) deleted, before the read or while it waited (UNBLOCKED):
            # own streams dropped by a worker that took this one for gone, keys deleted by an
            # operator or a FLUSHALL; make them again and read at the next turn
            if "NOGROUP" not in str(exc) and "UNBLOCKED" not in str(exc):
                raise
            log.warning("a request stream or its group was gone (%s); creating them again", exc)
            self.ensure_groups()
            return []
        deliveries = []
        for stream, entries in reply or []:
            stream = text(stream)
            source = self.source_of(stream)
            for entry_id, fields in entries:
                entry = QueueEntry.decode(fields)
                deliveries.append(Delivery(
                    entry.request, stream, text(entry_id), source=source,
                    cached_tokens=entry.cached_tokens if source == "own" else 0))
        return deliveries

    def claim_orphan(self, min_idle_ms: int, held: frozenset[str] = frozenset(),
                     prefer: ResumePreference | None = None,
                     numerics: FleetNumerics | None = None) -> Delivery | None:
        """Claim one entry whose worker is gone, oldest first; None when there is none.

        An entry is an orphan when it has sat idle at least `min_idle_ms` *and* its consumer has
        no heartbeat key — or the consumer is this worker's own id and the entry is not in `held`
        (a process that ran under the same id before this one). Idle time alone proves nothing:
        a live worker in a long step may be late refreshing. XCLAIM's own min-idle check makes the
        claim atomic against the owner's refresh and against other claimers. The shared shards,
        this worker's own streams and every other owner's are scanned.

        With `prefer`, a worker that holds less of the entry's prompt than another live worker
        claims it only once it has been idle `prefer.prefer_ms` longer (`resume_min_idle_ms`);
        with `numerics`, a worker of other numerics than the stream's tokens so far were computed
        on, while a live worker of those exists, only once idle `numerics.prefer_ms` longer.
        """
        self._refresh_owners()
        streams = self.streams + self.own_streams + self.owners.streams()
        pipe = self.client.pipeline(transaction=False)  # one round trip (one per node)
        for stream in streams:
            pipe.xpending_range(stream, self.keys.group, "-", "+", ORPHAN_SCAN_COUNT,
                                idle=min_idle_ms)
        for stream, pending in zip(streams, pipe.execute(raise_on_error=False)):
            if isinstance(pending, redis.ResponseError):
                if "NOGROUP" not in str(pending):
                    raise pending
                continue  # another owner's streams, dropped meanwhile
            if not pending:
                continue
            alive = self._consumers_alive({text(p["consumer"]) for p in pending})
            for entry in pending:
                consumer, entry_id = text(entry["consumer"]), text(entry["message_id"])
                if consumer == self.worker_id and entry_id in held:
                    continue
                if consumer != self.worker_id and alive[consumer]:
                    continue
                claim_idle_ms = min_idle_ms if prefer is None else resume_min_idle_ms(
                    self.client, self._prefix_match, self.keys, self.model, self.worker_id,
                    stream, entry_id, consumer, min_idle_ms, prefer)
                if numerics is not None and numerics.enabled:
                    claim_idle_ms += self._numerics_wait_ms(stream, entry_id, consumer, numerics)
                delivery = self._claim_entry(stream, entry_id, claim_idle_ms,
                                             entry["times_delivered"] + 1)
                if delivery is not None:
                    return delivery
        return None

    def _numerics_wait_ms(self, stream: str, entry_id: str, consumer: str,
                          numerics: FleetNumerics) -> int:
        """FleetNumerics.wait_ms for the request of a stream entry (0 when it was trimmed)."""
        found = self.client.xrange(stream, min=entry_id, max=entry_id)
        if not found:
            return 0
        req_id = text(field_value(found[0][1], QueueEntry.ID))
        return numerics.wait_ms(numerics.chain_of(req_id), gone=consumer)

    def _consumers_alive(self, consumers: set[str]) -> dict[str, bool]:
        """Which consumers still have a heartbeat key, in one round trip."""
        names = sorted(consumers)
        pipe = self.client.pipeline(transaction=False)
        for name in names:
            pipe.exists(self.keys.worker(name))
        return {name: bool(n) for name, n in zip(names, pipe.execute())}

    def _claim_entry(self, stream: str, entry_id: str, min_idle_ms: int,
                     times_delivered: int) -> Delivery | None:
        """XCLAIM one entry if it is still idle; an entry trimmed from the stream is acked."""
        claimed = self.client.xclaim(stream, self.keys.group, self.worker_id, min_idle_ms,
                                     [entry_id])
        if not claimed:  # refreshed by its owner, taken by another claimer, or deleted (Redis 7)
            return None
        _, fields = claimed[0]
        if not fields:  # trimmed away (Redis 6 still returns it): nothing to resume
            self.client.xack(stream, self.keys.group, entry_id)
            return None
        return Delivery(QueueEntry.decode(fields).request, stream, entry_id, times_delivered,
                        source=self.source_of(stream))

    def claim_handed(self, stream: str, entry_id: str) -> Delivery | None:
        """XCLAIM the entry of a stream handed to this worker with its KV (its source may still
        refresh it for a moment: this worker's refreshes take it back), with its request; None
        when it was acked meanwhile (nothing to serve)."""
        return self._claim_entry(stream, entry_id, 0, 1)

    def ack(self, stream: str, entry_id: str) -> None:
        """Acknowledge an entry this worker will not serve (a duplicate of one it serves)."""
        self.client.xack(stream, self.keys.group, entry_id)

    def start_attempt(self, req_id: str) -> Started | None:
        """Fence a new attempt, read the checkpoint (the tokens generated so far) and record this
        worker's numerics in the request's chain; None when the request is already finished (its
        entry only needs its XACK)."""
        call = scripts.start_attempt(self.keys, req_id, self.worker_id, self.numerics)
        return Started.decode(self._start_attempt(keys=call.keys, args=call.args))

    def start_attempts(self, req_ids: list[str]) -> list[Started | None]:
        """`start_attempt` for several requests in one pipelined round trip (one per node on a
        cluster), results in order."""
        calls = [scripts.start_attempt(self.keys, req_id, self.worker_id, self.numerics)
                 for req_id in req_ids]
        return [Started.decode(reply)
                for reply in run_pipelined(self.client, self._start_attempt, calls)]

    def publish(self, items: list[Publication]) -> list[bool]:
        """Checkpoint + publish every item in one round trip, then XACK the entries of the final
        events that were accepted; False where the attempt was stale."""
        if not items:
            return []
        calls = [scripts.publish(self.keys, item.req_id, item.attempt, item.event,
                                 item.final_status, self.result_ttl_s, sharded=self.sharded,
                                 reply_to=item.reply_to)
                 for item in items]
        replies, undelivered = run_per_node(self.client, self._publish_step, self._publish, calls)
        accepted = [bool(ok) for ok in replies]
        if undelivered:
            self._publish_elsewhere(undelivered)
        finals = [item for item, ok in zip(items, accepted)
                  if ok and item.final_status is not None and item.entry_id]
        if finals:
            pipe = self.client.pipeline(transaction=False)
            for item in finals:
                pipe.xack(item.stream, self.keys.group, item.entry_id)
            pipe.execute()
        return accepted

    def record_timelines(self, timelines: list[RequestTimeline], kept: int) -> None:
        """Append finished requests' timelines to the model's timelines stream, keeping about
        the last `kept` (`--timelines-kept`)."""
        if not timelines:
            return
        pipe = self.client.pipeline(transaction=False)
        for timeline in timelines:
            pipe.xadd(self.keys.timelines(self.model), timeline.encode(), maxlen=kept,
                      approximate=True)
        pipe.execute()

    def _publish_elsewhere(self, undelivered: list) -> None:
        """Publish the messages a node handed back (channel, message, ...): inboxes whose slot
        it does not serve, sent through the cluster client to the node that does."""
        command = "SPUBLISH" if self.sharded else "PUBLISH"
        for channel, message in zip(undelivered[::2], undelivered[1::2]):
            self.client.execute_command(command, channel, message)

    def subscribe_cancels(self):
        """A pub/sub subscribed to the cancel channel (sharded on a cluster)."""
        pubsub = self.client.pubsub(ignore_subscribe_messages=True)
        if self.sharded:
            pubsub.ssubscribe(self.keys.cancel())
        else:
            pubsub.subscribe(self.keys.cancel())
        return pubsub

    def next_cancel(self, pubsub) -> str | None:
        """The next cancelled request id waiting on `pubsub`, None when none waits."""
        while True:
            if self.sharded:
                message = pubsub.get_sharded_message(timeout=0)
            else:
                message = pubsub.get_message(timeout=0)
            if message is None:
                return None
            if message.get("type") in ("message", "smessage"):
                return text(message["data"])

    def fail(self, delivery: Delivery, attempt: int, seq: int, message: str,
             dead_letter: bool = False) -> None:
        """End a request with an error event to its client (and the dead-letter stream if asked)."""
        req_id = delivery.request.req_id
        if dead_letter:
            entry = DeadLetterEntry(delivery.request, message, self.worker_id)
            self.client.xadd(self.keys.dead_letter(self.model), entry.encode(),
                             maxlen=DeadLetterEntry.MAXLEN, approximate=True)
        event = TokenEvent(seq=seq, attempt=attempt, finish_reason="error", error=message)
        self.publish([Publication(req_id, attempt, event, RequestStatus.FINISHED_ERROR,
                                  delivery.stream, delivery.entry_id,
                                  delivery.request.reply_to)])

    def refresh_pending(self, entries: dict[str, list[str]]) -> None:
        """Reset the idle time of this worker's in-flight entries (XCLAIM … JUSTID, which does
        not count as a delivery) so that they never look abandoned while this worker lives."""
        pipe = self.client.pipeline(transaction=False)
        for stream, ids in entries.items():
            if ids:
                pipe.xclaim(stream, self.keys.group, self.worker_id, 0, ids, justid=True)
        pipe.execute()

    def heartbeat(self, beat: Heartbeat, ttl_s: float) -> None:
        """Write `beat` (stamped with this worker's model, the time now and the entries waiting
        in its own streams) with a TTL."""
        key = self.keys.worker(self.worker_id)
        own_queue = undelivered_entries(self.client, self.own_streams, self.keys.group)
        beat = dataclasses.replace(beat, model=self.model, ts=time.time(), own_queue=own_queue)
        pipe = self.client.pipeline(transaction=False)
        pipe.hset(key, mapping=beat.encode())
        pipe.pexpire(key, int(ttl_s * 1000))
        pipe.execute()

    def announce(self, stored: list[BlockHash], removed: list[BlockHash],
                 host: list[BlockHash] = (), *, clear: bool, ttl_s: float) -> int:
        """ANNOUNCE_BLOCKS: a net change of this worker's prefix cache (empty: only stay listed
        for another `ttl_s`; `clear`: the set starts over, a new start), `host` the blocks now in
        its host tier (NetChange.peek's form). Returns the size of its set in Redis."""
        call = affinity.announce_blocks(self.keys, self.model, self.worker_id,
                                        ttl_ms=int(ttl_s * 1000), stored=pack_ids(stored),
                                        removed=pack_ids(removed), host=pack_ids(host),
                                        clear=clear)
        size, _ = self._announce(keys=call.keys, args=call.args)
        return int(size)

    def remove_heartbeat(self) -> None:
        self.client.delete(self.keys.worker(self.worker_id))
        if self.uses_homes and self._roster_ttl_s:
            self.update_roster(self._roster_ttl_s, join=False)
