"""The Lua scripts of the batch API, each with its KEYS and ARGV, and the function that builds a
call of it.

Invariants: a line's result is written at most once (HSETNX), and its counter is incremented in
the same script, so a job re-run after a crash never counts or outputs a line twice. Results are
accepted only while the batch is `in_progress` or `cancelling`; once it is `finalizing` they are
frozen. At most one job holds a batch's lease; only its holder renews or releases it.
"""

from __future__ import annotations

from kvfleet.shared.wire.batch import BatchRecord, BatchStatus
from kvfleet.shared.wire.keys import Keys
from kvfleet.shared.wire.lua import LuaScript, ScriptCall

NAMES = {
    "status": BatchRecord.STATUS, "final_status": BatchRecord.FINAL_STATUS,
    "in_progress": BatchStatus.IN_PROGRESS.value, "cancelling": BatchStatus.CANCELLING.value,
    "cancelled": BatchStatus.CANCELLED.value, "finalizing": BatchStatus.FINALIZING.value,
    "finalizing_at": BatchStatus.FINALIZING.timestamp_field,
}

TRANSITION = LuaScript.build(
    "batch_transition",
    keys=["batch hash (Keys.batch)"],
    argv=["new status", "now (unix s)", "allowed current statuses, one per argument"],
    variadic_argv=True,
    returns="1 when the status changed (and `<new status>_at` was set), else 0",
    names=NAMES,
    source="""
local status = redis.call('HGET', KEYS[1], '${status}')
if not status then return 0 end
for i = 3, #ARGV do
  if status == ARGV[i] then
    redis.call('HSET', KEYS[1], '${status}', ARGV[1], ARGV[1] .. '_at', ARGV[2])
    return 1
  end
end
return 0
""")


def transition(keys: Keys, batch_id: str, to: BatchStatus, allowed: tuple[BatchStatus, ...],
               now: float) -> ScriptCall:
    return TRANSITION.bind([keys.batch(batch_id)],
                           [to.value, int(now), *(status.value for status in allowed)])


RECORD_RESULT = LuaScript.build(
    "batch_record_result",
    keys=["results hash (Keys.batch_results)", "batch hash (Keys.batch)"],
    argv=["line index", "the line's output (JSON)", "counter to increment (completed | failed)",
          "TTL of the results hash, s"],
    returns="1 when recorded; 0 when the line had a result already; -1 when results are frozen",
    names=NAMES,
    source="""
local status = redis.call('HGET', KEYS[2], '${status}')
if status ~= '${in_progress}' and status ~= '${cancelling}' then return -1 end
if redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2]) == 0 then return 0 end
redis.call('EXPIRE', KEYS[1], ARGV[4])
redis.call('HINCRBY', KEYS[2], ARGV[3], 1)
return 1
""")


def record_result(keys: Keys, batch_id: str, index: int, output_json: str, ok: bool,
                  ttl_s: int) -> ScriptCall:
    counter = BatchRecord.COMPLETED if ok else BatchRecord.FAILED
    return RECORD_RESULT.bind([keys.batch_results(batch_id), keys.batch(batch_id)],
                              [index, output_json, counter, ttl_s])


BEGIN_FINALIZE = LuaScript.build(
    "batch_begin_finalize",
    keys=["batch hash (Keys.batch)"],
    argv=["target final status", "now (unix s)"],
    returns="the final status to write (in_progress -> the target; cancelling -> cancelled; "
            "already finalizing -> the one chosen then), or nil when the batch is in no state "
            "to finalize",
    names=NAMES,
    source="""
local status = redis.call('HGET', KEYS[1], '${status}')
if status == '${finalizing}' then return redis.call('HGET', KEYS[1], '${final_status}') end
local target = ARGV[1]
if status == '${cancelling}' then target = '${cancelled}'
elseif status ~= '${in_progress}' then return false end
redis.call('HSET', KEYS[1], '${status}', '${finalizing}', '${finalizing_at}', ARGV[2],
           '${final_status}', target)
return target
""")


def begin_finalize(keys: Keys, batch_id: str, target: BatchStatus, now: float) -> ScriptCall:
    return BEGIN_FINALIZE.bind([keys.batch(batch_id)], [target.value, int(now)])


RENEW_LEASE = LuaScript.build(
    "batch_renew_lease",
    keys=["lease (Keys.batch_lease)"],
    argv=["the holder's token", "new TTL, ms"],
    returns="1 when renewed; 0 when another job holds the lease (or it expired)",
    source="""
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
""")


def renew_lease(keys: Keys, batch_id: str, token: str, ttl_s: float) -> ScriptCall:
    return RENEW_LEASE.bind([keys.batch_lease(batch_id)], [token, int(ttl_s * 1000)])


RELEASE_LEASE = LuaScript.build(
    "batch_release_lease",
    keys=["lease (Keys.batch_lease)"],
    argv=["the holder's token"],
    returns="1 when released; 0 when this token did not hold it",
    source="""
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
""")


def release_lease(keys: Keys, batch_id: str, token: str) -> ScriptCall:
    return RELEASE_LEASE.bind([keys.batch_lease(batch_id)], [token])
