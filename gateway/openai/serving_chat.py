"""POST /v1/chat/completions: messages (and tools) through the chat template in, an assistant
message out — its reasoning, content and tool calls split from the generated text."""

from __future__ import annotations

from collections.abc import AsyncIterator

from kvfleet.gateway.dashboard.metrics import RequestTracker
from kvfleet.gateway.http.errors import bad_request
from kvfleet.gateway.openai.chat_output import ChatOutput, ChatOutputOptions
from kvfleet.gateway.openai.constraints import check, request_constraint
from kvfleet.gateway.openai.fields import UNSUPPORTED_CHAT
from kvfleet.gateway.openai.prompt_logprobs import prompt_logprobs_of, vllm_prompt_logprobs
from kvfleet.gateway.openai.request_schemas import ChatCompletionRequest
from kvfleet.gateway.openai.responses import (
    ChatChoice,
    ChatChoiceLogprobs,
    ChatCompletionResponse,
    ChatLogprob,
    ChatMessageOut,
    TopLogprob,
)
from kvfleet.gateway.openai.serving import OpenAIServing, UsageTally, outcome_of, running_usage
from kvfleet.gateway.openai.sse_chunks import ChatChunkEncoder
from kvfleet.gateway.output.choice_stream import ChoiceDelta, ChoiceStream
from kvfleet.gateway.output.merge import merge_choices
from kvfleet.gateway.output.reasoning import prompt_opens_reasoning, supports_reasoning
from kvfleet.gateway.tools.formats import format_for_template, template_has_tools
from kvfleet.gateway.tools.grammar import auto_tool_constraint, tool_call_constraint
from kvfleet.gateway.tools.prompting import template_input
from kvfleet.shared.wire import OutputConstraint


class ChatServing(OpenAIServing):

    endpoint = "chat"
    unsupported_fields = UNSUPPORTED_CHAT

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        template = getattr(self.processor.tokenizer, "chat_template", None)
        self.native_tools = template_has_tools(template)
        self.tool_format = format_for_template(template, self.settings.tool_call_parser)
        mode = self.settings.reasoning_parser
        self.reasoning = mode == "think" or (
            mode == "auto" and supports_reasoning(self.processor.tokenizer))

    async def prompts(self, request: ChatCompletionRequest) -> list[list[int]]:
        choice = request.effective_tool_choice
        tools = ([t.model_dump(exclude_none=True) for t in request.tools]
                 if request.tools and choice != "none" else None)
        kwargs = dict(request.chat_template_kwargs or {})
        if request.reasoning_effort is not None:
            kwargs.setdefault("reasoning_effort", request.reasoning_effort)
        rendered = template_input(request.messages, tools, self.native_tools, kwargs)
        return [await self.processor.chat_prompt_async(
            rendered.messages, request.add_generation_prompt, request.continue_final_message,
            rendered.tools, rendered.kwargs)]

    def constraint(self, request: ChatCompletionRequest) -> OutputConstraint | None:
        """Structured outputs, or the grammar of a forced tool call (never both); with
        `tool_choice: "auto"` and no structured outputs, the grammar of optional calls."""
        found = request_constraint(request)
        forced = self._forced_call(request)
        if forced is None:
            if found:
                return found[1]
            optional = self._optional_calls(request)
            return check("tools", optional) if optional is not None else None
        if found:
            raise bad_request(f"`tool_choice` forces a tool call, so `{found[0]}` cannot also "
                              "constrain the output.", param=found[0])
        return check("tools", forced)

    def _forced_call(self, request: ChatCompletionRequest) -> OutputConstraint | None:
        choice = request.effective_tool_choice
        if choice in ("none", "auto"):
            return None
        functions = [(t.function.name, t.function.parameters) for t in request.tools]
        if choice != "required":
            functions = [f for f in functions if f[0] == choice.function.name]
            if not functions:
                raise bad_request(f"`tool_choice` names the function `{choice.function.name}`, "
                                  "which is not in `tools`.", param="tool_choice")
        parallel = request.parallel_tool_calls and choice == "required"
        return tool_call_constraint(functions, self.tool_format, parallel)

    def _optional_calls(self, request: ChatCompletionRequest) -> OutputConstraint | None:
        """`auto`: text, or calls that follow the tools' schemas (None: the format has no call
        marker to wait for; `min_tokens` / `ignore_eos` ask for an answer no grammar ends)."""
        if (request.effective_tool_choice != "auto" or not request.tools or request.min_tokens
                or request.ignore_eos):
            return None
        functions = [(t.function.name, t.function.parameters) for t in request.tools]
        return auto_tool_constraint(functions, self.tool_format, request.parallel_tool_calls)

    def _options(self, request: ChatCompletionRequest, prompt: list[int]) -> ChatOutputOptions:
        tools_on = bool(request.tools) and request.effective_tool_choice != "none"
        opened = self.reasoning and prompt_opens_reasoning(
            self.processor.decode(prompt[-4:], skip_special_tokens=False))
        return ChatOutputOptions(self.tool_format if tools_on else None, self.reasoning, opened,
                                 max_tool_calls=None if request.parallel_tool_calls else 1)

    async def _respond(self, request: ChatCompletionRequest, choices: list[ChoiceStream],
                       prompts: list[list[int]], response_id: str, created: int,
                       tracker: RequestTracker, model: str) -> ChatCompletionResponse:
        usage = UsageTally(request.n)
        options = self._options(request, prompts[0])
        out = []
        for index, deltas in enumerate(await self.collect(choices, tracker)):
            final = deltas[-1]
            usage.add(index, final.usage, final.numerics)
            logprobs = self._logprobs(deltas) if request.logprobs else None
            output = ChatOutput(options)
            first, last = output.feed("".join(d.text for d in deltas)), output.finish()
            reasoning = first.reasoning + last.reasoning
            calls = output.tool_calls
            message = ChatMessageOut(
                content=(first.content + last.content) or (None if calls else ""),
                reasoning_content=reasoning if output.saw_reasoning else None, tool_calls=calls)
            reason = "tool_calls" if calls and final.finish_reason == "stop" else final.finish_reason
            prompt_logprobs = None
            if request.prompt_logprobs is not None:
                prompt_logprobs = vllm_prompt_logprobs(self.processor, prompt_logprobs_of(deltas),
                                                       prompts[0])
            out.append(ChatChoice(index=index, message=message, logprobs=logprobs,
                                  finish_reason=reason, stop_reason=final.stop_reason,
                                  prompt_logprobs=prompt_logprobs))
        info = usage.info()
        reasons = [c.finish_reason for c in out]
        tracker.finish(outcome_of(reasons), info.prompt_tokens, info.completion_tokens, reasons)
        return ChatCompletionResponse(id=response_id, created=created, model=model,
                                      choices=out, usage=info,
                                      system_fingerprint=usage.system_fingerprint())

    async def _stream(self, request: ChatCompletionRequest, choices: list[ChoiceStream],
                      prompts: list[list[int]], response_id: str, created: int,
                      tracker: RequestTracker, model: str) -> AsyncIterator[bytes]:
        running = running_usage(request, prompts)
        frames = ChatChunkEncoder(response_id, created, model,
                       running.info if running else None)
        usage = UsageTally(request.n)
        options = self._options(request, prompts[0])
        outputs = [ChatOutput(options) for _ in choices]
        finish_reasons: list[str | None] = []
        try:
            for index in range(len(choices)):
                yield frames.role(index)
            async for index, delta in merge_choices([aiter(c) for c in choices]):
                if delta.token_ids:
                    tracker.on_tokens(len(delta.token_ids))
                    if running is not None:
                        running.add(len(delta.token_ids))
                logprobs = self._logprobs([delta]) if request.logprobs and delta.logprobs else None
                piece = outputs[index].feed(delta.text)
                if delta.finish_reason is not None:
                    last = outputs[index].finish()
                    piece.reasoning += last.reasoning
                    piece.content += last.content
                    piece.tool_calls += last.tool_calls
                for frame in frames.pieces(index, piece, logprobs):
                    yield frame
                if delta.finish_reason is not None:
                    reason = delta.finish_reason
                    if outputs[index].tool_calls and reason == "stop":
                        reason = "tool_calls"
                    usage.add(index, delta.usage, delta.numerics)
                    finish_reasons.append(reason)
                    yield frames.finish(index, reason, delta.stop_reason, delta.numerics)
            info = usage.info()
            if request.include_usage:
                yield frames.usage(info, usage.system_fingerprint())
            tracker.finish(outcome_of(finish_reasons), info.prompt_tokens, info.completion_tokens,
                           finish_reasons)
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
