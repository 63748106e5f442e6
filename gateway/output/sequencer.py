"""Turns a request's raw token events into the tokens the client has not seen yet: drops events
of stale attempts and tokens already sent, so a resumed request shows a pause, never a gap or a
repeat."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from kvfleet.shared.wire import TokenEvent, TokenLogprob

log = logging.getLogger(__name__)


@dataclass
class NewTokens:
    """The part of one event the client has not seen."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    final: TokenEvent | None = None  # set when this event ends the request
    prompt_logprobs: list[TokenLogprob] | None = None  # the first output's event carries them


class EventSequencer:
    """Keeps `attempt_max` (the fencing token seen so far) and `next_seq` (tokens sent so far)."""

    def __init__(self, next_seq: int = 0, attempt: int = 0) -> None:
        self.attempt_max = attempt
        self.next_seq = next_seq

    def gap(self, event: TokenEvent) -> tuple[int, int] | None:
        """(first, end) of the tokens missing before `event` (a lost pub/sub message), or None.
        The worker appends to the checkpoint before it publishes, so the checkpoint has them."""
        if event.attempt < self.attempt_max or event.seq <= self.next_seq:
            return None
        return self.next_seq, event.seq

    def fill(self, first: int, token_ids: list[int]) -> None:
        """Tokens `first..` were delivered from the checkpoint (they fill a gap)."""
        if first == self.next_seq:
            self.next_seq += len(token_ids)

    def accept(self, event: TokenEvent) -> NewTokens | None:
        """The new tokens of `event`, or None when the whole event is stale."""
        if event.attempt < self.attempt_max:
            return None
        self.attempt_max = event.attempt
        skip = self.next_seq - event.seq  # tokens of this event the client already has
        if skip < 0:
            # The checkpoint did not have the tokens either: keep going rather than stall.
            log.warning("token gap: expected seq %d, got %d (attempt %d)",
                        self.next_seq, event.seq, event.attempt)
            skip = 0
        token_ids = event.token_ids[skip:]
        logprobs = event.logprobs[skip:] if event.logprobs is not None else None
        self.next_seq = max(self.next_seq, event.seq + len(event.token_ids))
        return NewTokens(token_ids, logprobs, event if event.is_final else None,
                         event.prompt_logprobs)
