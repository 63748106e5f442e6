"""One request's position in its grammar: which tokens may come next, advanced token by token.

Invariant: the matcher has consumed exactly the request's output tokens, in order. It is a pure
function of them, so rebuilding it from the checkpoint on another worker gives the same masks.
"""

from __future__ import annotations

from collections.abc import Sequence

import llguidance
import llguidance.torch
import torch

from kvfleet.shared.structured import ConstraintError


class RequestMatcher:
    def __init__(self, matcher: llguidance.LLMatcher):
        self._matcher = matcher
        self.num_consumed = 0

    def advance(self, token_ids: Sequence[int]) -> None:
        """Consume tokens the sampler produced; raises ConstraintError on one the grammar refuses
        (only possible when the mask was not applied, e.g. a checkpoint from another grammar)."""
        for token_id in token_ids:
            if not self._matcher.consume_token(int(token_id)):
                raise ConstraintError(
                    f"output token {token_id} at position {self.num_consumed} violates the "
                    f"constraint: {self._matcher.get_error() or 'not allowed here'}")
            self.num_consumed += 1

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Row `row` of an int32 [rows, ceil(vocab / 32)] CPU bitmask: bit t set = token t may
        come next. Once the grammar is complete only EOS is allowed."""
        llguidance.torch.fill_next_token_bitmask(self._matcher, bitmask, row)

    def fill_bitmask_ahead(self, bitmask: torch.Tensor, row: int, proposals: Sequence[int]) -> None:
        """Rows `row .. row + len(proposals)`: the masks after each prefix of `proposals` (the
        rows that verify them), the matcher left where it was. Rows past a proposal the
        grammar refuses repeat the last mask: they are never sampled from (the refused token
        cannot be the one sampled before them, so verification stops there)."""
        self.fill_bitmask(bitmask, row)
        valid = self._matcher.validate_tokens([int(t) for t in proposals])
        for j in range(1, len(proposals) + 1):
            if j <= valid:
                self._matcher.consume_token(int(proposals[j - 1]))
                self.fill_bitmask(bitmask, row + j)
            else:
                bitmask[row + j] = bitmask[row + j - 1]
        if valid:
            self._matcher.rollback(valid)

    @property
    def is_finished(self) -> bool:
        """The grammar consumed EOS (or cannot continue)."""
        return self._matcher.is_stopped()
