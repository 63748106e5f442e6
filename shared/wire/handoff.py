"""KV handoff between workers: Redis only coordinates, the bytes travel on the workers' own
transfer plane (worker/handoff/transfer.py).

The protocol (docs/ARCHITECTURE.md, "KV handoff"):
1. The source (a draining worker, or a prefill worker after a stream's first token) offers a
   running stream: HSET `Keys.handoff_offers(model)` handoff id -> HandoffOffer. It keeps
   decoding the stream until a taker asks for it.
2. A taker with room (its KV holds `num_tokens` and the watermark: pull, as everywhere else)
   removes one offer from the hash (TAKE_OFFER: one offer, one taker) and asks the source's
   transfer plane for it.
3. The source, between two steps, publishes the stream's pending events (the checkpoint then
   holds every token it generated), takes the stream out of its engine with a host copy of its
   KV, sets the lease `Keys.handoff_lease(req_id)` = `sent:<handoff id>` (TTL: the lease) and
   sends the copy. It keeps the copy until the lease resolves.
4. The taker fences the request (START_HANDOFF: only while the lease says `sent:<id>`; the
   attempt increments as START_ATTEMPT does, the checkpoint comes back), claims the stream entry
   (XCLAIM), and continues the stream from the copy: no recompute. Its checkpoint must equal the
   copy's output tokens; otherwise it resumes from the checkpoint as a claimer would.
5. The source reads the lease (RECLAIM_HANDOFF): `taken` -> the stream is gone, it drops its
   copy and stops refreshing the entry; `sent` past the lease, or expired -> it deletes the lease
   (a late START_HANDOFF then fails) and puts its own copy back into its engine: nothing lost,
   nothing repeated. A taker that dies after START_HANDOFF holds the entry (or the source still
   does, unheld): it is an orphan once that worker's heartbeat (or the entry's refresh) is gone,
   and a claimer resumes it from the checkpoint.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from kvfleet.shared.wire.keys import Keys
from kvfleet.shared.wire.lua import LuaScript, ScriptCall
from kvfleet.shared.wire.messages import pack, unpack
from kvfleet.shared.wire.scripts import FINISHED, NAMES, RECORD_NUMERICS_LUA
from kvfleet.shared.wire.status import RequestStatus

SENT = "sent:"
TAKEN = "taken:"


@dataclass(frozen=True)
class HandoffOffer:
    """A running stream one worker offers to another, with where to fetch its KV."""

    handoff_id: str  # unique per offer
    req_id: str
    worker_id: str  # the source
    addr: str  # host:port of the source's transfer plane
    stream: str  # the request's stream entry, which the taker claims
    entry_id: str
    num_tokens: int  # prompt + output tokens now: the room the taker needs
    num_bytes: int  # the KV bytes to move (at offer time)
    reason: str = "drain"  # drain | prefill
    lora: str = ""  # the adapter the stream runs under ("" = base model)
    created: float = 0.0  # unix time of the offer
    numerics: str = ""  # the source's numerics fingerprint: takers with the same one come first

    def pack(self) -> bytes:
        return pack(dataclasses.asdict(self))

    @classmethod
    def unpack(cls, raw: bytes) -> HandoffOffer:
        data = unpack(raw)
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


def new_handoff_id(req_id: str, worker_id: str, serial: int) -> str:
    return f"{req_id}@{worker_id}#{serial}"


TAKE_OFFER = LuaScript.build(
    "take_offer",
    keys=["offers hash (Keys.handoff_offers)"],
    argv=["handoff id"],
    returns="the packed HandoffOffer, removed from the hash; nil when another taker (or the "
            "source's withdrawal) was first",
    source="""
local offer = redis.call('HGET', KEYS[1], ARGV[1])
if not offer then return false end
redis.call('HDEL', KEYS[1], ARGV[1])
return offer
""")


def take_offer(keys: Keys, model: str, handoff_id: str) -> ScriptCall:
    return TAKE_OFFER.bind([keys.handoff_offers(model)], [handoff_id])


START_HANDOFF = LuaScript.build(
    "start_handoff",
    keys=["request hash (Keys.request)", "checkpoint (Keys.checkpoint)",
          "lease (Keys.handoff_lease)"],
    argv=["worker id (the taker)", "handoff id", "lease TTL once taken, ms",
          "the taker's numerics fingerprint ('' = unknown)", "status (running)",
          "the finished statuses (one or more)"],
    variadic_argv=True,
    returns="{attempt (the new fencing token), checkpoint bytes, numerics chain, appended} as "
            "START_ATTEMPT's when the lease was `sent:<id>` (it becomes `taken:<id>:<taker>`); "
            "{-1, ''} when the lease is gone or another's (nothing written: the source keeps the "
            "stream); {0, '', status} when the request is already finished",
    names=NAMES,
    source=RECORD_NUMERICS_LUA + """
local lease = redis.call('GET', KEYS[3])
if lease ~= 'sent:' .. ARGV[2] then return {-1, ''} end
local status = redis.call('HGET', KEYS[1], '${req_status}')
for i = 6, #ARGV do
  if status == ARGV[i] then return {0, '', status} end
end
redis.call('SET', KEYS[3], 'taken:' .. ARGV[2] .. ':' .. ARGV[1], 'PX', ARGV[3])
local attempt = redis.call('HINCRBY', KEYS[1], '${req_attempt}', 1)
redis.call('HSET', KEYS[1], '${req_status}', ARGV[5], '${req_worker}', ARGV[1])
local ckpt = redis.call('GET', KEYS[2]) or ''
local numerics = record_numerics(KEYS[1], ckpt, ARGV[4])
return {attempt, ckpt, numerics[1], numerics[2]}
""")


def start_handoff(keys: Keys, req_id: str, worker_id: str, handoff_id: str,
                  taken_ttl_ms: int, numerics: str = "") -> ScriptCall:
    return START_HANDOFF.bind(
        [keys.request(req_id), keys.checkpoint(req_id), keys.handoff_lease(req_id)],
        [worker_id, handoff_id, taken_ttl_ms, numerics, RequestStatus.RUNNING.value, *FINISHED])


RECLAIM_HANDOFF = LuaScript.build(
    "reclaim_handoff",
    keys=["lease (Keys.handoff_lease)"],
    argv=["handoff id", "1: take the stream back if not taken (deletes a `sent` lease); 0: only "
          "look"],
    returns="'taken' (the taker fenced it), 'sent' (still waiting, only when looking), 'back' "
            "(not taken: the source keeps the stream; a later START_HANDOFF fails)",
    source="""
local lease = redis.call('GET', KEYS[1])
local taken = 'taken:' .. ARGV[1] .. ':'
if lease and string.sub(lease, 1, #taken) == taken then
  return 'taken'
end
if lease == 'sent:' .. ARGV[1] then
  if ARGV[2] == '0' then return 'sent' end
  redis.call('DEL', KEYS[1])
end
return 'back'
""")


def reclaim_handoff(keys: Keys, req_id: str, handoff_id: str, take_back: bool) -> ScriptCall:
    return RECLAIM_HANDOFF.bind([keys.handoff_lease(req_id)], [handoff_id, int(take_back)])
