"""Request schemas of the OpenAI-compatible API. They validate themselves (a bad value is a 400 that
names the parameter) and convert themselves to engine types (`to_sampling_params`)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from shared.wire import SamplingParams

MAX_LOGPROBS = 20
MAX_CHOICES = 128
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

TokenIds = list[Annotated[int, Field(ge=0)]]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False


class SamplingRequest(BaseModel):
    """Fields the completion and chat APIs share; unknown fields are ignored."""

    model_config = ConfigDict(extra="ignore", protected_namespaces=())

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)  # None: the server's default
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # Extras beyond OpenAI's API (as vLLM names them).
    top_k: int = Field(0, ge=-1)  # 0 or -1: off
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0)
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: TokenIds | None = None
    priority: Literal["interactive", "batch"] = "interactive"
    skip_prefix_cache: bool = False

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, value: str | list[str] | None) -> list[str]:
        stops = [value] if isinstance(value, str) else list(value or [])
        return [s for s in stops if s]  # an empty stop string would end every output at once

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data):
        """OpenAI clients send `null` for "use the default"."""
        if isinstance(data, dict):
            return {key: value for key, value in data.items() if value is not None}
        return data

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def logprobs_count(self) -> int | None:
        """None = no logprobs; N = the sampled token's logprob plus the top-N alternatives."""
        return None

    def to_sampling_params(self, max_tokens: int, seed: int,
                           default_temperature: float = 1.0) -> SamplingParams:
        """Engine parameters for one choice (each choice gets its own seed)."""
        temperature = self.temperature if self.temperature is not None else default_temperature
        return SamplingParams(
            max_tokens=max_tokens, temperature=temperature, top_p=self.top_p,
            top_k=max(self.top_k, 0), min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            seed=seed, stop=list(self.stop or []), stop_token_ids=list(self.stop_token_ids or []),
            min_tokens=self.min_tokens, ignore_eos=self.ignore_eos,
            logprobs=self.logprobs_count(), skip_prefix_cache=self.skip_prefix_cache)


class CompletionRequest(SamplingRequest):
    """POST /v1/completions."""

    prompt: str | list[str] | TokenIds | list[TokenIds]
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    suffix: str | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, value):
        """One clear message instead of one error per member of the union."""
        def is_ids(item) -> bool:
            return isinstance(item, list) and all(
                isinstance(t, int) and not isinstance(t, bool) for t in item)
        if isinstance(value, str) or is_ids(value):
            return value
        if isinstance(value, list) and (all(isinstance(p, str) for p in value)
                                        or all(is_ids(p) for p in value)):
            return value
        raise ValueError("expected a string, a list of strings, a list of token ids, or a list "
                         "of lists of token ids")

    @model_validator(mode="after")
    def _check_supported(self) -> CompletionRequest:
        if self.suffix:
            raise ValueError("`suffix` is not supported")
        if self.echo and self.logprobs is not None:
            raise ValueError("`echo` together with `logprobs` is not supported "
                             "(the workers return no prompt logprobs)")
        return self

    def logprobs_count(self) -> int | None:
        return self.logprobs


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["text"]  # text-only models: image or audio parts are a 400
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(part.text for part in self.content)

    def to_template_dict(self) -> dict[str, str]:
        message = {"role": self.role, "content": self.text()}
        if self.name:
            message["name"] = self.name
        return message


class ChatCompletionRequest(SamplingRequest):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage]
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _check_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("`top_logprobs` needs `logprobs` set to true")
        return self

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def logprobs_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None
