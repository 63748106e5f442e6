"""Files and batches of the batch API in Redis: store and read the records (shared/wire/batch.py),
each line's result written once, the batch's status machine and the lease of the job feeding it,
all through the scripts of shared/wire/batch_scripts.py (whose docstring states the invariants).
The output files are built from exactly the results recorded before the batch began finalizing.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from redis import Redis
from redis.client import Pipeline

from kvfleet.shared.wire import BatchRecord, BatchStatus, FileRecord, Keys
from kvfleet.shared.wire import batch_scripts as scripts


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
        self._transition = scripts.TRANSITION.register(redis)
        self._record = scripts.RECORD_RESULT.register(redis)
        self._begin_finalize = scripts.BEGIN_FINALIZE.register(redis)
        self._renew = scripts.RENEW_LEASE.register(redis)
        self._release = scripts.RELEASE_LEASE.register(redis)

    # Files.

    def save_file(self, record: FileRecord, content: bytes, pipeline: Pipeline | None = None
                  ) -> None:
        pipe = pipeline if pipeline is not None else self.redis.pipeline(transaction=True)
        pipe.hset(self.keys.file(record.id), mapping=record.encode())
        pipe.expire(self.keys.file(record.id), self.ttl_s)
        pipe.set(self.keys.file_content(record.id), content, ex=self.ttl_s)
        if pipeline is None:
            pipe.execute()

    def get_file(self, file_id: str) -> FileRecord | None:
        data = self.redis.hgetall(self.keys.file(file_id))
        return FileRecord.decode(data) if data else None

    def file_content(self, file_id: str) -> bytes | None:
        return self.redis.get(self.keys.file_content(file_id))

    def delete_file(self, file_id: str) -> bool:
        return bool(self.redis.delete(self.keys.file(file_id), self.keys.file_content(file_id)))

    # Batches.

    def create_batch(self, record: BatchRecord, pipeline: Pipeline | None = None) -> None:
        pipe = pipeline if pipeline is not None else self.redis.pipeline(transaction=True)
        pipe.hset(self.keys.batch(record.id), mapping=record.encode())
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
        return BatchRecord.decode(data) if data else None

    def status(self, batch_id: str) -> BatchStatus | None:
        raw = self.redis.hget(self.keys.batch(batch_id), BatchRecord.STATUS)
        return BatchStatus(raw.decode()) if raw else None

    def transition(self, batch_id: str, to: BatchStatus, allowed: tuple[BatchStatus, ...],
                   now: float) -> bool:
        """Compare-and-set of the status (and its `<status>_at`); False when not allowed now."""
        call = scripts.transition(self.keys, batch_id, to, allowed, now)
        return bool(self._transition(keys=call.keys, args=call.args))

    def set_job(self, batch_id: str, job_id: str) -> None:
        self.redis.hset(self.keys.batch(batch_id), BatchRecord.JOB_ID, job_id)

    def count_attempt(self, batch_id: str) -> int:
        return int(self.redis.hincrby(self.keys.batch(batch_id), BatchRecord.ATTEMPTS, 1))

    def fail(self, batch_id: str, code: str, message: str, now: float) -> bool:
        """Any unfinished batch -> failed, with one error; its results are dropped."""
        unfinished = tuple(s for s in BatchStatus if not s.is_final)
        if not self.transition(batch_id, BatchStatus.FAILED, unfinished, now):
            return False
        pipe = self.redis.pipeline(transaction=True)
        pipe.hset(self.keys.batch(batch_id), BatchRecord.ERRORS,
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
        call = scripts.record_result(self.keys, batch_id, index, json.dumps(output), ok,
                                     self.ttl_s)
        return int(self._record(keys=call.keys, args=call.args))

    def done_indices(self, batch_id: str) -> set[int]:
        return {int(raw) for raw in self.redis.hkeys(self.keys.batch_results(batch_id))}

    def results(self, batch_id: str) -> dict[int, dict[str, Any]]:
        raw = self.redis.hgetall(self.keys.batch_results(batch_id))
        return {int(index): json.loads(line) for index, line in raw.items()}

    def begin_finalize(self, batch_id: str, target: BatchStatus, now: float
                       ) -> BatchStatus | None:
        """Freeze the results; the final status to write (cancelling always ends cancelled)."""
        call = scripts.begin_finalize(self.keys, batch_id, target, now)
        raw = self._begin_finalize(keys=call.keys, args=call.args)
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
            BatchRecord.STATUS: final.value, final.timestamp_field: int(now),
            BatchRecord.OUTPUT_FILE_ID: output.record.id if output else "",
            BatchRecord.ERROR_FILE_ID: errors.record.id if errors else ""})
        pipe.delete(self.keys.batch_results(batch_id))
        pipe.srem(self.keys.batches_active(), batch_id)
        pipe.execute()

    # The lease: at most one job feeds a batch; a dead job's lease expires.

    def acquire_lease(self, batch_id: str, token: str, ttl_s: float) -> bool:
        return bool(self.redis.set(self.keys.batch_lease(batch_id), token, nx=True,
                                   px=int(ttl_s * 1000)))

    def renew_lease(self, batch_id: str, token: str, ttl_s: float) -> bool:
        call = scripts.renew_lease(self.keys, batch_id, token, ttl_s)
        return bool(self._renew(keys=call.keys, args=call.args))

    def release_lease(self, batch_id: str, token: str) -> None:
        call = scripts.release_lease(self.keys, batch_id, token)
        self._release(keys=call.keys, args=call.args)

    def lease_holder(self, batch_id: str) -> str | None:
        raw = self.redis.get(self.keys.batch_lease(batch_id))
        return raw.decode() if raw else None
