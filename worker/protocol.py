"""The worker's side of the fleet protocol: every Redis read and write a worker makes.

Ordering guarantees (DESIGN.md, "The fleet protocol"):
- `claim` increments the request's `attempt` (the fencing token) and reads its checkpoint in one
  atomic script, so the claimer resumes exactly after the last token any earlier attempt recorded.
- `publish` appends new tokens to the checkpoint, publishes them and, on the final event, records the
  status and XACKs — one script per request, all requests of a step in one pipelined round trip.
  The script does nothing and returns 0 when the attempt is stale: that worker must stop the request.
- `claim_orphan` takes over an entry only when the worker holding it has no heartbeat key; the
  holder keeps its entries' idle time low (`refresh_pending`) from the moment each is delivered.
"""

from __future__ import annotations

import array
import logging
import time
from dataclasses import dataclass

import redis

from shared.wire import PRIORITIES, GenerationRequest, Keys, RequestStatus, TokenEvent

log = logging.getLogger(__name__)

# Idle pending entries looked at per stream per orphan check: entries of live workers are skipped,
# so the scan must see past them.
ORPHAN_SCAN_COUNT = 100

# KEYS: request hash, checkpoint. ARGV: worker id.
# Returns {attempt, checkpoint bytes}.
_CLAIM = """
local attempt = redis.call('HINCRBY', KEYS[1], 'attempt', 1)
redis.call('HSET', KEYS[1], 'status', ARGV[2], 'worker', ARGV[1])
local ckpt = redis.call('GET', KEYS[2]) or ''
return {attempt, ckpt}
"""

# KEYS: request hash, checkpoint, token channel, request stream.
# ARGV: attempt, packed event, new token bytes, final status ('' if not final), stream entry id,
#       group, result ttl seconds.
_PUBLISH = """
if tonumber(redis.call('HGET', KEYS[1], 'attempt') or '-1') ~= tonumber(ARGV[1]) then
  return 0
end
if ARGV[3] ~= '' then redis.call('APPEND', KEYS[2], ARGV[3]) end
redis.call('PUBLISH', KEYS[3], ARGV[2])
if ARGV[4] ~= '' then
  redis.call('HSET', KEYS[1], 'status', ARGV[4])
  redis.call('EXPIRE', KEYS[1], ARGV[7])
  redis.call('EXPIRE', KEYS[2], ARGV[7])
  if ARGV[5] ~= '' then redis.call('XACK', KEYS[4], ARGV[6], ARGV[5]) end
end
return 1
"""


def encode_tokens(token_ids: list[int]) -> bytes:
    """Checkpoint encoding: little-endian uint32 per token, so APPEND extends it in O(1)."""
    data = array.array("I", token_ids)
    if data.itemsize != 4:  # pragma: no cover - every supported platform has 4-byte unsigned int
        raise RuntimeError("uint32 array expected")
    return data.tobytes()


def decode_tokens(raw: bytes | None) -> list[int]:
    data = array.array("I")
    data.frombytes(raw or b"")
    return data.tolist()


@dataclass
class Delivery:
    """A request this worker took from a stream (new, or claimed from a dead worker)."""

    request: GenerationRequest
    stream: str
    entry_id: str
    times_delivered: int = 1


@dataclass
class Publication:
    """What one step produced for one request, to be checkpointed and published."""

    req_id: str
    attempt: int
    event: TokenEvent
    final_status: RequestStatus | None
    stream: str
    entry_id: str


class WorkerProtocol:
    """Redis operations of one worker, for one model."""

    def __init__(self, client: redis.Redis, keys: Keys, model: str, worker_id: str,
                 result_ttl_s: int = 3600):
        self.client = client
        self.keys = keys
        self.model = model
        self.worker_id = worker_id
        self.result_ttl_s = result_ttl_s
        self._claim = client.register_script(_CLAIM)
        self._publish = client.register_script(_PUBLISH)

    @property
    def streams(self) -> list[str]:
        """Request streams in the order they are served: interactive before batch."""
        return [self.keys.queue(self.model, p) for p in PRIORITIES]

    def ensure_groups(self) -> None:
        for stream in self.streams:
            try:
                # id 0: entries added before any worker existed are delivered too.
                self.client.xgroup_create(stream, self.keys.group, id="0", mkstream=True)
            except redis.ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise

    def peek_next(self) -> tuple[str, GenerationRequest] | None:
        """The next undelivered request (stream, request) without taking it, highest priority first."""
        for stream in self.streams:
            groups = self.client.xinfo_groups(stream)
            group = next((g for g in groups if _s(g["name"]) == self.keys.group), None)
            if group is None:
                continue
            last = _s(group["last-delivered-id"])
            entries = self.client.xrange(stream, min=f"({last}" if last != "0-0" else "-", count=1)
            if entries:
                return stream, GenerationRequest.unpack(entries[0][1][b"payload"])
        return None

    def read_new(self, stream: str, block_ms: int | None) -> Delivery | None:
        """Take one new request from `stream` (XREADGROUP), waiting at most `block_ms`."""
        reply = self.client.xreadgroup(self.keys.group, self.worker_id, {stream: ">"}, count=1,
                                       block=block_ms)
        for _, entries in reply or []:
            for entry_id, fields in entries:
                return Delivery(GenerationRequest.unpack(fields[b"payload"]), stream, _s(entry_id))
        return None

    def claim_orphan(self, min_idle_ms: int, held: frozenset[str] = frozenset()) -> Delivery | None:
        """Claim one entry whose worker is gone, oldest first; None when there is none.

        An entry is an orphan when it has sat idle at least `min_idle_ms` *and* its consumer has
        no heartbeat key — or the consumer is this worker's own id and the entry is not in `held`
        (a process that ran under the same id before this one). Idle time alone proves nothing:
        a live worker in a long step may be late refreshing. XCLAIM's own min-idle check makes the
        claim atomic against the owner's refresh and against other claimers.
        """
        for stream in self.streams:
            pending = self.client.xpending_range(stream, self.keys.group, "-", "+",
                                                 ORPHAN_SCAN_COUNT, idle=min_idle_ms)
            if not pending:
                continue
            alive = self._consumers_alive({_s(p["consumer"]) for p in pending})
            for entry in pending:
                consumer, entry_id = _s(entry["consumer"]), _s(entry["message_id"])
                if consumer == self.worker_id and entry_id in held:
                    continue
                if consumer != self.worker_id and alive[consumer]:
                    continue
                delivery = self._claim_entry(stream, entry_id, min_idle_ms,
                                             entry["times_delivered"] + 1)
                if delivery is not None:
                    return delivery
        return None

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
        return Delivery(GenerationRequest.unpack(fields[b"payload"]), stream, entry_id,
                        times_delivered)

    def ack(self, stream: str, entry_id: str) -> None:
        """Acknowledge an entry this worker will not serve (a duplicate of one it serves)."""
        self.client.xack(stream, self.keys.group, entry_id)

    def start_attempt(self, req_id: str) -> tuple[int, list[int]]:
        """Fence a new attempt and read the checkpoint: (attempt, tokens generated so far)."""
        attempt, raw = self._claim(keys=[self.keys.request(req_id), self.keys.checkpoint(req_id)],
                                   args=[self.worker_id, RequestStatus.RUNNING.value])
        return int(attempt), decode_tokens(raw)

    def publish(self, items: list[Publication]) -> list[bool]:
        """Checkpoint + publish every item in one round trip; False where the attempt was stale."""
        if not items:
            return []
        pipe = self.client.pipeline(transaction=False)
        for item in items:
            self._publish(
                keys=[self.keys.request(item.req_id), self.keys.checkpoint(item.req_id),
                      self.keys.tokens(item.req_id), item.stream],
                args=[item.attempt, item.event.pack(), encode_tokens(item.event.token_ids),
                      item.final_status.value if item.final_status else "", item.entry_id,
                      self.keys.group, self.result_ttl_s],
                client=pipe)
        return [bool(ok) for ok in pipe.execute()]

    def fail(self, delivery: Delivery, attempt: int, seq: int, message: str,
             dead_letter: bool = False) -> None:
        """End a request with an error event to its client (and the dead-letter stream if asked)."""
        req_id = delivery.request.req_id
        if dead_letter:
            self.client.xadd(self.keys.dead_letter(self.model),
                             {"id": req_id, "payload": delivery.request.pack(),
                              "error": message, "worker": self.worker_id},
                             maxlen=10_000, approximate=True)
        event = TokenEvent(seq=seq, attempt=attempt, finish_reason="error", error=message)
        self.publish([Publication(req_id, attempt, event, RequestStatus.FINISHED_ERROR,
                                  delivery.stream, delivery.entry_id)])

    def refresh_pending(self, entries: dict[str, list[str]]) -> None:
        """Reset the idle time of this worker's in-flight entries (XCLAIM … JUSTID, which does
        not count as a delivery) so that they never look abandoned while this worker lives."""
        pipe = self.client.pipeline(transaction=False)
        for stream, ids in entries.items():
            if ids:
                pipe.xclaim(stream, self.keys.group, self.worker_id, 0, ids, justid=True)
        pipe.execute()

    def heartbeat(self, fields: dict[str, str | int | float], ttl_s: float) -> None:
        key = self.keys.worker(self.worker_id)
        pipe = self.client.pipeline(transaction=False)
        pipe.hset(key, mapping={**fields, "model": self.model, "ts": time.time()})
        pipe.pexpire(key, int(ttl_s * 1000))
        pipe.execute()

    def remove_heartbeat(self) -> None:
        self.client.delete(self.keys.worker(self.worker_id))


def _s(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
