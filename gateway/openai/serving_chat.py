"""POST /v1/chat/completions: messages through the chat template in, an assistant message out."""

from __future__ import annotations

from collections.abc import AsyncIterator

from gateway.dashboard.metrics import RequestTracker
from gateway.openai.protocol import ChatCompletionRequest
from gateway.openai.responses import (
    ChatChoice,
    ChatChoiceLogprobs,
    ChatCompletionResponse,
    ChatLogprob,
    ChatMessageOut,
    TopLogprob,
)
from gateway.openai.serving import OpenAIServing, UsageTally, outcome_of
from gateway.openai.sse_chunks import ChatChunkEncoder
from gateway.output.choice_stream import ChoiceDelta, ChoiceStream
from gateway.output.merge import merge_choices


class ChatServing(OpenAIServing):

    endpoint = "chat"

    async def prompts(self, request: ChatCompletionRequest) -> list[list[int]]:
        return [await self.processor.chat_prompt_async(
            [m.to_template_dict() for m in request.messages], request.add_generation_prompt)]

    async def _respond(self, request: ChatCompletionRequest, choices: list[ChoiceStream],
                       prompts: list[list[int]], response_id: str, created: int,
                       tracker: RequestTracker) -> ChatCompletionResponse:
        usage = UsageTally(request.n)
        out = []
        for index, deltas in enumerate(await self.collect(choices, tracker)):
            final = deltas[-1]
            usage.add(index, final.usage)
            logprobs = self._logprobs(deltas) if request.logprobs else None
            message = ChatMessageOut(content="".join(d.text for d in deltas))
            out.append(ChatChoice(index=index, message=message, logprobs=logprobs,
                                  finish_reason=final.finish_reason))
        info = usage.info()
        tracker.finish(outcome_of([c.finish_reason for c in out]), info.prompt_tokens,
                       info.completion_tokens)
        return ChatCompletionResponse(id=response_id, created=created, model=self.served_id,
                                      choices=out, usage=info)

    async def _stream(self, request: ChatCompletionRequest, choices: list[ChoiceStream],
                      prompts: list[list[int]], response_id: str, created: int,
                      tracker: RequestTracker) -> AsyncIterator[bytes]:
        frames = ChatChunkEncoder(response_id, created, self.served_id)
        usage = UsageTally(request.n)
        finish_reasons: list[str | None] = []
        try:
            for index in range(len(choices)):
                yield frames.role(index)
            async for index, delta in merge_choices([aiter(c) for c in choices]):
                if delta.token_ids:
                    tracker.on_tokens(len(delta.token_ids))
                logprobs = self._logprobs([delta]) if request.logprobs and delta.logprobs else None
                if delta.text or logprobs is not None:
                    yield frames.content(index, delta.text, logprobs)
                if delta.finish_reason is not None:
                    usage.add(index, delta.usage)
                    finish_reasons.append(delta.finish_reason)
                    yield frames.finish(index, delta.finish_reason)
            info = usage.info()
            if request.include_usage:
                yield frames.usage(info)
            tracker.finish(outcome_of(finish_reasons), info.prompt_tokens, info.completion_tokens)
        except Exception:
            tracker.finish("error")
            raise
        finally:
            tracker.finish("abort")  # no-op after a finish: only a client gone mid-stream

    def _logprobs(self, deltas: list[ChoiceDelta]) -> ChatChoiceLogprobs:
        content = []
        for delta in deltas:
            for entry in delta.logprobs or []:
                top = [self._top_logprob(token_id, logprob) for token_id, logprob in entry.top]
                content.append(ChatLogprob(**self._top_logprob(entry.token_id, entry.logprob)
                                           .model_dump(), top_logprobs=top))
        return ChatChoiceLogprobs(content=content)

    def _top_logprob(self, token_id: int, logprob: float) -> TopLogprob:
        return TopLogprob(token=self.processor.token_text(token_id), logprob=logprob,
                          bytes=self.processor.token_bytes(token_id))
