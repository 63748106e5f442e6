"""GET /v1/requests/{id}/stream?after=N: re-attach to a running or finished request and stream
its output from token N (checkpointed tokens first, then live events, never a gap or a repeat)."""

from __future__ import annotations

from collections.abc import AsyncIterator

from gateway.errors import APIError
from gateway.fleet.client import EngineClient, EventStream, RequestSnapshot
from gateway.openai.responses import ResumedChoice, ResumedChunk, chunk_json
from gateway.openai.serving import sse, stream_with_errors
from gateway.openai.tokenization import PromptProcessor
from gateway.output.detokenizer import IncrementalDetokenizer, StopStringFilter
from gateway.output.sequencer import EventSequencer


def request_not_found(req_id: str) -> APIError:
    return APIError(404, f"No request `{req_id}`: it never existed or its result has expired.",
                    param="id", code="request_not_found")


class ResumedOutput:
    """Text of one request's output from token `after` on. The detokeniser is primed with the
    prompt and the output before `after`, so the first delta's leading space comes out right.
    A stop string that straddles token `after` is not seen (the original stream saw it)."""

    def __init__(self, req_id: str, served_id: str, processor: PromptProcessor,
                 snapshot: RequestSnapshot, after: int):
        request = snapshot.request
        context = request.prompt_token_ids + snapshot.token_ids[:after]
        self._req_id = req_id
        self._served_id = served_id
        self._created = int(request.created)
        self._detokenizer = IncrementalDetokenizer(processor.tokenizer, context,
                                                   processor.decoder)
        self.stops = StopStringFilter(request.params.stop)

    def chunk(self, token_index: int, token_ids: list[int], finish_reason: str | None) -> str:
        text = self.stops.feed(self._detokenizer.add(token_ids))
        if finish_reason is not None and not self.stops.stopped:
            text += self.stops.feed(self._detokenizer.flush()) + self.stops.flush()
        if self.stops.stopped and finish_reason is None:
            finish_reason = "stop"
        choice = ResumedChoice(index=0, text=text, finish_reason=finish_reason,
                               token_index=token_index, token_ids=token_ids)
        return sse(chunk_json(ResumedChunk(id=self._req_id, created=self._created,
                                           model=self._served_id, choices=[choice])))


class ReattachServing:
    """Streams a request's output again; never cancels it (the original client may be there)."""

    def __init__(self, client: EngineClient, processor: PromptProcessor):
        self.client = client
        self.processor = processor

    async def stream(self, req_id: str, after: int) -> AsyncIterator[str]:
        """The SSE lines; raises a 404 APIError before any byte when the request is unknown."""
        attached = await self.client.attach(req_id)
        if attached is None:
            raise request_not_found(req_id)
        snapshot, events = attached
        return stream_with_errors(self._stream(req_id, snapshot, events, after))

    async def _stream(self, req_id: str, snapshot: RequestSnapshot, events: EventStream,
                      after: int) -> AsyncIterator[str]:
        tokens = snapshot.token_ids
        first = min(after, len(tokens))
        output = ResumedOutput(req_id, self.processor.model.served_id, self.processor,
                               snapshot, first)
        try:
            finished = snapshot.status.finish_reason if snapshot.status.is_finished else None
            if tokens[first:] or finished is not None:
                yield output.chunk(first, tokens[first:], finished)
            if finished is not None or output.stops.stopped:
                return
            sequencer = EventSequencer()
            sequencer.attempt_max = snapshot.attempt
            sequencer.next_seq = max(after, len(tokens))
            async for line in self._live(req_id, events, sequencer, output):
                yield line
        finally:
            await events.aclose()

    async def _live(self, req_id: str, events: EventStream, sequencer: EventSequencer,
                    output: ResumedOutput) -> AsyncIterator[str]:
        while True:
            event = await anext(events)
            gap = sequencer.gap(event)
            if gap is not None:
                filler = (await self.client.read_checkpoint(req_id))[gap[0]:gap[1]]
                sequencer.fill(gap[0], filler)
                if filler:
                    yield output.chunk(gap[0], filler, None)
            accepted = sequencer.accept(event)
            if accepted is None:
                continue
            reason = None
            if accepted.final is not None:
                reason = accepted.final.finish_reason or "error"
            if accepted.token_ids or reason is not None:
                index = sequencer.next_seq - len(accepted.token_ids)
                yield output.chunk(index, accepted.token_ids, reason)
            if reason is not None or output.stops.stopped:
                return
