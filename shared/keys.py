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
