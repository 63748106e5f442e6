"""The wire contract of prefix-affinity routing (docs/ARCHITECTURE.md, "Prefix-affinity
routing"): workers announce the blocks their prefix cache stores and evicts; gateways keep an
index of who holds what and route a request to the worker holding most of its prompt.

- ANNOUNCE_BLOCKS: one call per worker step that changed its cache (and one per heartbeat to
  stay listed): the worker's set of announce ids (`Keys.kv_blocks`: every block it holds, in
  either tier) and its subset held only in the host tier (`Keys.kv_host_blocks`) are updated,
  its place in `Keys.kv_workers` refreshed, and the change appended to `Keys.kv_events` — one
  script, so the sets and the event stream never disagree about an event's effect.
- PREFIX_SNAPSHOT: the gateway's start (or a gap in the events it read): the last event id and
  every listed worker's sets, read at one moment; the gateway applies the events after that id.
- PREFIX_MATCH: how many leading blocks of a prompt each listed worker holds, in either tier (a
  worker resuming a dead worker's request defers to the one holding most of it).

Tiers and rolling upgrades: an event's `h` field (ids now held only in the host tier) is new; a
reader that knows only `s` and `r` (an older gateway) keeps a block moved to the host tier as
held, adds a block new to the set from `s` (where such a block is listed too) and drops it at
`r`: it sees every block the worker holds, in either tier, at one weight, as it would after a
snapshot of `kv_blocks`. A worker that sends no `h` (an older one) holds everything on device.
- DROP_OWN_STREAMS: a gone worker's own streams are deleted only when they hold nothing (no
  entry pending, none undelivered), checked and done in one step.
- OWN_STREAMS_WAITING: whether a worker's own streams hold an undelivered entry: a worker probes
  every other owner's streams that are due a read in one pipelined round trip, then runs
  READ_IF_FITS only where something waits (one round trip per owner with work, not per owner).
All keys of one model's announcements share the model's tag: one slot, one node on a cluster.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from kvfleet.shared.wire.keys import Keys
from kvfleet.shared.wire.lua import LuaScript, ScriptCall
from kvfleet.shared.wire.prefix_hash import ANNOUNCE_BYTES, unpack_ids
from kvfleet.shared.wire.records import RawFields, field_value, text

KV_EVENTS_MAXLEN = 100_000  # approximate cap of a model's event stream (entries)
KV_EVENTS_TTL_MS = 3_600_000  # the event stream of a model no worker announces for expires


@dataclass(frozen=True)
class KvEvent:
    """One entry of `Keys.kv_events`: what one worker's step changed in its prefix cache."""

    WORKER: ClassVar[str] = "w"
    STORED: ClassVar[str] = "s"  # packed announce ids (prefix_hash.pack_ids)
    REMOVED: ClassVar[str] = "r"
    CLEARED: ClassVar[str] = "c"  # "1": the worker's set was emptied first (a new start)
    HOST: ClassVar[str] = "h"  # packed announce ids now held only in the host tier

    # applied in the order removed, stored (on device), host: an id in both `stored` and `host`
    # is new to the worker's set, held in its host tier
    worker_id: str
    stored: tuple[bytes, ...] = ()
    removed: tuple[bytes, ...] = ()
    cleared: bool = False
    host: tuple[bytes, ...] = ()

    @classmethod
    def decode(cls, raw: RawFields) -> KvEvent:
        def ids(name: str) -> tuple[bytes, ...]:
            value = field_value(raw, name) or b""
            return tuple(unpack_ids(value if isinstance(value, bytes) else value.encode()))
        return cls(text(field_value(raw, cls.WORKER)), ids(cls.STORED), ids(cls.REMOVED),
                   text(field_value(raw, cls.CLEARED)) == "1", ids(cls.HOST))


NAMES = {"w": KvEvent.WORKER, "s": KvEvent.STORED, "r": KvEvent.REMOVED,
         "c": KvEvent.CLEARED, "h": KvEvent.HOST, "n": str(ANNOUNCE_BYTES)}

ANNOUNCE_BLOCKS = LuaScript.build(
    "announce_blocks",
    keys=["the worker's block set (Keys.kv_blocks)", "the model's announcing workers "
          "(Keys.kv_workers)", "the model's event stream (Keys.kv_events)",
          "the worker's host-tier subset (Keys.kv_host_blocks)"],
    argv=["worker id", "TTL of the worker's sets and listing, ms (the heartbeat TTL)",
          "1: empty the sets first (a worker's first announcement)",
          "stored announce ids, packed (on device; or new to the set, then also in host)",
          "removed announce ids, packed",
          "approximate cap of the event stream", "TTL of the event stream, ms",
          "announce ids now held only in the host tier, packed"],
    returns="{size of the worker's set, the event's id ('' when nothing changed)}",
    names=NAMES,
    source="""
local now = redis.call('TIME')
local ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
local ttl = tonumber(ARGV[2])
local function apply(command, key, packed)
  local batch = {}
  for i = 1, #packed - ${n} + 1, ${n} do
    batch[#batch + 1] = string.sub(packed, i, i + ${n} - 1)
    if #batch == 1000 then
      redis.call(command, key, unpack(batch))
      batch = {}
    end
  end
  if #batch > 0 then redis.call(command, key, unpack(batch)) end
end
local cleared = ARGV[3] == '1'
if cleared then redis.call('DEL', KEYS[1], KEYS[4]) end
apply('SREM', KEYS[1], ARGV[5])
apply('SREM', KEYS[4], ARGV[5])
apply('SADD', KEYS[1], ARGV[4])
apply('SREM', KEYS[4], ARGV[4])
apply('SADD', KEYS[1], ARGV[8])
apply('SADD', KEYS[4], ARGV[8])
for _, key in ipairs({KEYS[1], KEYS[4]}) do
  if redis.call('EXISTS', key) == 1 then redis.call('PEXPIRE', key, ttl) end
end
redis.call('ZADD', KEYS[2], ms, ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', '(' .. (ms - ttl))
redis.call('PEXPIRE', KEYS[2], ttl)
local id = ''
if cleared or #ARGV[4] > 0 or #ARGV[5] > 0 or #ARGV[8] > 0 then
  local fields = {'${w}', ARGV[1]}
  if #ARGV[4] > 0 then fields[#fields + 1] = '${s}'; fields[#fields + 1] = ARGV[4] end
  if #ARGV[5] > 0 then fields[#fields + 1] = '${r}'; fields[#fields + 1] = ARGV[5] end
  if #ARGV[8] > 0 then fields[#fields + 1] = '${h}'; fields[#fields + 1] = ARGV[8] end
  if cleared then fields[#fields + 1] = '${c}'; fields[#fields + 1] = '1' end
  id = redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[6], '*', unpack(fields))
  redis.call('PEXPIRE', KEYS[3], ARGV[7])
end
return {redis.call('SCARD', KEYS[1]), id}
""")


def announce_blocks(keys: Keys, model: str, worker_id: str, *, ttl_ms: int, stored: bytes = b"",
                    removed: bytes = b"", clear: bool = False, host: bytes = b"") -> ScriptCall:
    """A worker's announcement: `stored`, `removed` and `host` are packed announce ids (a net
    change, NetChange.peek's form: an id removed is in neither other; one in `host` is held only
    in the host tier, and is in `stored` too when new to the set)."""
    return ANNOUNCE_BLOCKS.bind(
        [keys.kv_blocks(model, worker_id), keys.kv_workers(model), keys.kv_events(model),
         keys.kv_host_blocks(model, worker_id)],
        [worker_id, ttl_ms, int(clear), stored, removed, KV_EVENTS_MAXLEN, KV_EVENTS_TTL_MS, host])


PREFIX_SNAPSHOT = LuaScript.build(
    "prefix_snapshot",
    keys=["the model's announcing workers (Keys.kv_workers)", "the model's event stream "
          "(Keys.kv_events)", "then for each worker wanted its block set (Keys.kv_blocks) and "
          "its host-tier subset (Keys.kv_host_blocks)"],
    variadic_keys=True,
    argv=["TTL of a listing, ms: workers not seen this long are left out"],
    returns="{id of the last event ('0-0': none), {worker id, ...} listed now, then for each set "
            "given: {announce id, ...}}. A caller that finds a listed worker whose sets it did "
            "not pass calls again with them.",
    source="""
local now = redis.call('TIME')
local ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
local last = redis.call('XREVRANGE', KEYS[2], '+', '-', 'COUNT', 1)
local out = {'0-0', redis.call('ZRANGEBYSCORE', KEYS[1], ms - tonumber(ARGV[1]), '+inf')}
if #last > 0 then out[1] = last[1][1] end
for i = 3, #KEYS do out[#out + 1] = redis.call('SMEMBERS', KEYS[i]) end
return out
""")


def prefix_snapshot(keys: Keys, model: str, worker_ids: Sequence[str], *,
                    ttl_ms: int) -> ScriptCall:
    sets = [key for w in worker_ids for key in (keys.kv_blocks(model, w),
                                                keys.kv_host_blocks(model, w))]
    return ScriptCall([keys.kv_workers(model), keys.kv_events(model), *sets], [ttl_ms])


PREFIX_MATCH = LuaScript.build(
    "prefix_match",
    keys=["block sets (Keys.kv_blocks) of the workers to compare"],
    variadic_keys=True,
    argv=["a prompt's announce ids in order, packed"],
    returns="{for each set: how many leading ids of the prompt it holds}",
    names=NAMES,
    source="""
local out = {}
for k, key in ipairs(KEYS) do
  local count = 0
  for i = 1, #ARGV[1] - ${n} + 1, ${n} do
    if redis.call('SISMEMBER', key, string.sub(ARGV[1], i, i + ${n} - 1)) == 0 then break end
    count = count + 1
  end
  out[k] = count
end
return out
""")


def prefix_match(keys: Keys, model: str, worker_ids: Sequence[str], packed: bytes) -> ScriptCall:
    return PREFIX_MATCH.bind([keys.kv_blocks(model, w) for w in worker_ids], [packed])


_GROUP_STATE = """
local function group_state(stream, group)
  for _, info in ipairs(redis.call('XINFO', 'GROUPS', stream)) do
    local fields = {}
    for j = 1, #info, 2 do fields[info[j]] = info[j + 1] end
    if fields['name'] == group then return fields end
  end
  return nil
end

-- whether an existing stream holds an entry after its group's last-delivered id
local function has_undelivered(stream, state)
  local last = state['last-delivered-id']
  local start = '-'
  if last ~= '0-0' then start = '(' .. last end
  return #redis.call('XRANGE', stream, start, '+', 'COUNT', 1) > 0
end
"""

DROP_OWN_STREAMS = LuaScript.build(
    "drop_own_streams",
    keys=["a gone worker's own streams (Keys.worker_queues)"],
    variadic_keys=True,
    argv=["consumer group"],
    returns="1 when the streams held nothing (no entry pending, none undelivered) and were "
            "deleted; 0 when they hold work (left as they are)",
    source=_GROUP_STATE + """
for _, stream in ipairs(KEYS) do
  if redis.call('EXISTS', stream) == 1 then
    local group = group_state(stream, ARGV[1])
    if group == nil then
      if redis.call('XLEN', stream) > 0 then return 0 end
    elseif tonumber(group['pending']) > 0 or has_undelivered(stream, group) then
      return 0
    end
  end
end
redis.call('DEL', unpack(KEYS))
return 1
""")

OWN_STREAMS_WAITING = LuaScript.build(
    "own_streams_waiting",
    keys=["a worker's own streams (Keys.worker_queues)"],
    variadic_keys=True,
    argv=["consumer group"],
    returns="1 when a stream with the group holds an entry after the group's last-delivered id "
            "(one READ_IF_FITS could deliver), else 0",
    source=_GROUP_STATE + """
for _, stream in ipairs(KEYS) do
  if redis.call('EXISTS', stream) == 1 then
    local group = group_state(stream, ARGV[1])
    if group ~= nil and has_undelivered(stream, group) then return 1 end
  end
end
return 0
""")
