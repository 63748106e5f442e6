"""Keep or recompute: how a preempted stream gives back its KV blocks (`--preemption`).

- recompute: its blocks are freed; when readmitted, prompt and generated tokens are prefilled
  again (cheap when the context is short or shared with live streams through the prefix cache).
- swap: its blocks are copied to host memory first, then freed; when there is room again they are
  copied back into fresh blocks and decoding resumes where it stopped (cheap when the context is
  long and the host link is fast).
- auto: per preemption, whichever the cost model expects to take less time, with measured rates:
  swapping costs 2 x bytes / copy bandwidth (out now, back in later); recomputing costs the tokens
  to compute again x seconds per prefill token. Swap needs room in the host swap space; without it
  auto (and swap) fall back to recompute.

Pure bookkeeping and arithmetic: no torch. The engine copies the bytes and reports the timings.
"""

from __future__ import annotations

from dataclasses import dataclass, field

PREEMPTION_MODES = ("auto", "swap", "recompute")
SWAP = "swap"
RECOMPUTE = "recompute"


@dataclass
class SwapSpace:
    """Host memory for swapped-out blocks, counted in blocks."""

    capacity_blocks: int
    _held: dict[str, int] = field(default_factory=dict)

    @property
    def num_used_blocks(self) -> int:
        return sum(self._held.values())

    def can_hold(self, num_blocks: int) -> bool:
        return self.num_used_blocks + num_blocks <= self.capacity_blocks

    def reserve(self, req_id: str, num_blocks: int) -> None:
        if req_id in self._held:
            raise ValueError(f"{req_id} is already swapped out")
        if not self.can_hold(num_blocks):
            raise ValueError(f"swap space full: {num_blocks} blocks requested")
        self._held[req_id] = num_blocks

    def release(self, req_id: str) -> int:
        return self._held.pop(req_id, 0)


class Ema:
    """Exponential moving average; `value` is the prior until the first observation."""

    def __init__(self, prior: float, weight: float = 0.2):
        self.value = prior
        self.weight = weight
        self.num_observations = 0

    def observe(self, sample: float) -> None:
        self.value = sample if self.num_observations == 0 else (
            self.weight * sample + (1 - self.weight) * self.value)
        self.num_observations += 1


class PreemptionCostModel:
    """Seconds to swap vs to recompute one stream, from rates measured while serving.

    The recompute rate is seconds per token of steps that are mostly prefill (overhead included,
    which is what recomputing pays too); the swap rate is the bytes per second of the engine's own
    swap copies, primed by a calibration copy at start-up.
    """

    def __init__(self, mode: str, block_bytes: int, swap_bytes_per_s: float,
                 prefill_s_per_token: float):
        if mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption must be one of {', '.join(PREEMPTION_MODES)}; got {mode!r}")
        self.mode = mode
        self.block_bytes = block_bytes
        self.swap_bytes_per_s = Ema(swap_bytes_per_s)
        self.prefill_s_per_token = Ema(prefill_s_per_token)

    def swap_seconds(self, num_blocks: int) -> float:
        """Out now and back in later."""
        return 2 * num_blocks * self.block_bytes / self.swap_bytes_per_s.value

    def recompute_seconds(self, num_tokens: int) -> float:
        return num_tokens * self.prefill_s_per_token.value

    def choose(self, num_blocks: int, num_tokens_to_recompute: int, swap_has_room: bool) -> str:
        """SWAP or RECOMPUTE for a stream holding `num_blocks` whose KV would cost
        `num_tokens_to_recompute` tokens of prefill to rebuild."""
        if not swap_has_room or self.mode == RECOMPUTE:
            return RECOMPUTE
        if self.mode == SWAP:
            return SWAP
        if self.swap_seconds(num_blocks) < self.recompute_seconds(num_tokens_to_recompute):
            return SWAP
        return RECOMPUTE

    def observe_swap(self, num_bytes: int, seconds: float) -> None:
        if num_bytes > 0 and seconds > 0:
            self.swap_bytes_per_s.observe(num_bytes / seconds)

    def observe_step(self, num_prefill_tokens: int, num_batched_tokens: int, seconds: float) -> None:
        """A step's wall time; counted when it is mostly prefill (decodes cost per step, not
        per token, and would skew the rate)."""
        if num_prefill_tokens >= 16 and 2 * num_prefill_tokens >= num_batched_tokens and seconds > 0:
            self.prefill_s_per_token.observe(seconds / num_batched_tokens)
