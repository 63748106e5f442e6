"""One choice's text as it is generated: token events -> new tokens (sequencer) -> text
(incremental detokeniser) -> stop-string handling, plus merging several choices into one stream."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Coroutine
from dataclasses import dataclass, field
from typing import TypeVar

from gateway.fleet.client import EngineClient, EngineError, EventStream, WorkerError
from gateway.output.detokenizer import IncrementalDetokenizer, StopStringFilter, TextDecoder
from gateway.output.sequencer import EventSequencer, NewTokens
from shared.messages import GenerationRequest, TokenEvent, TokenLogprob, Usage

log = logging.getLogger(__name__)

STOP_GRACE_S = 0.25  # after the gateway saw a stop string, how long to wait for the worker's usage

T = TypeVar("T")


class BackgroundTasks:
    """Fire-and-forget tasks held by reference until done. Cleanup after a client went away runs
    here: inside a cancelled request task every await would be cancelled again."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task] = set()

    def spawn(self, coro: Coroutine) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def drain(self) -> None:
        if self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)


@dataclass
class ChoiceDelta:
    """What one choice adds to the response; the last one has `finish_reason` and `usage`."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    usage: Usage | None = None


class ChoiceGenerator:
    """Turns the event stream of one submitted request into ChoiceDeltas.

    Ownership: it closes `events` whatever happens, and cancels the request with the workers when
    it stops before the final event (client gone, stop string seen first, error, timeout).
    """

    def __init__(self, client: EngineClient, request: GenerationRequest, events: EventStream,
                 tokenizer, background: BackgroundTasks, decoder: TextDecoder | None = None):
        self._client = client
        self._request = request
        self._events = events
        self._background = background
        self._sequencer = EventSequencer()
        self._detokenizer = IncrementalDetokenizer(tokenizer, request.prompt_token_ids,
                                                   decoder)
        self._stops = StopStringFilter(request.params.stop)
        self._num_tokens = 0
        self._finished = False
        self._closed = False

    async def __aiter__(self) -> AsyncIterator[ChoiceDelta]:
        try:
            while True:
                accepted = await self._next_tokens()
                delta = ChoiceDelta(token_ids=accepted.token_ids, logprobs=accepted.logprobs)
                self._num_tokens += len(accepted.token_ids)
                delta.text = self._stops.feed(self._detokenizer.add(accepted.token_ids))
                if accepted.final is not None:
                    self._finish(delta, accepted.final)
                    yield delta
                    return
                if self._stops.stopped:
                    delta.finish_reason = "stop"
                    delta.usage = await self._usage_after_stop()
                    yield delta
                    return
                if delta.text or delta.token_ids:
                    yield delta
        finally:
            await self.close()

    async def _next_tokens(self) -> NewTokens:
        """The next tokens the client has not seen, a gap filled from the checkpoint."""
        while True:
            event = await anext(self._events)
            filler = await self._fill_gap(event)
            accepted = self._sequencer.accept(event)
            if accepted is None:
                continue
            if filler:  # logprobs are not checkpointed: a filled delta carries none
                return NewTokens(filler + accepted.token_ids, None, accepted.final)
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
        """Release the event stream; cancel the request unless it finished. Idempotent, and safe
        in a cancelled task (EventStream.aclose must not block)."""
        if self._closed:
            return
        self._closed = True
        await self._events.aclose()
        if not self._finished:
            self._background.spawn(self._client.cancel(self._request.req_id))

    def _finish(self, delta: ChoiceDelta, final: TokenEvent) -> None:
        self._finished = True
        if final.error is not None or final.finish_reason not in ("stop", "length"):
            reason = final.error or f"the request ended with `{final.finish_reason}`"
            raise WorkerError(f"The worker could not complete the request: {reason}")
        if not self._stops.stopped:
            delta.text += self._stops.feed(self._detokenizer.flush())
            delta.text += self._stops.flush()
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


_DONE = object()


async def merge_choices(choices: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """Items of all iterators as they come, tagged with the iterator's index. The first error ends
    the merge; stopping early cancels the iterators still running (their requests get cancelled).
    """
    if len(choices) == 1:  # no pump task and no queue hop for the common n=1
        try:
            async for item in choices[0]:
                yield 0, item
        finally:
            aclose = getattr(choices[0], "aclose", None)
            if aclose is not None:
                await aclose()  # its own cleanup never blocks (ChoiceGenerator.close)
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, choice: AsyncIterator[T]) -> None:
        try:
            async for item in choice:
                queue.put_nowait((index, item, None))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer, which re-raises it
            queue.put_nowait((index, _DONE, exc))
            return
        queue.put_nowait((index, _DONE, None))

    tasks = [asyncio.create_task(pump(i, c)) for i, c in enumerate(choices)]
    try:
        running = len(tasks)
        while running:
            index, item, error = await queue.get()
            if error is not None:
                raise error
            if item is _DONE:
                running -= 1
                continue
            yield index, item
    finally:
        for task in tasks:
            task.cancel()  # not awaited: each choice cleans up in its own task
