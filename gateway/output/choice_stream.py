"""One choice's output as the client sees it: token events -> the tokens it has not seen yet
(sequencer; a gap filled from the checkpoint) -> text (incremental detokeniser) -> the end the
worker decided (stop strings held back while streaming, the text cut where the worker stopped).
Live streams and re-attach run this same pipeline; they differ only in where it starts."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

from kvfleet.gateway.fleet.client import (
    EngineClient,
    EventStream,
    RequestSnapshot,
    WorkerError,
)
from kvfleet.gateway.output.background import BackgroundTasks
from kvfleet.gateway.output.detokenizer import IncrementalDetokenizer, StopStringRenderer, TextDecoder
from kvfleet.gateway.output.sequencer import EventSequencer, NewTokens
from kvfleet.shared.wire import GenerationRequest, TokenEvent, TokenLogprob, Usage

log = logging.getLogger(__name__)


@dataclass
class ChoiceDelta:
    """What one choice adds to the response; the last one has `finish_reason` (and, for the
    client that submitted the request, `usage`)."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # the stop string or stop token id (None: EOS, length)
    usage: Usage | None = None
    token_index: int = 0  # index in the output of the first of `token_ids`
    # prompt token i + 1's logprob at i (SamplingParams.prompt_logprobs), in one delta only
    prompt_logprobs: list[TokenLogprob] | None = None
    # the last delta: the numerics fingerprints its tokens were computed on, "+"-joined
    # (TokenEvent.numerics; None from a worker older than the field)
    numerics: str | None = None


@dataclass(frozen=True)
class StreamStart:
    """Where a choice's stream begins.

    A fresh stream starts at token 0 with the prompt as the detokeniser's context. A resumed one
    (re-attach with `after=N`) first replays the checkpointed tokens from N, with the prompt and
    the output before N as context (so the first delta's leading space comes out right), then
    follows the live events from where the checkpoint ended. A stop string that straddles token N
    is cut from token N on (the text before N was the original stream's). A request that had
    ended when it was read replays without its final event: its text is cut at the first stop
    string after N (TokenEvent's compatibility rule).
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
    gone, error, timeout) and raises WorkerError when a worker ended it with an error or abort.
    A follower (`start.follower`: re-attach) never cancels and reports the end as the worker
    recorded it. Where the answer ends is the worker's word, in the final event.
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
        self._stops = StopStringRenderer(params.stop, params.include_stop_str_in_output)
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
                delta = self._delta(accepted.token_ids, accepted.logprobs, index, accepted.final)
                delta.prompt_logprobs = accepted.prompt_logprobs
                if accepted.final is not None:
                    self._finish(delta, accepted.final)
                    yield delta
                    return
                if delta.text or delta.token_ids or delta.prompt_logprobs:
                    yield delta
        finally:
            await self.close()

    def _delta(self, token_ids: list[int], logprobs: list[TokenLogprob] | None, index: int,
               final: TokenEvent | None = None) -> ChoiceDelta:
        """The delta of output tokens `index ..`: their text, held back where a stop string may
        be starting, or, with the last of them (`final`), the rest of the text cut where the
        worker stopped."""
        self._num_tokens += len(token_ids)
        if final is None:
            text = self._stops.feed(self._detokenizer.add(token_ids))
            return ChoiceDelta(text=text, token_ids=token_ids, logprobs=logprobs,
                               token_index=index)
        texted = token_ids
        if final.finish_reason == "stop" and texted and texted[-1] in self._silent_stop_ids:
            texted = texted[:-1]
        text = self._detokenizer.add(texted) + self._detokenizer.flush()
        text = self._stops.finish(text, final.finish_reason, final.stop_reason,
                                  final.text_after_stop)
        return ChoiceDelta(text=text, token_ids=token_ids, logprobs=logprobs, token_index=index,
                           stop_reason=final.stop_reason, numerics=final.numerics)

    def _replay(self) -> ChoiceDelta | None:
        """The checkpointed tokens a resumed stream sends first (None when there are none)."""
        start = self._start
        if not start.replay_token_ids and start.replay_finish_reason is None:
            return None
        # an ended request's record has its finish reason, not its final event (see StreamStart)
        end = None if start.replay_finish_reason is None else TokenEvent(
            seq=start.replay_index, attempt=start.attempt, finish_reason=start.replay_finish_reason)
        delta = self._delta(list(start.replay_token_ids), None, start.replay_index, end)
        if end is not None:
            self._finished = True
            delta.finish_reason = end.finish_reason
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

    def _finish(self, delta: ChoiceDelta, final: TokenEvent) -> None:
        self._finished = True
        if self.follower:  # the end as the worker recorded it, an error included
            delta.finish_reason = final.finish_reason or "error"
            return
        if final.error is not None or final.finish_reason not in ("stop", "length"):
            reason = final.error or f"the request ended with `{final.finish_reason}`"
            raise WorkerError(f"The worker could not complete the request: {reason}")
        delta.finish_reason = final.finish_reason
        delta.usage = final.usage or self._local_usage()

    def _local_usage(self) -> Usage:
        return Usage(prompt_tokens=len(self._request.prompt_token_ids),
                     completion_tokens=self._num_tokens)
