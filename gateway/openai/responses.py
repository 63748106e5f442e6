"""Response shapes of the OpenAI-compatible API (full responses and streamed chunks)."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, Field, model_serializer


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> UsageInfo:
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens,
                   prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens))


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "kvfleet"
    root: str | None = None  # vLLM's: where a model loads from, an adapter's directory
    parent: str | None = None  # vLLM's: an adapter's base model
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# --- /v1/completions ---------------------------------------------------------------------------

class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """vLLM's `Logprob`: one candidate at a prompt position."""

    logprob: float
    rank: int | None = None  # 1 = the most likely token
    decoded_token: str


# vLLM's `prompt_logprobs`: per prompt token, None for the first, else token id -> candidate
# (the prompt's own token and the top-N alternatives).
PromptLogprobs = list[dict[int, PromptLogprob] | None]


def _omit_none_prompt_logprobs(data: dict) -> dict:
    """`prompt_logprobs` only when asked for (so stream chunks keep OpenAI's shape)."""
    if data.get("prompt_logprobs") is None:
        data.pop("prompt_logprobs", None)
    return data


def _stop_reason_with_finish(data: dict) -> dict:
    """`stop_reason` (vLLM's: the stop string or stop token id that ended the choice, null for
    EOS or a length limit) only beside a `finish_reason`: a stream's chunks before the last do
    not carry it."""
    if data.get("finish_reason") is None:
        data.pop("stop_reason", None)
    return data


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs | None = None

    @model_serializer(mode="wrap")
    def _omit_unused(self, handler):
        return _stop_reason_with_finish(_omit_none_prompt_logprobs(handler(self)))


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


# --- /v1/chat/completions ----------------------------------------------------------------------

class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(BaseModel):
    content: list[ChatLogprob] | None = None


class FunctionCallOut(BaseModel):
    name: str
    arguments: str


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallOut] = Field(default_factory=list)

    @model_serializer(mode="wrap")
    def _omit_unused(self, handler):
        """As OpenAI: no `tool_calls` key without calls; no `reasoning_content` without it."""
        data = handler(self)
        if not data.get("tool_calls"):
            data.pop("tool_calls", None)
        if data.get("reasoning_content") is None:
            data.pop("reasoning_content", None)
        return data


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs | None = None

    @model_serializer(mode="wrap")
    def _omit_unused(self, handler):
        return _omit_none_prompt_logprobs(handler(self))


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


class FunctionCallDelta(BaseModel):
    name: str | None = None
    arguments: str | None = None


class ToolCallDeltaOut(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDeltaOut] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    @model_serializer(mode="wrap")
    def _omit_unused(self, handler):
        return _stop_reason_with_finish(handler(self))


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


def chunk_json(chunk: BaseModel) -> str:
    """A chunk as JSON; a delta leaves out the fields it does not set (OpenAI's shape)."""
    data: dict[str, Any] = chunk.model_dump()
    for choice in data.get("choices", []):
        if "delta" in choice:
            choice["delta"] = {k: v for k, v in choice["delta"].items() if v is not None}
    return json.dumps(data, ensure_ascii=False, separators=(",", ":"))


# --- GET /v1/requests/{id}/stream (re-attach) --------------------------------------------------

class ResumedChoice(CompletionChoice):
    """A completions chunk choice that also says which output tokens it carries: `token_ids` are
    output tokens `token_index .. token_index + len(token_ids) - 1`. A client that lost the
    stream re-attaches with `after = token_index + len(token_ids)` of the last chunk it got."""

    token_index: int
    token_ids: list[int] = Field(default_factory=list)


class ResumedChunk(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[ResumedChoice]
