"""Typed messages that cross process boundaries (gateway <-> Redis <-> worker), packed with msgpack."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import msgpack

from kvfleet.shared.wire.constraint import OutputConstraint


@dataclass
class SamplingParams:
    """How to turn logits into tokens. Sampling is a pure function of (seed, position, logits)."""

    max_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None  # the gateway fills one in, so a resumed request samples the same stream
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: int | None = None  # None = off; N = also return the top-N alternatives
    # Log-probabilities of the prompt's tokens (from the prefill's logits): None = off; N = also
    # the top-N alternatives at each position. Such a request neither reads nor fills the prefix
    # cache (every prompt position must be computed by this request).
    prompt_logprobs: int | None = None
    skip_prefix_cache: bool = False
    # Output tokens must follow this grammar (structured outputs, constrained tool calls).
    constraint: OutputConstraint | None = None
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    # Output text (in the record so a re-attached stream reads the same):
    include_stop_str_in_output: bool = False  # keep the stop string / stop token's text
    # special tokens' text left out of the output (the text the worker matches stop strings on)
    skip_special_tokens: bool = True
    # Speculative decoding for this request: None = the worker's setting; 0 = off; N = at most N
    # proposed tokens per step (capped by the worker's). The answer is the same either way.
    num_speculative_tokens: int | None = None
    # The pace this request asks for (ms, p99; None: the worker's --target-itl-ms/--target-ttft-ms;
    # 0: none). The worker serves a tighter ITL target at its --min-target-itl-ms at most.
    target_itl_ms: float | None = None
    target_ttft_ms: float | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_prefix_cache(self) -> bool:
        return not self.skip_prefix_cache and self.prompt_logprobs is None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SamplingParams:
        names = {f.name for f in dataclasses.fields(cls)}
        fields = {k: v for k, v in data.items() if k in names}
        fields["constraint"] = OutputConstraint.from_dict(fields.get("constraint"))
        fields["logit_bias"] = {int(k): float(v) for k, v in (fields.get("logit_bias") or {}).items()}
        return cls(**fields)


@dataclass
class GenerationRequest:
    """One request as the gateway enqueues it: token ids only, never HTTP objects."""

    req_id: str
    model: str
    prompt_token_ids: list[int]
    params: SamplingParams
    deadline: float | None = None  # unix time after which nobody waits for the answer
    priority: str = "interactive"
    created: float = 0.0
    # The pub/sub channel the token events go to: the enqueuing gateway's inbox (Keys.inbox),
    # where a worker's step sends one message with the events of all its requests from that
    # gateway; '' = the request's own channel (Keys.tokens), one message per event.
    reply_to: str = ""
    # A LoRA adapter of `model` ('' = the base model): its registered name and directory, as the
    # gateway resolved them at enqueue (shared/lora.py); a worker loads it from `lora_path` on
    # first use, so a resumed request is served by the same adapter.
    lora: str = ""
    lora_path: str = ""
    # The W3C trace context of the gateway's request span (shared/tracing.py; '' = none: tracing
    # off, or an older gateway): a worker opens its spans of this request under it.
    traceparent: str = ""

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["params"] = self.params.to_dict()
        if not data["traceparent"]:
            del data["traceparent"]  # tracing off: the record as before
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GenerationRequest:
        data = dict(data)
        data["params"] = SamplingParams.from_dict(data["params"])
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})

    def pack(self) -> bytes:
        return pack(self.to_dict())

    @classmethod
    def unpack(cls, raw: bytes) -> GenerationRequest:
        return cls.from_dict(unpack(raw))


@dataclass
class TokenLogprob:
    """Log-probability of one generated (or prompt) token and of the top alternatives at its
    position; `rank` (1 = the most likely token) is set for prompt tokens only."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)
    rank: int | None = None

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TokenLogprob:
        return cls(data["token_id"], data["logprob"], [tuple(t) for t in data["top"]],
                   data.get("rank"))


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0


@dataclass
class TokenEvent:
    """One request's new tokens, published on its reply channel (an inbox, or `tok:{id}`). `seq`
    is the index of the first token of `token_ids` in the output. `prompt_logprobs` (requests
    with `SamplingParams.prompt_logprobs`) comes once, in the event with the first output token
    (or the final one, with `max_tokens` 0): entry i is prompt token i + 1's (the first prompt
    token has none). A pub/sub message is one or more packed events back to back
    (`unpack_many`); `req_id` says whose each is.

    Where an answer stops is the worker's decision alone (it made the tokens); the gateway
    renders it. The final event of a request that stopped (`finish_reason` "stop") says what
    stopped it and where its text ends:

    - `stop_reason`: the stop string that matched, or the stop token id that was sampled; None
      for an EOS token (as vLLM's `choice.stop_reason`).
    - `text_after_stop`: how many characters of the output text follow the end of the matched
      stop string (0 for a stop token: its own text is the renderer's to drop or keep). The text
      is the output decoded as the request asks (`skip_special_tokens`). Counted back from the
      end of the text because the end is what every renderer decodes alike: where the rendered
      text starts depends on the detokeniser's context (the prompt's last tokens, or a resumed
      stream's `after`), and which tokens the final event carries depends on coalescing and on
      a gap filled from the checkpoint. The renderer keeps the text up to the end of the stop
      string (`include_stop_str_in_output`) or up to its start.

    The final event also carries `numerics`: the fingerprints (worker/engine/model/numerics.py) of the
    workers that computed the output, in order, joined by "+".

    Compatibility (a worker older than these fields, during a rolling upgrade): a final "stop"
    event without `text_after_stop` is cut at the first occurrence of a stop string in the text
    not yet sent."""

    seq: int
    attempt: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None  # stop | length | abort | error
    usage: Usage | None = None
    error: str | None = None
    prompt_logprobs: list[TokenLogprob] | None = None
    req_id: str = ""
    stop_reason: int | str | None = None  # final "stop" events: see above
    text_after_stop: int | None = None  # set on every final "stop" event: see above
    # final events: the numerics fingerprints of the workers whose tokens make the output, in
    # order, joined by "+" (one: computed on one numerics; several: resumed on other numerics,
    # so the text may differ from an uninterrupted run's; docs/RELIABILITY.md)
    numerics: str | None = None

    @property
    def is_final(self) -> bool:
        return self.finish_reason is not None or self.error is not None

    def pack(self, req_id: str | None = None) -> bytes:
        """The event's msgpack map (`req_id` given: under that request's id)."""
        data = dataclasses.asdict(self)
        if req_id is not None:
            data["req_id"] = req_id
        return pack({k: v for k, v in data.items() if v is not None})

    @classmethod
    def unpack(cls, raw: bytes) -> TokenEvent:
        return cls.from_dict(unpack(raw))

    @classmethod
    def unpack_many(cls, raw: bytes) -> list[TokenEvent]:
        """The events of one pub/sub message: packed events back to back (a step's events for
        one inbox), or a single one."""
        return [cls.from_dict(data) for data in unpack_stream(raw)]

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TokenEvent:
        """The event of a decoded map; fields it does not know (a newer writer's) are left out."""
        data = {k: v for k, v in data.items() if k in _TOKEN_EVENT_FIELDS}
        for name in ("logprobs", "prompt_logprobs"):
            if data.get(name) is not None:
                data[name] = [TokenLogprob.from_dict(lp) for lp in data[name]]
        if data.get("usage") is not None:
            data["usage"] = Usage(**data["usage"])
        return cls(**data)


_TOKEN_EVENT_FIELDS = frozenset(f.name for f in dataclasses.fields(TokenEvent))


def unpack_stream(raw: bytes):
    """The msgpack values packed back to back in `raw`, one at a time (a truncated or malformed
    value raises where it starts: the ones before it were yielded)."""
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=False)
    unpacker.feed(raw)
    yield from unpacker


def pack(data: Any) -> bytes:
    return msgpack.packb(data, use_bin_type=True)


def unpack(raw: bytes) -> Any:
    return msgpack.unpackb(raw, raw=False, strict_map_key=False)
