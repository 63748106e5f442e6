"""GET /v1/requests/{id}/stream?after=N: re-attach to a running or finished request and stream
its output from token N (checkpointed tokens first, then live events, never a gap or a repeat),
through the same per-choice stream as a live request (gateway/output/choice_stream.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator

from gateway.errors import APIError
from gateway.fleet.client import EngineClient
from gateway.openai.responses import ResumedChoice, ResumedChunk, chunk_json
from gateway.openai.serving import sse, stream_with_errors
from gateway.openai.tokenization import PromptProcessor
from gateway.output.choice_stream import ChoiceStream, StreamStart


def request_not_found(req_id: str) -> APIError:
    return APIError(404, f"No request `{req_id}`: it never existed or its result has expired.",
                    param="id", code="request_not_found")


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
        params = snapshot.request.params
        decoder = (self.processor.decoder if params.skip_special_tokens
                   else self.processor.decoder_with_special)
        choice = ChoiceStream(self.client, snapshot.request, events, self.processor.tokenizer,
                              decoder=decoder, start=StreamStart.resume(snapshot, after),
                              eos_token_ids=self.processor.eos_token_ids)
        return stream_with_errors(self._chunks(req_id, int(snapshot.request.created), choice))

    async def _chunks(self, req_id: str, created: int, choice: ChoiceStream
                      ) -> AsyncIterator[str]:
        model = self.processor.model.served_id
        async for delta in choice:
            resumed = ResumedChoice(index=0, text=delta.text, finish_reason=delta.finish_reason,
                                    stop_reason=delta.stop_reason,
                                    token_index=delta.token_index, token_ids=delta.token_ids)
            yield sse(chunk_json(ResumedChunk(id=req_id, created=created, model=model,
                                              choices=[resumed])))
