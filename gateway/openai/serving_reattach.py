"""GET /v1/requests/{id}/stream?after=N: re-attach to a running or finished request and stream
its output from token N (checkpointed tokens first, then live events, never a gap or a repeat),
through the same per-choice stream as a live request (gateway/output/choice_stream.py), decoded by
the tokenizer of the request's own model."""

from __future__ import annotations

from collections.abc import AsyncIterator

from kvfleet.gateway.fleet.client import EngineClient
from kvfleet.gateway.http.errors import APIError
from kvfleet.gateway.models.served import ServedModels
from kvfleet.gateway.openai.responses import ResumedChoice, ResumedChunk, chunk_json
from kvfleet.gateway.openai.serving import sse, stream_with_errors
from kvfleet.gateway.output.choice_stream import ChoiceStream, StreamStart


def request_not_found(req_id: str) -> APIError:
    return APIError(404, f"No request `{req_id}`: it never existed or its result has expired.",
                    param="id", code="request_not_found")


class ReattachServing:
    """Streams a request's output again; never cancels it (the original client may be there)."""

    def __init__(self, client: EngineClient, models: ServedModels):
        self.client = client
        self.models = models

    async def stream(self, req_id: str, after: int) -> AsyncIterator[str]:
        """The SSE lines; raises a 404 APIError before any byte when the request is unknown."""
        attached = await self.client.attach(req_id)
        if attached is None:
            raise request_not_found(req_id)
        snapshot, events = attached
        generation = snapshot.request
        try:
            processor = (await self.models.serving(generation.model)).processor
        except BaseException:
            await events.aclose()
            raise
        decoder = (processor.decoder if generation.params.skip_special_tokens
                   else processor.decoder_with_special)
        choice = ChoiceStream(self.client, generation, events, processor.tokenizer,
                              decoder=decoder, start=StreamStart.resume(snapshot, after),
                              eos_token_ids=processor.eos_token_ids)
        # the model as the request named it: its adapter's name, if any
        model = generation.lora or generation.model
        return stream_with_errors(self._chunks(req_id, int(generation.created), model, choice))

    async def _chunks(self, req_id: str, created: int, model: str, choice: ChoiceStream
                      ) -> AsyncIterator[str]:
        async for delta in choice:
            resumed = ResumedChoice(index=0, text=delta.text, finish_reason=delta.finish_reason,
                                    stop_reason=delta.stop_reason,
                                    token_index=delta.token_index, token_ids=delta.token_ids)
            yield sse(chunk_json(ResumedChunk(id=req_id, created=created, model=model,
                                              choices=[resumed])))
