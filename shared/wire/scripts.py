"""The Lua scripts of a request's life, each with its KEYS and ARGV, and the function that builds
a call of it. Ordering guarantees (docs/ARCHITECTURE.md, "Scripts"):

- ENQUEUE writes the request hash once per request id; the caller XADDs the stream entry only
  when it did (a retried enqueue writes nothing twice). Two steps because the stream shard and
  the request live in different slots of a cluster; the same two steps run on a single Redis.
- READ_IF_FITS delivers the next undelivered entries (up to a count) only while their prompts fit
  the worker's budget: the entries tested are the entries delivered (one script, no second reader
  in between), several in one call so that filling a worker's free room is one call per shard.
- START_ATTEMPT increments `attempt` (the fencing token) and reads the checkpoint atomically, so a
  claimer resumes exactly after the last token any earlier attempt recorded.
- PUBLISH appends to the checkpoint before it publishes (PUBLISH_STEP: the same for every request
  of a worker's step that lives on one node, in one call, one message per reply channel), so a
  gateway that missed an event finds its tokens in the checkpoint; it writes nothing for a stale
  attempt.
- ATTACH marks a request watched before it reads the hash and checkpoint: a reader attached by id
  (subscribed to the request's own channel first) gets every later event there. The final XACK follows it
  (same pipeline): a worker killed between the two leaves a finished request pending, which a
  claimer finds finished (START_ATTEMPT returns the status) and only acks.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvfleet.shared.wire.checkpoint import TOKEN_BYTES, decode_checkpoint, encode_checkpoint
from kvfleet.shared.wire.keys import Keys
from kvfleet.shared.wire.lua import LuaScript, ScriptCall
from kvfleet.shared.wire.messages import GenerationRequest, TokenEvent
from kvfleet.shared.wire.records import QueueEntry, RequestRecord, text
from kvfleet.shared.wire.status import RequestStatus

NAMES = {
    "req_payload": RequestRecord.PAYLOAD, "req_attempt": RequestRecord.ATTEMPT,
    "req_status": RequestRecord.STATUS, "req_worker": RequestRecord.WORKER,
    "req_watched": RequestRecord.WATCHED, "req_numerics": RequestRecord.NUMERICS,
    "entry_id": QueueEntry.ID, "entry_payload": QueueEntry.PAYLOAD,
    "entry_prompt_len": QueueEntry.PROMPT_LEN, "entry_cached": QueueEntry.CACHED,
}

ENQUEUE = LuaScript.build(
    "enqueue",
    keys=["enqueued marker (Keys.enqueued)", "request hash (Keys.request)"],
    argv=["TTL of marker and hash, s", "the packed request (GenerationRequest.pack)",
          "status (queued)"],
    returns="1 when written: the caller then XADDs the stream entry (`queue_entry`); 0 when this "
            "id was enqueued before (nothing written)",
    names=NAMES,
    source="""
if not redis.call('SET', KEYS[1], '1', 'NX', 'EX', ARGV[1]) then
  return 0
end
redis.call('HSET', KEYS[2], '${req_payload}', ARGV[2], '${req_attempt}', 0,
           '${req_status}', ARGV[3])
redis.call('EXPIRE', KEYS[2], ARGV[1])
return 1
""")


def enqueue(keys: Keys, request: GenerationRequest, *, ttl_s: int) -> ScriptCall:
    """The request's own keys (one slot). The stream entry is a second command, on the stream's
    slot (`queue_entry`): written only after this returned 1, so a retry writes it at most once
    per successful ENQUEUE and a worker never reads an entry whose hash does not exist."""
    req_id = request.req_id
    return ENQUEUE.bind([keys.enqueued(req_id), keys.request(req_id)],
                        [ttl_s, request.pack(), RequestStatus.QUEUED.value])


def queue_entry(keys: Keys, request: GenerationRequest, worker_id: str = "",
                cached_tokens: int = 0) -> tuple[str, dict]:
    """(stream, fields) of the request's stream entry: its model's shard chosen by its id, or
    `worker_id`'s own stream (prefix-affinity routing) with the cached tokens expected there."""
    if worker_id:
        stream = keys.worker_queue(request.model, worker_id, request.priority)
        return stream, QueueEntry(request, cached_tokens).encode()
    stream = keys.queue(request.model, request.priority, keys.shard_of(request.req_id))
    return stream, QueueEntry(request).encode()


READ_IF_FITS = LuaScript.build(
    "read_if_fits",
    keys=["request streams of one model, highest priority first"],
    variadic_keys=True,
    argv=["consumer group", "consumer (worker id)",
          "budget: the most prompt tokens the worker can admit now (summed over the entries "
          "delivered)", "the most entries to deliver",
          "minimum age, ms: only entries added at least this long ago (by this node's clock, "
          "which stamped their ids) are looked at; 0 = every entry",
          "1: an entry's need is its prompt length less its `cached` field (the worker reads "
          "its own streams); 0: the prompt length",
          "the owner's room, tokens (-1: none given): an entry whose need at its owner (prompt "
          "less `cached`) exceeds it is looked at whatever its age (a worker stealing from "
          "another's own stream that cannot hold it)"],
    returns="{too-large stream index (1-based; 0: none), its head's prompt length (0: none), "
            "then for each entry delivered (XREADGROUP: pending for this consumer), in order: "
            "stream index, entry id, {field, value, ...}}. Entries are taken in priority order "
            "while they fit what is left of the budget; the first undelivered entry that does "
            "not fit ends the read and stays (head of line) for a worker with room. An entry "
            "without a prompt length (an older writer) counts as fitting. Younger entries "
            "than the minimum age are left as if absent (unless they exceed the owner's room); "
            "the first such entry ends the read.",
    names=NAMES,
    source="""
local function last_delivered(stream, group)
  for _, info in ipairs(redis.call('XINFO', 'GROUPS', stream)) do
    local name, last = nil, nil
    for j = 1, #info, 2 do
      if info[j] == 'name' then name = info[j + 1] end
      if info[j] == 'last-delivered-id' then last = info[j + 1] end
    end
    if name == group then return last end
  end
  return nil
end

local budget, want = tonumber(ARGV[3]), tonumber(ARGV[4])
local use_cached = ARGV[6] == '1'
local owner_room = tonumber(ARGV[7] or '-1')
local newest, newest_ms = '+', nil
if tonumber(ARGV[5]) > 0 then
  local now = redis.call('TIME')
  newest_ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000) - tonumber(ARGV[5])
  newest = tostring(newest_ms)
  -- entries too large for their owner are looked at whatever their age
  if owner_room >= 0 then newest = '+' end
end
local out = {0, 0}
for i, stream in ipairs(KEYS) do
  if want <= 0 then break end
  local last = nil
  if redis.call('EXISTS', stream) == 1 then last = last_delivered(stream, ARGV[1]) end
  if last then
    local start = '-'
    if last ~= '0-0' then start = '(' .. last end
    local fit = 0
    for _, entry in ipairs(redis.call('XRANGE', stream, start, newest, 'COUNT', want)) do
      local fields, prompt_len, cached = entry[2], 0, 0
      for j = 1, #fields, 2 do
        if fields[j] == '${entry_prompt_len}' then prompt_len = tonumber(fields[j + 1]) or 0 end
        if fields[j] == '${entry_cached}' then cached = tonumber(fields[j + 1]) or 0 end
      end
      -- the owner needs only what it does not hold; this reader, unless it is the owner, all
      local owner_need = math.max(prompt_len - cached, 0)
      if use_cached then prompt_len = owner_need end
      if newest_ms and owner_room >= 0 and owner_need <= owner_room then
        -- young and its owner can hold it: not ours yet (nor anything behind it)
        local ms = tonumber(string.match(entry[1], '^(%d+)'))
        if ms > newest_ms then break end
      end
      if prompt_len > budget then
        out[1], out[2] = i, prompt_len
        break
      end
      budget = budget - prompt_len
      fit = fit + 1
    end
    if fit > 0 then
      -- the next `fit` undelivered entries are the ones just tested (no reader in between)
      local reply = redis.call('XREADGROUP', 'GROUP', ARGV[1], ARGV[2], 'COUNT', fit,
                               'STREAMS', stream, '>')
      for _, entry in ipairs(reply[1][2]) do
        out[#out + 1] = i
        out[#out + 1] = entry[1]
        out[#out + 1] = entry[2]
      end
      want = want - fit
    end
    if out[1] ~= 0 then return out end
  end
end
return out
""")


def read_if_fits(streams: list[str], group: str, consumer: str, budget_tokens: int,
                 max_entries: int = 1, min_age_ms: int = 0, *, use_cached: bool = False,
                 owner_room: int = -1) -> ScriptCall:
    return READ_IF_FITS.bind(streams, [group, consumer, budget_tokens, max_entries, min_age_ms,
                                       int(use_cached), owner_room])


ROSTER = LuaScript.build(
    "roster",
    keys=["the model's workers by the time they joined (Keys.roster)",
          "the model's workers by the time they were last seen (Keys.roster_seen)"],
    argv=["worker id", "how long a worker not seen stays on the roster, ms",
          "1 to join (or stay), 0 to leave"],
    returns="{this worker's index among the workers on the roster (0-based, in order of "
            "joining; -1 after leaving), how many workers are on it}. Workers not seen for the "
            "given time are dropped first, so an index is a live worker's and a worker keeps its "
            "index until one that joined before it leaves.",
    source="""
local now = redis.call('TIME')
local ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
for _, gone in ipairs(redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', ms - tonumber(ARGV[2]))) do
  redis.call('ZREM', KEYS[1], gone)
  redis.call('ZREM', KEYS[2], gone)
end
if ARGV[3] == '1' then
  redis.call('ZADD', KEYS[1], 'NX', ms, ARGV[1])
  redis.call('ZADD', KEYS[2], ms, ARGV[1])
else
  redis.call('ZREM', KEYS[1], ARGV[1])
  redis.call('ZREM', KEYS[2], ARGV[1])
end
local count = redis.call('ZCARD', KEYS[1])
if count == 0 then
  redis.call('DEL', KEYS[1], KEYS[2])
else
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  redis.call('PEXPIRE', KEYS[2], ARGV[2])
end
local index = redis.call('ZRANK', KEYS[1], ARGV[1])
return {index or -1, count}
""")


def roster(keys: Keys, model: str, worker_id: str, ttl_ms: int, join: bool = True) -> ScriptCall:
    return ROSTER.bind([keys.roster(model), keys.roster_seen(model)],
                       [worker_id, ttl_ms, 1 if join else 0])


def home_shards(index: int, count: int, shards: int) -> tuple[int, ...]:
    """The stream shards a worker reads first: with at least as many workers as shards, shard
    `index % shards` (each shard gets count // shards or one more workers); with fewer, every
    shard s with `s % count == index` (each worker gets one or more shards, every shard one
    worker). Every shard while the worker's place is unknown (index < 0)."""
    if shards <= 1 or index < 0 or count <= 0:
        return tuple(range(shards))
    if count >= shards:
        return (index % shards,)
    return tuple(s for s in range(shards) if s % count == index % count)


def gateway_roster(keys: Keys, gateway_id: str, ttl_ms: int, join: bool = True) -> ScriptCall:
    """ROSTER over the gateways (Keys.gateway_roster): a gateway's place picks its shard shares."""
    return ROSTER.bind([keys.gateway_roster(), keys.gateway_roster_seen()],
                       [gateway_id, ttl_ms, 1 if join else 0])


def gateway_shard_shares(index: int, count: int, shards: int) -> tuple[tuple[int, float], ...]:
    """(shard, share of its new requests) for gateway `index` of `count`: lay the gateways' equal
    parts of [0, 1) over the shards' equal parts, and send to each shard the overlap. With
    gateways carrying equal loads every shard gets 1/shards of all requests, and each gateway
    talks to as few primaries as that allows (one when count is a multiple of shards; with 2
    gateways and 3 shards, two each: 2/3 and 1/3). Every shard alike while the gateway's place
    is unknown (index < 0)."""
    if shards <= 1 or index < 0 or count <= 0:
        return tuple((shard, 1.0 / shards) for shard in range(shards))
    index %= count
    start, end = index / count, (index + 1) / count
    shares = []
    for shard in range(shards):
        overlap = min(end, (shard + 1) / shards) - max(start, shard / shards)
        if overlap > 1e-12:
            shares.append((shard, overlap * count))
    return tuple(shares)


# The numerics chain of a request (RequestRecord.NUMERICS), as START_ATTEMPT and START_HANDOFF
# keep it: with no checkpointed token (or none recorded by a worker that knew its numerics) the
# starting worker's fingerprint alone; else its fingerprint appended when it is not the last one
# (the stream continues on other numerics). An empty fingerprint records nothing.
# Returns {chain, 1 if appended else 0}.
RECORD_NUMERICS_LUA = """
local function record_numerics(hash, ckpt, fingerprint)
  if fingerprint == '' then return {'', 0} end
  local chain = redis.call('HGET', hash, '${req_numerics}') or ''
  local changed = 0
  if ckpt == '' or chain == '' then
    chain = fingerprint
  elseif string.match(chain, '[^+]*$$') ~= fingerprint then
    chain = chain .. '+' .. fingerprint
    changed = 1
  end
  redis.call('HSET', hash, '${req_numerics}', chain)
  return {chain, changed}
end
"""

START_ATTEMPT = LuaScript.build(
    "start_attempt",
    keys=["request hash (Keys.request)", "checkpoint (Keys.checkpoint)"],
    argv=["worker id", "its numerics fingerprint ('' = unknown: nothing recorded)",
          "status (running)", "the finished statuses (one or more)"],
    variadic_argv=True,
    returns="{attempt (the new fencing token), checkpoint bytes ('' when none), the numerics "
            "chain, 1 when this start appended another fingerprint to it}; {0, '', status} when "
            "the request is already finished (nothing written: its final event was published, "
            "only the stream entry's XACK was missing)",
    names=NAMES,
    source=RECORD_NUMERICS_LUA + """
local status = redis.call('HGET', KEYS[1], '${req_status}')
for i = 4, #ARGV do
  if status == ARGV[i] then return {0, '', status} end
end
local attempt = redis.call('HINCRBY', KEYS[1], '${req_attempt}', 1)
redis.call('HSET', KEYS[1], '${req_status}', ARGV[3], '${req_worker}', ARGV[1])
local ckpt = redis.call('GET', KEYS[2]) or ''
local numerics = record_numerics(KEYS[1], ckpt, ARGV[2])
return {attempt, ckpt, numerics[1], numerics[2]}
""")

FINISHED = [status.value for status in RequestStatus if status.is_finished]


def start_attempt(keys: Keys, req_id: str, worker_id: str, numerics: str = "") -> ScriptCall:
    return START_ATTEMPT.bind([keys.request(req_id), keys.checkpoint(req_id)],
                              [worker_id, numerics, RequestStatus.RUNNING.value, *FINISHED])


@dataclass(frozen=True)
class Started:
    """A started attempt (START_ATTEMPT, START_HANDOFF): its fencing token, the tokens
    checkpointed so far, the request's numerics chain (RequestRecord.NUMERICS) and whether this
    start continues the stream on other numerics than the tokens so far were computed on."""

    attempt: int
    checkpoint: list[int]
    numerics: str = ""
    other_numerics: bool = False

    @classmethod
    def decode(cls, reply: list) -> Started | None:
        """From the script's reply; None when the request is already finished."""
        if int(reply[0]) == 0:
            return None
        numerics = text(reply[2]) if len(reply) > 2 else ""
        return cls(int(reply[0]), decode_checkpoint(reply[1]), numerics,
                   len(reply) > 3 and int(reply[3]) == 1)


# One request's publication once its attempt was checked: write the new tokens into the checkpoint
# at their offset, queue the event for its channels, and on the final event record the status.
# Per event: HMGET (attempt, watched) and SETRANGE; the checkpoint's TTL is set when its first
# tokens are written (offset 0) and renewed on the final event; in between it cannot end before
# the request's hash, whose TTL runs from the enqueue and is not renewed either.
#
# Events are published per channel, not per request: all the events of one call for one inbox go
# out as one message (packed events back to back), so a worker's step costs each gateway one
# PUBLISH and one delivery. A channel this node does not serve (an inbox whose slot moved away
# while the request's did not) is not published here: its message is handed back to the caller,
# which publishes it through the cluster client (pcall: the checkpoint writes stand either way).
#
# The calls' arguments, CALLS (ARGV for PUBLISH_STEP, a table of one call's KEYS and ARGV for
# PUBLISH), 11 per call: hash, checkpoint, own channel, attempt, event, new tokens, final status,
# TTL, publish command, offset, reply channel. Every attempt (and watched flag) is read before
# anything is written; attempts compare as the decimal strings both sides write.
_PUBLISH_CALLS = """
local attempts, watched = {}, {}
for i = 1, #CALLS, 11 do
  local fields = redis.call('HMGET', CALLS[i], '${req_attempt}', '${req_watched}')
  attempts[i], watched[i] = fields[1], fields[2]
end
local accepted, messages, channels = {}, {}, {}
local function queue_event(channel, event)
  local parts = messages[channel]
  if parts == nil then
    parts = {}
    messages[channel] = parts
    channels[#channels + 1] = channel
  end
  parts[#parts + 1] = event
end
local command = 'PUBLISH'
for i = 1, #CALLS, 11 do
  command = CALLS[i + 8]  -- the same for every call
  if attempts[i] == CALLS[i + 3] then
    local ckpt, ttl, new_tokens = CALLS[i + 1], CALLS[i + 7], CALLS[i + 5]
    if new_tokens ~= '' then
      -- idempotent: a publication retried after a partial failure (some nodes of a cluster took
      -- it, another did not answer) writes the same bytes at the same offset again
      local offset = CALLS[i + 9]
      redis.call('SETRANGE', ckpt, offset, new_tokens)
      if offset == '0' then redis.call('EXPIRE', ckpt, ttl) end
    end
    local reply_to = CALLS[i + 10]
    if reply_to ~= '' then queue_event(reply_to, CALLS[i + 4]) end
    if reply_to == '' or watched[i] == '1' then queue_event(CALLS[i + 2], CALLS[i + 4]) end
    local final = CALLS[i + 6]
    if final ~= '' then
      redis.call('HSET', CALLS[i], '${req_status}', final)
      redis.call('EXPIRE', CALLS[i], ttl)
      redis.call('EXPIRE', ckpt, ttl)
    end
    accepted[#accepted + 1] = 1
  else
    accepted[#accepted + 1] = 0
  end
end
local undelivered = {}
for _, channel in ipairs(channels) do
  local message = table.concat(messages[channel])
  local reply = redis.pcall(command, channel, message)
  if type(reply) == 'table' and reply.err then
    undelivered[#undelivered + 1] = channel
    undelivered[#undelivered + 1] = message
  end
end
"""

_PUBLISH_RETURNS = (
    "the messages this node could not publish (a channel whose slot it does not serve): "
    "{channel, message, channel, message, ...}, for the caller to publish through the cluster "
    "client")

PUBLISH = LuaScript.build(
    "publish",
    keys=["request hash (Keys.request)", "checkpoint (Keys.checkpoint)",
          "the request's own channel (Keys.tokens)"],
    argv=["attempt (fencing token)", "the packed event (TokenEvent.pack, with its req_id)",
          "new tokens for the checkpoint (encode_checkpoint; '' for none)",
          "final status ('' while running)",
          "TTL, s: the checkpoint's when its first tokens are written; hash and checkpoint's "
          "once final",
          "publish command: PUBLISH (single Redis) or SPUBLISH (cluster: the channel's shard)",
          "checkpoint offset of the first new token, bytes (seq x TOKEN_BYTES)",
          "reply channel (GenerationRequest.reply_to: an inbox; '' = the own channel only)"],
    returns="{1 when written and published, 0 when the attempt is stale (nothing written: the "
            "worker must stop the request), " + _PUBLISH_RETURNS + "}. The event goes to the "
            "reply channel, and to the request's own channel when it has no reply channel or a "
            "reader attached by id (RequestRecord.WATCHED). The caller XACKs the stream entry "
            "of a final event after this returned 1 (the stream lives in another slot).",
    names=NAMES,
    source="""
local calls = {KEYS[1], KEYS[2], KEYS[3], ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6],
               ARGV[7], ARGV[8]}
""" + _PUBLISH_CALLS.replace("CALLS", "calls") + """
return {accepted[1], undelivered}
""")

PUBLISH_STEP = LuaScript.build(
    "publish_step",
    keys=[],
    argv=["for each request of the step that lives on this node, in turn: the 3 KEYS and then "
          "the 8 ARGV of its PUBLISH call"],
    variadic_argv=True,
    cross_slot=True,
    returns="{{1 or 0 for each request, in order: PUBLISH's first reply for it}, "
            + _PUBLISH_RETURNS + "}. Each channel gets one message with the events of every "
            "request naming it. Every attempt is read before anything is written, so a key "
            "this node does not serve (a stale slot map) fails the whole call with nothing "
            "written; the caller then runs those requests' PUBLISH calls through the cluster "
            "client.",
    names=NAMES,
    source=_PUBLISH_CALLS.replace("CALLS", "ARGV") + """
return {accepted, undelivered}
""")


def publish(keys: Keys, req_id: str, attempt: int, event: TokenEvent,
            final_status: RequestStatus | None, ttl_s: int, *, sharded: bool,
            reply_to: str = "") -> ScriptCall:
    return PUBLISH.bind(
        [keys.request(req_id), keys.checkpoint(req_id), keys.tokens(req_id)],
        [attempt, event.pack(req_id), encode_checkpoint(event.token_ids),
         final_status.value if final_status else "", ttl_s,
         "SPUBLISH" if sharded else "PUBLISH", event.seq * TOKEN_BYTES, reply_to])


ATTACH = LuaScript.build(
    "attach",
    keys=["request hash (Keys.request)", "checkpoint (Keys.checkpoint)"],
    argv=[],
    returns="{payload, status, attempt (RequestRecord.SNAPSHOT_FIELDS, in order), checkpoint ('' "
            "when none)}, read after the request was marked watched (RequestRecord.WATCHED) if "
            "it exists: every event published after this call also goes to the request's own "
            "channel, so a reader that subscribed it first misses nothing that is not in the "
            "checkpoint it read.",
    names=NAMES,
    source="""
if redis.call('EXISTS', KEYS[1]) == 1 then
  redis.call('HSET', KEYS[1], '${req_watched}', '1')
end
local reply = redis.call('HMGET', KEYS[1], '${req_payload}', '${req_status}', '${req_attempt}')
reply[4] = redis.call('GET', KEYS[2]) or ''
return reply
""")


def attach(keys: Keys, req_id: str) -> ScriptCall:
    return ATTACH.bind([keys.request(req_id), keys.checkpoint(req_id)], [])


RATE_LIMIT = LuaScript.build(
    "rate_limit",
    keys=["request TAT (Keys.rate_limit(key, 'req'))", "token TAT (Keys.rate_limit(key, 'tok'))"],
    argv=["requests per minute (0 = off)", "tokens per minute (0 = off)",
          "tokens of this request"],
    returns="{allowed 1/0, retry after ms (-1: larger than a whole minute's budget), which limit "
            "('rpm', 'tpm' or '')}. Both limits are checked before either is charged; Redis's "
            "clock is every gateway replica's clock.",
    source="""
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
local period = 60000
local limits = {tonumber(ARGV[1]), tonumber(ARGV[2])}
local costs = {1, tonumber(ARGV[3])}
local names = {'rpm', 'tpm'}
local tats = {}
for i = 1, 2 do
  if limits[i] > 0 then
    if costs[i] > limits[i] then return {0, -1, names[i]} end
    local tat = tonumber(redis.call('GET', KEYS[i]) or '0')
    if tat < now then tat = now end
    local new_tat = tat + costs[i] * period / limits[i]
    local wait = new_tat - now - period
    if wait > 0 then return {0, math.ceil(wait), names[i]} end
    tats[i] = new_tat
  end
end
for i = 1, 2 do
  if tats[i] then
    redis.call('SET', KEYS[i], string.format('%.3f', tats[i]), 'PX',
               math.ceil(tats[i] - now) + 1000)
  end
end
return {1, 0, ''}
""")


def rate_limit(keys: Keys, key_id: str, rpm: int, tpm: int, tokens: int) -> ScriptCall:
    return RATE_LIMIT.bind([keys.rate_limit(key_id, "req"), keys.rate_limit(key_id, "tok")],
                           [rpm, tpm, tokens])
