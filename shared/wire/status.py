"""The one request status enum, stored in Redis as its string value, and its map to finish reasons."""

from __future__ import annotations

from enum import Enum


class RequestStatus(str, Enum):
    QUEUED = "queued"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"  # EOS, stop token id or stop string
    FINISHED_LENGTH = "finished_length"  # max_tokens or the model's context
    FINISHED_ABORTED = "finished_aborted"  # client went away / cancelled
    FINISHED_ERROR = "finished_error"  # failed (poison request, internal error)

    @property
    def is_finished(self) -> bool:
        return self in _FINISH_REASONS

    @property
    def finish_reason(self) -> str | None:
        """The OpenAI `finish_reason` of a finished status, None while running."""
        return _FINISH_REASONS.get(self)

    @classmethod
    def for_finish_reason(cls, reason: str) -> RequestStatus:
        """The finished status of a finish reason (stop, length, abort, error); KeyError for
        another."""
        return _STATUS_OF_REASON[reason]


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}
_STATUS_OF_REASON = {reason: status for status, reason in _FINISH_REASONS.items()}
