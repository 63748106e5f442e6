"""Every Redis key kvfleet uses, built in one place under one configurable prefix.

Redis Cluster (DESIGN.md, "beyond one Redis"): a script's KEYS must share one slot. The keys one
script touches together are built side by side here (a request's hash, checkpoint, enqueue marker
and token channel; a model's streams), so hash tags, stream shards and sharded pub/sub channels
are a change of this module, not of its callers.
"""

from __future__ import annotations

from dataclasses import dataclass

PRIORITIES = ("interactive", "batch")  # served in this order


@dataclass(frozen=True)
class Keys:
    """Key names of the fleet protocol (see DESIGN.md, "The fleet protocol")."""

    prefix: str = "kvf:"
    group: str = "workers"  # consumer group on every request stream

    # A model's request streams.

    def _model(self, model: str) -> str:
        return f"{self.prefix}{model}"

    def queue(self, model: str, priority: str = "interactive") -> str:
        """Stream of requests for `model` (entries: QueueEntry); interactive is the plain
        `{model}:q`."""
        if priority == "interactive":
            return f"{self._model(model)}:q"
        return f"{self._model(model)}:q:{priority}"

    def queues(self, model: str) -> list[str]:
        """The model's request streams in the order workers serve them (PRIORITIES)."""
        return [self.queue(model, priority) for priority in PRIORITIES]

    def dead_letter(self, model: str) -> str:
        """Stream of requests delivered too many times (entries: DeadLetterEntry)."""
        return f"{self._model(model)}:dlq"

    # One request's keys.

    def _request(self, req_id: str) -> str:
        return f"{self.prefix}req:{req_id}"

    def request(self, req_id: str) -> str:
        """Hash: RequestRecord (payload, attempt = the fencing token, status, worker)."""
        return self._request(req_id)

    def checkpoint(self, req_id: str) -> str:
        """String of the token ids generated so far (shared/wire/checkpoint.py)."""
        return f"{self._request(req_id)}:ckpt"

    def enqueued(self, req_id: str) -> str:
        """Marker that makes enqueue idempotent by request id."""
        return f"{self.prefix}enq:{req_id}"

    def tokens(self, req_id: str) -> str:
        """Pub/sub channel of a request's token events (TokenEvent)."""
        return f"{self.prefix}tok:{req_id}"

    def cancel(self) -> str:
        """Pub/sub channel of request ids whose client went away."""
        return f"{self.prefix}cancel"

    def worker(self, worker_id: str) -> str:
        """Heartbeat hash of one worker (Heartbeat), with a TTL."""
        return f"{self.prefix}worker:{worker_id}"

    def worker_pattern(self) -> str:
        """SCAN pattern of every heartbeat key."""
        return self.worker("*")

    def worker_id(self, heartbeat_key: str) -> str:
        """The worker id of a heartbeat key (the inverse of `worker`)."""
        return heartbeat_key.removeprefix(self.worker(""))

    def api_keys(self) -> str:
        """Hash of API keys: SHA-256 hex of the key -> ApiKeyRecord as JSON. Plaintext keys are
        never stored."""
        return f"{self.prefix}apikeys"

    def rate_limit(self, key_id: str, kind: str) -> str:
        """GCRA state (theoretical arrival time, ms) of one API key; `kind` is `req` or `tok`.
        The `{key_id}` hash tag keeps a key's two limits in one Redis Cluster slot."""
        return f"{self.prefix}rl:{{{key_id}}}:{kind}"

    # Batch API (gateway/openai/batches.py, batch/): uploaded files, batch records and results.

    def file(self, file_id: str) -> str:
        """Hash: FileRecord (OpenAI's file object) of an uploaded or generated file."""
        return f"{self.prefix}file:{file_id}"

    def file_content(self, file_id: str) -> str:
        """String: the file's bytes (JSONL)."""
        return f"{self.prefix}file:{file_id}:content"

    def batch(self, batch_id: str) -> str:
        """Hash: BatchRecord (status, request counts, output file ids)."""
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
