"""POST /v1/completions: prompts (strings or token ids) in, text out, streamed or whole."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from gateway.generation import ChoiceDelta, ChoiceGenerator, merge_choices
from gateway.protocol import CompletionRequest
from gateway.responses import CompletionChoice, CompletionLogprobs, CompletionResponse, chunk_json
from gateway.serving import OpenAIServing, UsageTally, new_request_id, sse, stream_with_errors
from shared.messages import TokenLogprob


class CompletionServing(OpenAIServing):

    async def create(self, request: CompletionRequest) -> CompletionResponse | AsyncIterator[str]:
        """A whole response, or the SSE lines of a stream (for the route to send)."""
        self.check_model(request.model)
        prompts = self.processor.completion_prompts(request.prompt)
        req_hex = new_request_id()
        choices = await self.submit_all(self.build_requests(req_hex, prompts, request))
        echoes = [self.processor.decode(p) if request.echo else "" for p in prompts
                  for _ in range(request.n)]
        response_id, created = f"cmpl-{req_hex}", int(time.time())
        if request.stream:
            return stream_with_errors(
                self._stream(request, choices, echoes, response_id, created))
        return await self._respond(request, choices, echoes, response_id, created)

    async def _respond(self, request: CompletionRequest, choices: list[ChoiceGenerator],
                       echoes: list[str], response_id: str, created: int) -> CompletionResponse:
        usage = UsageTally(request.n)
        out = []
        for index, deltas in enumerate(await self.collect(choices)):
            final = deltas[-1]
            usage.add(index, final.usage)
            logprobs = None
            if request.logprobs is not None:
                logprobs = CompletionLogprobs()
                self._add_logprobs(logprobs, deltas, 0)
            out.append(CompletionChoice(index=index, logprobs=logprobs,
                                        text=echoes[index] + "".join(d.text for d in deltas),
                                        finish_reason=final.finish_reason))
        return CompletionResponse(id=response_id, created=created, model=self.served_id,
                                  choices=out, usage=usage.info())

    async def _stream(self, request: CompletionRequest, choices: list[ChoiceGenerator],
                      echoes: list[str], response_id: str, created: int) -> AsyncIterator[str]:
        def chunk(choice: CompletionChoice) -> str:
            return sse(chunk_json(CompletionResponse(id=response_id, created=created,
                                                     model=self.served_id, choices=[choice])))

        usage = UsageTally(request.n)
        offsets = [len(echo) for echo in echoes]
        for index, echo in enumerate(echoes):
            if echo:
                yield chunk(CompletionChoice(index=index, text=echo))
        async for index, delta in merge_choices([aiter(c) for c in choices]):
            logprobs = None
            if request.logprobs is not None and delta.logprobs:
                logprobs = CompletionLogprobs()
                offsets[index] = self._add_logprobs(logprobs, [delta], offsets[index])
            if delta.text or logprobs is not None:
                yield chunk(CompletionChoice(index=index, text=delta.text, logprobs=logprobs))
            if delta.finish_reason is not None:
                usage.add(index, delta.usage)
                yield chunk(CompletionChoice(index=index, text="",
                                             finish_reason=delta.finish_reason))
        if request.include_usage:
            yield sse(chunk_json(CompletionResponse(id=response_id, created=created,
                                                    model=self.served_id, choices=[],
                                                    usage=usage.info())))

    def _add_logprobs(self, out: CompletionLogprobs, deltas: list[ChoiceDelta],
                      text_offset: int) -> int:
        """Append the deltas' token logprobs in the legacy shape; returns the next text offset."""
        for delta in deltas:
            for entry in delta.logprobs or []:
                token = self.processor.token_text(entry.token_id)
                out.tokens.append(token)
                out.token_logprobs.append(entry.logprob)
                out.top_logprobs.append(self._top(entry))
                out.text_offset.append(text_offset)
                text_offset += len(token)
        return text_offset

    def _top(self, entry: TokenLogprob) -> dict[str, float]:
        top = {self.processor.token_text(token_id): logprob for token_id, logprob in entry.top}
        return top or {self.processor.token_text(entry.token_id): entry.logprob}
