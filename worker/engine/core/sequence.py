"""One request inside the engine: its tokens, how far its KV is computed, and its status."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvfleet.shared.wire import RequestStatus, SamplingParams, TokenLogprob
from kvfleet.worker.engine.core.lora_request import LoraRequest


@dataclass(eq=False)
class Sequence:
    """Mutable per-request state. Only the scheduler changes `status` and `num_computed_tokens`.

    Invariants: `token_ids == prompt_token_ids + output_token_ids`;
    `0 <= num_computed_tokens <= num_tokens`; the KV of positions `[0, num_computed_tokens)` is in
    the blocks the block manager holds for `req_id` (none while QUEUED or PREEMPTED), or, for a
    sequence swapped out, in its `num_swapped_blocks` host copies.
    """

    req_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    output_token_ids: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)  # prompt + output, kept in step
    status: RequestStatus = RequestStatus.QUEUED
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first admission
    admitted_once: bool = False
    num_swapped_blocks: int = 0  # > 0 while PREEMPTED with its KV in host memory
    output_logprobs: list[TokenLogprob] = field(default_factory=list)
    # params.prompt_logprobs: entry p is prompt token p + 1's, filled as prefill chunks run
    # (a recomputed chunk does not add them again); sent once, with the first output.
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs_sent: bool = False
    error: str | None = None
    lora: LoraRequest | None = None  # the adapter it runs under; None: the base model
    arrival: float | None = None  # unix time it was enqueued (its first token's time is measured)
    last_emit_at: float | None = None  # monotonic time of its last tokens here (the pace's ITL)

    def __post_init__(self) -> None:
        self.prompt_token_ids = list(self.prompt_token_ids)
        self.output_token_ids = list(self.output_token_ids)
        self.token_ids = self.prompt_token_ids + self.output_token_ids

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Prompt logprobs still to compute: asked for, and not resumed past the first output
        (the client got them with it)."""
        return (self.params.prompt_logprobs is not None and not self.prompt_logprobs_sent
                and len(self.prompt_logprobs) < self.num_prompt_tokens - 1)

    @property
    def prefix_root(self) -> bytes | None:
        """Parent of its first block hash: its adapter's root (None: the engine's own)."""
        return None if self.lora is None else self.lora.prefix_root

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_token(self, token_id: int, logprob: TokenLogprob | None) -> None:
        self.output_token_ids.append(token_id)
        self.token_ids.append(token_id)
        if logprob is not None:
            self.output_logprobs.append(logprob)
