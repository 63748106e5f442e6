"""Applies the constrained rows' token bitmasks to a batch of logits, on the logits' device.

Unconstrained rows are untouched, so constrained and free requests share one batch and one
sampler call; the only per-step cost is one bitmask row per constrained request (computed on
CPU by llguidance, small beside a step) and one masked fill on the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvfleet.worker.structured.matcher import RequestMatcher

_BITS = 32


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + _BITS - 1) // _BITS


@dataclass
class LogitMask:
    """Rows `rows` of the batch may only take the tokens whose bits are set in `bitmask`."""

    rows: list[int]
    bitmask: torch.Tensor  # int32 [len(rows), ceil(vocab / 32)], CPU

    @classmethod
    def of(cls, matchers: dict[int, RequestMatcher], vocab_size: int) -> LogitMask | None:
        """The masks of the batch rows that have a matcher (row -> matcher); None if none do."""
        if not matchers:
            return None
        rows = sorted(matchers)
        bitmask = torch.empty(len(rows), bitmask_words(vocab_size), dtype=torch.int32)
        for i, row in enumerate(rows):
            matchers[row].fill_bitmask(bitmask, i)
        return cls(rows, bitmask)

    @classmethod
    def ahead(cls, matchers: dict[int, tuple[RequestMatcher, list[int]]],
              vocab_size: int) -> LogitMask | None:
        """Masks of rows that verify proposals: first row -> (its matcher, the proposals);
        rows first .. first + len(proposals) get the masks after each prefix of them."""
        if not matchers:
            return None
        rows = [first + j for first in sorted(matchers) for j in range(len(matchers[first][1]) + 1)]
        bitmask = torch.empty(len(rows), bitmask_words(vocab_size), dtype=torch.int32)
        at = 0
        for first in sorted(matchers):
            matcher, proposals = matchers[first]
            matcher.fill_bitmask_ahead(bitmask, at, proposals)
            at += len(proposals) + 1
        return cls(rows, bitmask)

    def allowed(self, vocab_size: int, device: torch.device) -> torch.Tensor:
        """bool [len(rows), vocab_size]: True where the token may come next."""
        shifts = torch.arange(_BITS, dtype=torch.int32, device=device)
        words = self.bitmask.to(device, non_blocking=True)
        bits = (words.unsqueeze(-1) >> shifts) & 1  # [R, words, 32], bit j of word w = token 32w+j
        return bits.view(len(self.rows), -1)[:, :vocab_size].bool()

    def apply(self, scores: torch.Tensor) -> None:
        """In place on float scores [N, vocab]: -inf for every token a constrained row may not
        take. A logits width beyond the bitmask's (padding rows of the LM head) is masked too."""
        vocab_size = scores.shape[1]
        allowed = self.allowed(min(vocab_size, self.bitmask.shape[1] * _BITS), scores.device)
        if allowed.shape[1] < vocab_size:
            pad = torch.zeros(len(self.rows), vocab_size - allowed.shape[1], dtype=torch.bool,
                              device=scores.device)
            allowed = torch.cat([allowed, pad], dim=1)
        index = torch.tensor(self.rows, dtype=torch.int64, device=scores.device)
        scores[index] = scores[index].masked_fill(~allowed, float("-inf"))
