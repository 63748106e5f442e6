"""vLLM's utility routes: POST /tokenize and /detokenize (the named model's tokenizer and chat
template as the gateway holds them, an adapter's being its base model's, so a client can count
tokens exactly as a request would) and GET /version."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field, model_validator

from kvfleet.gateway.http.errors import bad_request
from kvfleet.gateway.openai.request_schemas import ChatCompletionRequest, ChatMessage, TokenIds
from kvfleet.gateway.openai.request_schemas_tools import ToolDefinition

utility_router = APIRouter()


class TokenizeRequest(BaseModel):
    """Either `prompt` (completions) or `messages` (chat, through the template)."""

    model_config = ConfigDict(extra="ignore", protected_namespaces=())

    model: str
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[ToolDefinition] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of `prompt` and `messages`")
        return self


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", protected_namespaces=())

    model: str
    tokens: TokenIds = Field(max_length=1_000_000)


@utility_router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request) -> TokenizeResponse:
    serving, _target = await request.app.state.models.resolve(body.model)
    chat, processor = serving.chat, serving.processor
    if body.messages is not None:
        chat_request = ChatCompletionRequest.model_validate({
            "model": body.model, "messages": [m.model_dump(exclude_none=True)
                                              for m in body.messages],
            "tools": [t.model_dump(exclude_none=True) for t in body.tools or []] or None,
            "add_generation_prompt": body.add_generation_prompt,
            "continue_final_message": body.continue_final_message,
            "chat_template_kwargs": body.chat_template_kwargs})
        [ids] = await chat.prompts(chat_request)
    else:
        ids = list(processor.tokenizer.encode(body.prompt,
                                              add_special_tokens=body.add_special_tokens))
    strs = processor.tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
    return TokenizeResponse(count=len(ids), max_model_len=processor.model.context_length,
                            tokens=ids, token_strs=strs)


@utility_router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> dict[str, str]:
    serving, _target = await request.app.state.models.resolve(body.model)
    vocab = serving.info.vocab_size
    bad = next((t for t in body.tokens if t >= vocab), None)
    if bad is not None:
        raise bad_request(f"Token id {bad} is out of range: the model's vocabulary has {vocab} "
                          "tokens.", param="tokens")
    return {"prompt": serving.processor.decode(body.tokens)}


@utility_router.get("/version")
async def server_version() -> dict[str, str]:
    try:
        return {"version": version("kvfleet")}
    except PackageNotFoundError:  # running from a source tree that was never installed
        return {"version": "unknown"}
