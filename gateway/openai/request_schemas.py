"""Request schemas of the OpenAI-compatible API. They validate themselves (a bad value is a 400 that
names the parameter) and convert themselves to engine types (`to_sampling_params`).

Fields OpenAI defines but kvfleet does not implement are refused by name, and fields nobody
defines are ignored with a warning (gateway/openai/fields.py): both land in `model_extra`."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel, ConfigDict, Field, StrictBool, field_validator, model_validator)

from kvfleet.gateway.openai.request_schemas_tools import (
    ResponseFormat, StructuredOutputs, ToolCallIn, ToolChoice, ToolDefinition)
from kvfleet.shared.wire import OutputConstraint, SamplingParams

MAX_LOGPROBS = 20
MAX_CHOICES = 128
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
LOGIT_BIAS_LIMIT = 100.0  # OpenAI's range for a bias value
MAX_SPECULATIVE_TOKENS = 32  # SpeculativeConfig.num_speculative_tokens's limit
MAX_TARGET_MS = 600_000.0  # a pace target beyond ten minutes is a typo, not a promise

TokenIds = list[Annotated[int, Field(ge=0)]]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: with include_usage, usage in every chunk


class SamplingRequest(BaseModel):
    """Fields the completion and chat APIs share."""

    model_config = ConfigDict(extra="allow", protected_namespaces=())

    model: str
    max_tokens: int | None = Field(None, ge=0)  # None: the rest of the context
    temperature: float | None = Field(None, ge=0.0, le=2.0)  # None: the server's default
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, Annotated[float, Field(ge=-LOGIT_BIAS_LIMIT, le=LOGIT_BIAS_LIMIT)]] | None = None
    user: str | None = None  # logged with the request id
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    # Extras beyond OpenAI's API (as vLLM names them).
    top_k: int = Field(0, ge=-1)  # 0 or -1: off
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0)
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: TokenIds | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # vLLM's integer priority (lower = sooner): <= 0 goes to the interactive queue, > 0 to the
    # batch queue; the names are accepted too.
    priority: int | Literal["interactive", "batch"] = 0
    skip_prefix_cache: bool = False
    # speculative decoding for this request: unset = the worker's setting, 0 = off, N = at most
    # N proposed tokens a step (the worker's --speculative-config caps it); the answer is the same
    num_speculative_tokens: int | None = Field(None, ge=0, le=MAX_SPECULATIVE_TOKENS)
    # the pace this request asks for (ms, p99): unset = the worker's --target-itl-ms /
    # --target-ttft-ms, 0 = none; the worker serves an ITL target tighter than its
    # --min-target-itl-ms at that floor
    target_itl_ms: float | None = Field(None, ge=0, le=MAX_TARGET_MS)
    target_ttft_ms: float | None = Field(None, ge=0, le=MAX_TARGET_MS)
    # vLLM: the prompt tokens' logprobs and top-N alternatives, in the response's choices
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # Structured outputs as vLLM takes them (at most one, and not beside `response_format`).
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputs | None = None

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, value: str | list[str] | None) -> list[str]:
        stops = [value] if isinstance(value, str) else list(value or [])
        return [s for s in stops if s]  # an empty stop string would end every output at once

    @field_validator("logit_bias")
    @classmethod
    def _bias_keys(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key in value or {}:
            if not key.strip().isdigit():
                raise ValueError(f"keys must be token ids, got {key!r}")
        return value

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

    @property
    def continuous_usage(self) -> bool:
        """vLLM: every chunk carries the usage so far (with `include_usage` only, as vLLM)."""
        return self.include_usage and self.stream_options.continuous_usage_stats

    @property
    def queue_priority(self) -> str:
        if isinstance(self.priority, str):
            return self.priority
        return "interactive" if self.priority <= 0 else "batch"

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def num_candidates(self) -> int:
        """Samples generated per prompt (`best_of` may ask for more than the `n` returned)."""
        return self.n

    def logprobs_count(self) -> int | None:
        """None = no logprobs; N = the sampled token's logprob plus the top-N alternatives."""
        return None

    def prompt_logprobs_count(self) -> int | None:
        """None = no prompt logprobs; N = each prompt token's logprob and the top-N."""
        return self.prompt_logprobs

    @model_validator(mode="after")
    def _prompt_logprobs_not_streamed(self) -> SamplingRequest:
        if self.prompt_logprobs is not None and self.stream:
            raise ValueError("`prompt_logprobs` is not available in streams (with completions, "
                             "`echo` and `logprobs` stream the prompt's logprobs)")
        return self

    def token_bias(self) -> dict[int, float]:
        return {int(k): float(v) for k, v in (self.logit_bias or {}).items()}

    def to_sampling_params(self, max_tokens: int, seed: int, default_temperature: float = 1.0,
                           constraint: OutputConstraint | None = None) -> SamplingParams:
        """Engine parameters for one choice (each choice gets its own seed)."""
        temperature = self.temperature if self.temperature is not None else default_temperature
        return SamplingParams(
            max_tokens=max_tokens, temperature=temperature, top_p=self.top_p,
            top_k=max(self.top_k, 0), min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            seed=seed, stop=list(self.stop or []), stop_token_ids=list(self.stop_token_ids or []),
            min_tokens=self.min_tokens, ignore_eos=self.ignore_eos,
            logprobs=self.logprobs_count(), prompt_logprobs=self.prompt_logprobs_count(),
            skip_prefix_cache=self.skip_prefix_cache,
            constraint=constraint, logit_bias=self.token_bias(),
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            num_speculative_tokens=self.num_speculative_tokens,
            target_itl_ms=self.target_itl_ms, target_ttft_ms=self.target_ttft_ms)


class CompletionRequest(SamplingRequest):
    """POST /v1/completions."""

    prompt: str | list[str] | TokenIds | list[TokenIds]
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    suffix: str | None = None
    response_format: ResponseFormat | None = None  # vLLM accepts it on completions too
    # candidates per prompt; the n with the highest cumulative logprob are returned
    best_of: int | None = Field(None, ge=1, le=MAX_CHOICES)

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
            raise ValueError("`suffix` is not supported (no fill-in-the-middle template)")
        if self.best_of is not None and self.best_of < self.n:
            raise ValueError(f"`best_of` ({self.best_of}) must be at least `n` ({self.n})")
        if self.stream and self.num_candidates() > self.n:
            raise ValueError("`best_of` greater than `n` cannot be streamed (the best are "
                             "known only at the end)")
        return self

    def num_candidates(self) -> int:
        return self.best_of or self.n

    @property
    def ranks_candidates(self) -> bool:
        return self.num_candidates() > self.n

    @property
    def echo_logprobs(self) -> bool:
        """`echo` with `logprobs`: the prompt's tokens come first in `logprobs` (OpenAI)."""
        return self.echo and self.logprobs is not None

    def logprobs_count(self) -> int | None:
        if self.logprobs is None and self.ranks_candidates:
            return 0  # the sampled tokens' logprobs rank the candidates
        return self.logprobs

    def prompt_logprobs_count(self) -> int | None:
        counts = [c for c in (self.prompt_logprobs, self.logprobs if self.echo else None)
                  if c is not None]
        return max(counts) if counts else None


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["text"]  # text-only models: image or audio parts are a 400
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # assistant: the calls it made
    tool_call_id: str | None = None  # tool: which call this result answers
    reasoning_content: str | None = None  # assistant: earlier reasoning (vLLM's extra)

    @model_validator(mode="after")
    def _content_required(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a `{self.role}` message needs `content`"
                             + (" (or `tool_calls`)" if self.role == "assistant" else ""))
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a `tool` message needs `tool_call_id`")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only `assistant` messages carry `tool_calls`")
        return self

    def text(self) -> str:
        """The content as one string; text parts are joined with newlines, as OpenAI does."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "\n".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingRequest):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage]
    max_completion_tokens: int | None = Field(None, ge=1)
    max_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    response_format: ResponseFormat | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoice | None = None  # default: "auto" with tools, "none" without
    parallel_tool_calls: bool = True
    # The chat template: extra variables (e.g. enable_thinking), the prompt's last message left
    # open for the model to continue, and the assistant header at the end.
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    reasoning_effort: Literal["minimal", "low", "medium", "high"] | None = None  # to the template
    # OpenAI fields with a defined meaning here.
    modalities: list[Literal["text"]] | None = None  # text only
    store: Literal[False] | None = None  # nothing is stored
    metadata: dict[str, str] | None = None  # logged with the request id
    service_tier: Literal["auto", "default"] | None = None
    safety_identifier: str | None = None  # logged with the request id

    @model_validator(mode="after")
    def _check(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("`top_logprobs` needs `logprobs` set to true")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("`continue_final_message` needs `add_generation_prompt` false")
        if self.continue_final_message and (not self.messages
                                            or self.messages[-1].role != "assistant"):
            raise ValueError("`continue_final_message` needs an assistant message last")
        if isinstance(self.tool_choice, BaseModel) or self.tool_choice == "required":
            if not self.tools:
                raise ValueError("`tool_choice` needs `tools`")
        return self

    @property
    def effective_tool_choice(self) -> str | Any:
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools else "none"

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def logprobs_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None
