"""Turns a request's raw token events into the tokens the client has not seen yet: drops events
of stale attempts and tokens already sent, so a resumed request shows a pause, never a gap or a
repeat."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from shared.messages import TokenEvent, TokenLogprob

log = logging.getLogger(__name__)


@dataclass
class NewTokens:
    """The part of one event the client has not seen."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    final: TokenEvent | None = None  # set when this event ends the request


class EventSequencer:
    """Keeps `attempt_max` (the fencing token seen so far) and `next_seq` (tokens sent so far)."""

    def __init__(self) -> None:
        self.attempt_max = 0
        self.next_seq = 0

    def accept(self, event: TokenEvent) -> NewTokens | None:
        """The new tokens of `event`, or None when the whole event is stale."""
        if event.attempt < self.attempt_max:
            return None
        self.attempt_max = event.attempt
        skip = self.next_seq - event.seq  # tokens of this event the client already has
        if skip < 0:
            # Cannot happen if the worker resumes from its checkpoint; keep going rather than stall.
            log.warning("token gap: expected seq %d, got %d (attempt %d)",
                        self.next_seq, event.seq, event.attempt)
            skip = 0
        token_ids = event.token_ids[skip:]
        logprobs = event.logprobs[skip:] if event.logprobs is not None else None
        self.next_seq = max(self.next_seq, event.seq + len(event.token_ids))
        return NewTokens(token_ids, logprobs, event if event.is_final else None)
