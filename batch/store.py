"""Files and batches of the batch API as Redis records: OpenAI's file and batch objects, each
line's result written once, the batch's status machine and the lease of the job feeding it.

Invariants: a line's result is written at most once (HSETNX), and its request count is incremented
in the same script, so a job re-run after a crash never counts or outputs a line twice. Results are
accepted only while the batch is `in_progress` or `cancelling`; once it is `finalizing` they are
frozen, and the output files are built from exactly what was recorded.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from redis import Redis
from redis.client import Pipeline

from shared.keys import Keys


class BatchStatus(str, Enum):
    """OpenAI's batch statuses, stored in Redis as their string value."""

    VALIDATING = "validating"  # created, its job not started yet
    IN_PROGRESS = "in_progress"
    FINALIZING = "finalizing"  # results frozen, output files being written
    COMPLETED = "completed"
    FAILED = "failed"
    EXPIRED = "expired"  # the completion window passed first
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"

    @property
    def is_final(self) -> bool:
        return self in (BatchStatus.COMPLETED, BatchStatus.FAILED, BatchStatus.EXPIRED,
                        BatchStatus.CANCELLED)


_TIMESTAMPS = ("in_progress_at", "finalizing_at", "completed_at", "failed_at", "expired_at",
               "cancelling_at", "cancelled_at")

# KEYS: batch hash. ARGV: new status, now, allowed current statuses...
# Sets `<new>_at` too. Returns 1 when the status changed.
_TRANSITION_LUA = """
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return 0 end
for i = 3, #ARGV do
  if status == ARGV[i] then
    redis.call('HSET', KEYS[1], 'status', ARGV[1], ARGV[1] .. '_at', ARGV[2])
    return 1
  end
end
return 0
"""

# KEYS: results hash, batch hash. ARGV: line index, output line, counter field, ttl_s.
# Returns 1 when recorded, 0 when the line had a result already, -1 when results are frozen.
_RECORD_LUA = """
local status = redis.call('HGET', KEYS[2], 'status')
if status ~= 'in_progress' and status ~= 'cancelling' then return -1 end
if redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2]) == 0 then return 0 end
redis.call('EXPIRE', KEYS[1], ARGV[4])
redis.call('HINCRBY', KEYS[2], ARGV[3], 1)
return 1
"""

# KEYS: batch hash. ARGV: target final status, now.
# in_progress -> finalizing(target); cancelling -> finalizing(cancelled); finalizing: unchanged.
# Returns the final status to write, or false when the batch is in no state to finalize.
_BEGIN_FINALIZE_LUA = """
local status = redis.call('HGET', KEYS[1], 'status')
if status == 'finalizing' then return redis.call('HGET', KEYS[1], 'final_status') end
local target = ARGV[1]
if status == 'cancelling' then target = 'cancelled'
elseif status ~= 'in_progress' then return false end
redis.call('HSET', KEYS[1], 'status', 'finalizing', 'finalizing_at', ARGV[2],
           'final_status', target)
return target
"""

_RENEW_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""

_RELEASE_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


@dataclass
class FileRecord:
    """OpenAI's file object, plus what validation learnt about a batch input file."""

    id: str
    bytes: int
    created_at: int
    expires_at: int
    filename: str
    purpose: str  # batch (uploaded) | batch_output (written by a batch job)
    num_lines: int = 0
    urls: list[str] = field(default_factory=list)  # endpoints the lines call

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "object": "file", "bytes": self.bytes,
                "created_at": self.created_at, "expires_at": self.expires_at,
                "filename": self.filename, "purpose": self.purpose, "status": "processed",
                "status_details": None}

    def to_redis(self) -> dict[str, str]:
        return {"record": json.dumps(self.__dict__)}

    @classmethod
    def from_redis(cls, data: dict[bytes, bytes]) -> FileRecord:
        return cls(**json.loads(data[b"record"]))


@dataclass
class BatchRecord:
    """OpenAI's batch object: the fixed part written at creation, the rest as the job goes."""

    id: str
    input_file_id: str
    endpoint: str
    completion_window: str
    created_at: int
    expires_at: int
    total: int
    metadata: dict[str, str] | None = None
    status: BatchStatus = BatchStatus.VALIDATING
    completed: int = 0
    failed: int = 0
    output_file_id: str | None = None
    error_file_id: str | None = None
    errors: list[dict[str, Any]] | None = None
    timestamps: dict[str, int] = field(default_factory=dict)
    attempts: int = 0
    job_id: str | None = None

    def to_openai(self) -> dict[str, Any]:
        errors = {"object": "list", "data": self.errors} if self.errors else None
        return {"id": self.id, "object": "batch", "endpoint": self.endpoint, "errors": errors,
                "input_file_id": self.input_file_id,
                "completion_window": self.completion_window, "status": self.status.value,
                "output_file_id": self.output_file_id, "error_file_id": self.error_file_id,
                "created_at": self.created_at, "expires_at": self.expires_at,
                **{name: self.timestamps.get(name) for name in _TIMESTAMPS},
                "request_counts": {"total": self.total, "completed": self.completed,
                                   "failed": self.failed},
                "metadata": self.metadata}

    def to_redis(self) -> dict[str, str]:
        fixed = {"id": self.id, "input_file_id": self.input_file_id, "endpoint": self.endpoint,
                 "completion_window": self.completion_window, "created_at": self.created_at,
                 "expires_at": self.expires_at, "total": self.total, "metadata": self.metadata}
        return {"record": json.dumps(fixed), "status": self.status.value, "completed": "0",
                "failed": "0", "attempts": "0"}

    @classmethod
    def from_redis(cls, data: dict[bytes, bytes]) -> BatchRecord:
        text = {k.decode(): v.decode() for k, v in data.items()}
        record = cls(**json.loads(text["record"]))
        record.status = BatchStatus(text["status"])
        record.completed = int(text.get("completed", 0))
        record.failed = int(text.get("failed", 0))
        record.attempts = int(text.get("attempts", 0))
        record.output_file_id = text.get("output_file_id") or None
        record.error_file_id = text.get("error_file_id") or None
        record.errors = json.loads(text["errors"]) if text.get("errors") else None
        record.job_id = text.get("job_id") or None
        record.timestamps = {name: int(float(text[name])) for name in _TIMESTAMPS if name in text}
        return record


@dataclass
class OutputFile:
    """A file a batch job writes: its record and its JSONL bytes."""

    record: FileRecord
    content: bytes


def request_lines(content: bytes) -> list[dict[str, Any]]:
    """The requests of a validated batch file, in order (blank lines are not requests)."""
    return [json.loads(line) for line in content.decode().splitlines() if line.strip()]


class BatchStore:
    """Files, batches and line results in one Redis, every key from `Keys`, every key expiring."""

    def __init__(self, redis: Redis, keys: Keys, ttl_s: int):
        self.redis = redis
        self.keys = keys
        self.ttl_s = ttl_s
        self._transition = redis.register_script(_TRANSITION_LUA)
        self._record = redis.register_script(_RECORD_LUA)
        self._begin_finalize = redis.register_script(_BEGIN_FINALIZE_LUA)
        self._renew = redis.register_script(_RENEW_LUA)
        self._release = redis.register_script(_RELEASE_LUA)

    # Files.

    def save_file(self, record: FileRecord, content: bytes, pipeline: Pipeline | None = None
                  ) -> None:
        pipe = pipeline if pipeline is not None else self.redis.pipeline(transaction=True)
        pipe.hset(self.keys.file(record.id), mapping=record.to_redis())
        pipe.expire(self.keys.file(record.id), self.ttl_s)
        pipe.set(self.keys.file_content(record.id), content, ex=self.ttl_s)
        if pipeline is None:
            pipe.execute()

    def get_file(self, file_id: str) -> FileRecord | None:
        data = self.redis.hgetall(self.keys.file(file_id))
        return FileRecord.from_redis(data) if data else None

    def file_content(self, file_id: str) -> bytes | None:
        return self.redis.get(self.keys.file_content(file_id))

    def delete_file(self, file_id: str) -> bool:
        return bool(self.redis.delete(self.keys.file(file_id), self.keys.file_content(file_id)))

    # Batches.

    def create_batch(self, record: BatchRecord, pipeline: Pipeline | None = None) -> None:
        pipe = pipeline if pipeline is not None else self.redis.pipeline(transaction=True)
        pipe.hset(self.keys.batch(record.id), mapping=record.to_redis())
        pipe.expire(self.keys.batch(record.id), self.ttl_s)
        pipe.sadd(self.keys.batches_active(), record.id)
        index = self.keys.batches_by_time()
        pipe.zadd(index, {record.id: record.created_at})
        pipe.zremrangebyscore(index, 0, record.created_at - self.ttl_s)  # expired records
        pipe.expire(index, self.ttl_s)
        if pipeline is None:
            pipe.execute()

    def list_batches(self, limit: int, after: str | None = None) -> tuple[list[BatchRecord], bool]:
        """Newest first, starting below batch `after`; (records, whether more follow)."""
        index = self.keys.batches_by_time()
        start = 0
        if after is not None:
            rank = self.redis.zrevrank(index, after)
            start = rank + 1 if rank is not None else 0
        ids = [raw.decode() for raw in self.redis.zrevrange(index, start, start + limit)]
        records = []
        for batch_id in ids[:limit]:
            record = self.get_batch(batch_id)
            if record is None:
                self.redis.zrem(index, batch_id)  # expired
                continue
            records.append(record)
        return records, len(ids) > limit

    def get_batch(self, batch_id: str) -> BatchRecord | None:
        data = self.redis.hgetall(self.keys.batch(batch_id))
        return BatchRecord.from_redis(data) if data else None

    def status(self, batch_id: str) -> BatchStatus | None:
        raw = self.redis.hget(self.keys.batch(batch_id), "status")
        return BatchStatus(raw.decode()) if raw else None

    def transition(self, batch_id: str, to: BatchStatus, allowed: tuple[BatchStatus, ...],
                   now: float) -> bool:
        """Compare-and-set of the status (and its `<status>_at`); False when not allowed now."""
        args = [to.value, int(now), *(status.value for status in allowed)]
        return bool(self._transition(keys=[self.keys.batch(batch_id)], args=args))

    def set_job(self, batch_id: str, job_id: str) -> None:
        self.redis.hset(self.keys.batch(batch_id), "job_id", job_id)

    def count_attempt(self, batch_id: str) -> int:
        return int(self.redis.hincrby(self.keys.batch(batch_id), "attempts", 1))

    def fail(self, batch_id: str, code: str, message: str, now: float) -> bool:
        """Any unfinished batch -> failed, with one error; its results are dropped."""
        unfinished = tuple(s for s in BatchStatus if not s.is_final)
        if not self.transition(batch_id, BatchStatus.FAILED, unfinished, now):
            return False
        pipe = self.redis.pipeline(transaction=True)
        pipe.hset(self.keys.batch(batch_id), "errors",
                  json.dumps([{"code": code, "message": message, "param": None, "line": None}]))
        pipe.delete(self.keys.batch_results(batch_id))
        pipe.srem(self.keys.batches_active(), batch_id)
        pipe.execute()
        return True

    def active_ids(self) -> list[str]:
        return sorted(raw.decode() for raw in self.redis.smembers(self.keys.batches_active()))

    def drop_active(self, batch_id: str) -> None:
        self.redis.srem(self.keys.batches_active(), batch_id)

    # Line results.

    def record_result(self, batch_id: str, index: int, output: dict[str, Any], ok: bool) -> int:
        """1: recorded; 0: the line had a result already; -1: results are frozen (finalizing)."""
        keys = [self.keys.batch_results(batch_id), self.keys.batch(batch_id)]
        args = [index, json.dumps(output), "completed" if ok else "failed", self.ttl_s]
        return int(self._record(keys=keys, args=args))

    def done_indices(self, batch_id: str) -> set[int]:
        return {int(raw) for raw in self.redis.hkeys(self.keys.batch_results(batch_id))}

    def results(self, batch_id: str) -> dict[int, dict[str, Any]]:
        raw = self.redis.hgetall(self.keys.batch_results(batch_id))
        return {int(index): json.loads(line) for index, line in raw.items()}

    def begin_finalize(self, batch_id: str, target: BatchStatus, now: float
                       ) -> BatchStatus | None:
        """Freeze the results; the final status to write (cancelling always ends cancelled)."""
        raw = self._begin_finalize(keys=[self.keys.batch(batch_id)], args=[target.value, int(now)])
        return BatchStatus(raw.decode()) if raw else None

    def finish(self, batch_id: str, final: BatchStatus, output: OutputFile | None,
               errors: OutputFile | None, now: float) -> None:
        """Write the output files and the final status in one transaction (idempotent: the file
        ids are fixed per batch, so a re-run after a crash overwrites the same keys)."""
        pipe = self.redis.pipeline(transaction=True)
        for written in (output, errors):
            if written is not None:
                self.save_file(written.record, written.content, pipeline=pipe)
        pipe.hset(self.keys.batch(batch_id), mapping={
            "status": final.value, f"{final.value}_at": int(now),
            "output_file_id": output.record.id if output else "",
            "error_file_id": errors.record.id if errors else ""})
        pipe.delete(self.keys.batch_results(batch_id))
        pipe.srem(self.keys.batches_active(), batch_id)
        pipe.execute()

    # The lease: at most one job feeds a batch; a dead job's lease expires.

    def acquire_lease(self, batch_id: str, token: str, ttl_s: float) -> bool:
        return bool(self.redis.set(self.keys.batch_lease(batch_id), token, nx=True,
                                   px=int(ttl_s * 1000)))

    def renew_lease(self, batch_id: str, token: str, ttl_s: float) -> bool:
        return bool(self._renew(keys=[self.keys.batch_lease(batch_id)],
                                args=[token, int(ttl_s * 1000)]))

    def release_lease(self, batch_id: str, token: str) -> None:
        self._release(keys=[self.keys.batch_lease(batch_id)], args=[token])

    def lease_holder(self, batch_id: str) -> str | None:
        raw = self.redis.get(self.keys.batch_lease(batch_id))
        return raw.decode() if raw else None
