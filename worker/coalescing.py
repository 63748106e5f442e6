"""Token events coalesced per request: fewer, larger events when steps are fast.

Every token event costs Redis the same whatever it carries (a checkpoint append, a publish, a
delivery to the gateway's connection), so on a fast accelerator (short decode steps) the
fleet's Redis load is set by events, not tokens. With `--publish-interval-ms` above 0 a
worker holds a request's new tokens back until that long has passed since the request's last
event, then sends them as one event. Held back are only the middle of an answer: the first event
of an attempt (time to the first token) and the final one go out at once, and a worker whose
steps are slower than the interval publishes every step as before, so coalescing only happens
where it helps.

What a client sees does not change: the gateway takes the tokens of an event in order. Held tokens
are neither checkpointed nor published, so a worker that dies holding some loses nothing: the
request resumes from the checkpoint and regenerates them (greedy and seeded sampling give the
same tokens again).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

from kvfleet.shared.wire import TokenEvent
from kvfleet.worker.protocol import Publication


def merge_events(first: TokenEvent, then: TokenEvent) -> TokenEvent:
    """One event carrying `first`'s tokens followed by `then`'s (the next ones of the same
    attempt); the end (finish, stop, usage, error) is `then`'s, prompt logprobs whichever has
    them."""
    if then.seq != first.seq + len(first.token_ids) or then.attempt != first.attempt:
        raise ValueError(f"event at seq {then.seq} (attempt {then.attempt}) does not follow "
                         f"{len(first.token_ids)} tokens at seq {first.seq} "
                         f"(attempt {first.attempt})")
    if (first.logprobs is None) != (then.logprobs is None) and first.token_ids and then.token_ids:
        raise ValueError("events with and without logprobs cannot be merged")
    logprobs = None
    if first.logprobs is not None or then.logprobs is not None:
        logprobs = (first.logprobs or []) + (then.logprobs or [])
    return dataclasses.replace(
        then, seq=first.seq, token_ids=first.token_ids + then.token_ids, logprobs=logprobs,
        prompt_logprobs=first.prompt_logprobs if first.prompt_logprobs is not None
        else then.prompt_logprobs)


class EventCoalescer:
    """Decides, step by step, which requests' events go out now and merges the rest into what
    each request holds. `interval_s` 0 passes every event through unchanged."""

    def __init__(self, interval_s: float, clock: Callable[[], float] = time.monotonic):
        if interval_s < 0:
            raise ValueError("the publish interval cannot be negative")
        self.interval_s = interval_s
        self._clock = clock
        self._held: dict[str, Publication] = {}  # req_id -> tokens not published yet
        self._last_sent: dict[str, float] = {}  # req_id -> when its last event went out

    @property
    def num_held(self) -> int:
        return len(self._held)

    def step(self, items: list[Publication]) -> list[Publication]:
        """This step's publications in, the ones to publish now out: the finished and first
        ones, and every request whose last event is `interval_s` old (with what it held)."""
        if self.interval_s == 0:
            return items
        now = self._clock()
        out = []
        for item in items:
            held = self._held.pop(item.req_id, None)
            if held is not None:
                item = dataclasses.replace(item, event=merge_events(held.event, item.event))
            last = self._last_sent.get(item.req_id)
            if item.final_status is not None or last is None or now - last >= self.interval_s:
                out.append(item)
            else:
                self._held[item.req_id] = item
        # a request with nothing new this step (preempted, waiting) still gets what it holds
        for req_id, held in list(self._held.items()):
            if now - self._last_sent[req_id] >= self.interval_s:
                out.append(self._held.pop(req_id))
        for item in out:
            if item.final_status is None:
                self._last_sent[item.req_id] = now
            else:
                self._last_sent.pop(item.req_id, None)
        return out

    def take(self, req_id: str) -> Publication | None:
        """What the request holds, to publish now (before its stream leaves this worker)."""
        held = self._held.pop(req_id, None)
        if held is not None and held.final_status is None:
            self._last_sent[req_id] = self._clock()
        return held

    def forget(self, req_id: str) -> None:
        """The request left this worker without a final event (fenced off by a newer attempt):
        drop what it held; its new owner regenerates those tokens."""
        self._held.pop(req_id, None)
        self._last_sent.pop(req_id, None)
