"""One choice's output as the client sees it: token events -> the tokens it has not seen yet
(sequencer; a gap filled from the checkpoint) -> text (incremental detokeniser) -> stop strings.
Live streams and re-attach run this same pipeline; they differ only in where it starts."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

from gateway.fleet.client import (
    EngineClient,
    EngineError,
    EventStream,
    RequestSnapshot,
    WorkerError,
)
from gateway.output.background import BackgroundTasks
from gateway.output.detokenizer import IncrementalDetokenizer, StopStringFilter, TextDecoder
from gateway.output.sequencer import EventSequencer, NewTokens
from shared.wire import GenerationRequest, TokenEvent, TokenLogprob, Usage

log = logging.getLogger(__name__)

STOP_GRACE_S = 0.25  # after the gateway saw a stop string, how long to wait for the worker's usage


@dataclass
class ChoiceDelta:
    """What one choice adds to the response; the last one has `finish_reason` (and, for the
    client that submitted the request, `usage`)."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    usage: Usage | None = None
    token_index: int = 0  # index in the output of the first of `token_ids`
    # prompt token i + 1's logprob at i (SamplingParams.prompt_logprobs), in one delta only
    prompt_logprobs: list[TokenLogprob] | None = None


@dataclass(frozen=True)
class StreamStart:
    """Where a choice's stream begins.

    A fresh stream starts at token 0 with the prompt as the detokeniser's context. A resumed one
    (re-attach with `after=N`) first replays the checkpointed tokens from N, with the prompt and
    the output before N as context (so the first delta's leading space comes out right), then
    follows the live events from where the checkpoint ended. A stop string that straddles token N
    is not seen (the original stream saw it).
    """

    context_token_ids: Sequence[int]  # decoded before the first delta, never sent
    next_seq: int = 0  # the first output token not sent yet
    attempt: int = 0  # the fencing token seen so far
    replay_token_ids: Sequence[int] = ()  # checkpointed tokens sent before any live event
    replay_index: int = 0  # index of the first of them
    replay_finish_reason: str | None = None  # the request had ended when it was read
    follower: bool = False  # re-attach: the request belongs to another client (see ChoiceStream)

    @classmethod
    def fresh(cls, request: GenerationRequest) -> StreamStart:
        return cls(context_token_ids=request.prompt_token_ids)

    @classmethod
    def resume(cls, snapshot: RequestSnapshot, after: int) -> StreamStart:
        tokens = snapshot.token_ids
        first = min(after, len(tokens))
        status = snapshot.status
        return cls(context_token_ids=snapshot.request.prompt_token_ids + tokens[:first],
                   next_seq=max(after, len(tokens)), attempt=snapshot.attempt,
                   replay_token_ids=tokens[first:], replay_index=first,
                   replay_finish_reason=status.finish_reason if status.is_finished else None,
                   follower=True)


class ChoiceStream:
    """The ChoiceDeltas of one request's events.

    Ownership: it closes `events` whatever happens. The owner of the request (the client that
    submitted it) also cancels it with the workers when it stops before the final event (client
    gone, stop string seen first, error, timeout), raises WorkerError when a worker ended it with
    an error or abort, and after a stop string waits briefly for the worker's usage. A follower
    (`start.follower`: re-attach) never cancels and reports the end as the worker recorded it.
    """

    def __init__(self, client: EngineClient, request: GenerationRequest, events: EventStream,
                 tokenizer, background: BackgroundTasks | None = None,
                 decoder: TextDecoder | None = None, *, start: StreamStart | None = None,
                 eos_token_ids: frozenset[int] = frozenset()):
        self._start = start or StreamStart.fresh(request)
        if background is None and not self._start.follower:
            raise ValueError("the owner of a request needs BackgroundTasks to cancel it")
        self._client = client
        self._request = request
        self._events = events
        self._background = background
        self._sequencer = EventSequencer(next_seq=self._start.next_seq,
                                         attempt=self._start.attempt)
        self._detokenizer = IncrementalDetokenizer(tokenizer, self._start.context_token_ids,
                                                   decoder)
        params = request.params
        self._stops = StopStringFilter(params.stop, params.include_stop_str_in_output)
        # the token that ended the answer has no text in it (as vLLM), unless asked for
        self._silent_stop_ids = frozenset() if params.include_stop_str_in_output else (
            frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos
                                                else eos_token_ids))
        self._num_tokens = 0  # tokens this stream sent (the usage when the worker's is missing)
        self._finished = False
        self._closed = False

    @property
    def follower(self) -> bool:
        return self._start.follower

    async def __aiter__(self) -> AsyncIterator[ChoiceDelta]:
        try:
            replayed = self._replay()
            if replayed is not None:
                yield replayed
                if replayed.finish_reason is not None:
                    return
            while True:
                accepted = await self._next_tokens()
                index = self._sequencer.next_seq - len(accepted.token_ids)
                final_reason = accepted.final.finish_reason if accepted.final else None
                delta = self._delta(accepted.token_ids, accepted.logprobs, index, final_reason)
                delta.prompt_logprobs = accepted.prompt_logprobs
                if accepted.final is not None:
                    self._finish(delta, accepted.final)
                    yield delta
                    return
                if self._stops.stopped:
                    delta.finish_reason = "stop"
                    if not self.follower:
                        delta.usage = await self._usage_after_stop()
                    yield delta
                    return
                if delta.text or delta.token_ids or delta.prompt_logprobs:
                    yield delta
        finally:
            await self.close()

    def _delta(self, token_ids: list[int], logprobs: list[TokenLogprob] | None,
               index: int, final_reason: str | None = None) -> ChoiceDelta:
        """The delta of output tokens `index ..`: their text through the stop-string filter,
        which ends the answer only once min_tokens tokens are out (the worker's rule)."""
        self._num_tokens += len(token_ids)
        texted = token_ids
        if final_reason == "stop" and texted and texted[-1] in self._silent_stop_ids:
            texted = texted[:-1]
        may_stop = index + len(token_ids) >= self._request.params.min_tokens
        text = self._stops.feed(self._detokenizer.add(texted), may_stop=may_stop)
        return ChoiceDelta(text=text, token_ids=token_ids, logprobs=logprobs, token_index=index)

    def _replay(self) -> ChoiceDelta | None:
        """The checkpointed tokens a resumed stream sends first (None when there are none)."""
        start = self._start
        if not start.replay_token_ids and start.replay_finish_reason is None:
            return None
        delta = self._delta(list(start.replay_token_ids), None, start.replay_index,
                            start.replay_finish_reason)
        if start.replay_finish_reason is not None:
            self._finished = True
            self._flush(delta)
            delta.finish_reason = start.replay_finish_reason
        elif self._stops.stopped:
            delta.finish_reason = "stop"
        return delta

    async def _next_tokens(self) -> NewTokens:
        """The next tokens the client has not seen, a gap filled from the checkpoint."""
        while True:
            event = await anext(self._events)
            filler = await self._fill_gap(event)
            accepted = self._sequencer.accept(event)
            if accepted is None:
                continue
            if filler:  # logprobs are not checkpointed: a filled delta carries none
                return NewTokens(filler + accepted.token_ids, None, accepted.final,
                                 accepted.prompt_logprobs)
            return accepted

    async def _fill_gap(self, event: TokenEvent) -> list[int]:
        gap = self._sequencer.gap(event)
        if gap is None:
            return []
        first, end = gap
        filler = (await self._client.read_checkpoint(self._request.req_id))[first:end]
        log.info("request %s: tokens %d..%d missed on pub/sub, %d read from the checkpoint",
                 self._request.req_id, first, end, len(filler))
        self._sequencer.fill(first, filler)
        return filler

    async def close(self) -> None:
        """Release the event stream; the owner cancels the request unless it finished.
        Idempotent, and safe in a cancelled task (EventStream.aclose must not block)."""
        if self._closed:
            return
        self._closed = True
        await self._events.aclose()
        if not self._finished and not self.follower:
            self._background.spawn(self._client.cancel(self._request.req_id))

    def _flush(self, delta: ChoiceDelta) -> None:
        """No more tokens: what the detokeniser and the stop filter still hold."""
        if not self._stops.stopped:
            delta.text += self._stops.feed(self._detokenizer.flush())
            delta.text += self._stops.flush()

    def _finish(self, delta: ChoiceDelta, final: TokenEvent) -> None:
        self._finished = True
        if self.follower:  # the end as the worker recorded it, an error included
            self._flush(delta)
            delta.finish_reason = final.finish_reason or "error"
            return
        if final.error is not None or final.finish_reason not in ("stop", "length"):
            reason = final.error or f"the request ended with `{final.finish_reason}`"
            raise WorkerError(f"The worker could not complete the request: {reason}")
        self._flush(delta)
        delta.finish_reason = "stop" if self._stops.stopped else final.finish_reason
        delta.usage = final.usage or self._local_usage()

    async def _usage_after_stop(self) -> Usage:
        """The worker stops at the same stop string; its final event (with the cached-token count)
        normally follows at once. Wait for it briefly, else count locally and cancel."""
        try:
            async with asyncio.timeout(STOP_GRACE_S):
                while True:
                    accepted = self._sequencer.accept(await anext(self._events))
                    if accepted is not None and accepted.final is not None:
                        if accepted.final.usage is not None and accepted.final.error is None:
                            self._finished = True
                            return accepted.final.usage
                        break
        except (TimeoutError, EngineError):  # the answer is complete: only the usage is estimated
            pass
        return self._local_usage()

    def _local_usage(self) -> Usage:
        return Usage(prompt_tokens=len(self._request.prompt_token_ids),
                     completion_tokens=self._num_tokens)
