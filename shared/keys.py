"""Every Redis key kvfleet uses, built in one place under one configurable prefix."""

from __future__ import annotations

from dataclasses import dataclass

PRIORITIES = ("interactive", "batch")  # served in this order


@dataclass(frozen=True)
class Keys:
    """Key names of the fleet protocol (see DESIGN.md, "The fleet protocol")."""

    prefix: str = "kvf:"
    group: str = "workers"  # consumer group on every request stream

    def queue(self, model: str, priority: str = "interactive") -> str:
        """Stream of requests for `model`; interactive is the plain `{model}:q`."""
        if priority == "interactive":
            return f"{self.prefix}{model}:q"
        return f"{self.prefix}{model}:q:{priority}"

    def dead_letter(self, model: str) -> str:
        """Stream of requests delivered too many times."""
        return f"{self.prefix}{model}:dlq"

    def request(self, req_id: str) -> str:
        """Hash: payload, attempt (fencing token), status, checkpointed token ids."""
        return f"{self.prefix}req:{req_id}"

    def checkpoint(self, req_id: str) -> str:
        """String of the token ids generated so far, appended as little-endian uint32 each step."""
        return f"{self.prefix}req:{req_id}:ckpt"

    def tokens(self, req_id: str) -> str:
        """Pub/sub channel of a request's token events."""
        return f"{self.prefix}tok:{req_id}"

    def cancel(self) -> str:
        """Pub/sub channel of request ids whose client went away."""
        return f"{self.prefix}cancel"

    def worker(self, worker_id: str) -> str:
        """Heartbeat hash of one worker, with a TTL."""
        return f"{self.prefix}worker:{worker_id}"

    def worker_pattern(self) -> str:
        return f"{self.prefix}worker:*"

    def enqueued(self, req_id: str) -> str:
        """Marker that makes enqueue idempotent by request id."""
        return f"{self.prefix}enq:{req_id}"

    def api_keys(self) -> str:
        """Hash of API keys: SHA-256 hex of the key -> JSON record (id, name, rpm, tpm, created).
        Plaintext keys are never stored."""
        return f"{self.prefix}apikeys"

    def rate_limit(self, key_id: str, kind: str) -> str:
        """GCRA state (theoretical arrival time, ms) of one API key; `kind` is `req` or `tok`.
        The `{key_id}` hash tag keeps a key's two limits in one Redis Cluster slot."""
        return f"{self.prefix}rl:{{{key_id}}}:{kind}"

    # Batch API (gateway/batch_*.py): uploaded files, batch records and their per-line results.

    def file(self, file_id: str) -> str:
        """Hash: metadata of an uploaded or generated file (OpenAI's file object)."""
        return f"{self.prefix}file:{file_id}"

    def file_content(self, file_id: str) -> str:
        """String: the file's bytes (JSONL)."""
        return f"{self.prefix}file:{file_id}:content"

    def batch(self, batch_id: str) -> str:
        """Hash: a batch's record, status, request counts and output file ids."""
        return f"{self.prefix}batch:{batch_id}"

    def batch_results(self, batch_id: str) -> str:
        """Hash: line index -> that line's output (JSON), each written once (HSETNX)."""
        return f"{self.prefix}batch:{batch_id}:results"

    def batch_lease(self, batch_id: str) -> str:
        """String with a TTL: the token of the one job feeding the batch now."""
        return f"{self.prefix}batch:{batch_id}:lease"

    def batches_active(self) -> str:
        """Set of batch ids not yet in a final state (what the batch workers watch over)."""
        return f"{self.prefix}batches:active"

    def batch_queue(self) -> str:
        """Name of the rq queue of batch jobs (rq keeps it under its own `rq:` keys)."""
        return f"{self.prefix}batch"

    def batch_reaper(self) -> str:
        """Short lock: one batch worker at a time looks for batches whose job died."""
        return f"{self.prefix}batches:reaper"

    def batches_by_time(self) -> str:
        """Sorted set: batch id -> creation time (GET /v1/batches lists it, newest first)."""
        return f"{self.prefix}batches:by-time"
