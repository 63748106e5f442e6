"""The engine's constrained requests: one matcher each, kept in step with their output tokens."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from shared.structured import OutputConstraint
from worker.structured.compiler import GrammarCompiler
from worker.structured.logit_mask import LogitMask
from worker.structured.matcher import RequestMatcher

log = logging.getLogger(__name__)


class ConstrainedRequests:
    """req_id -> RequestMatcher for the requests in the engine that carry a constraint.

    The engine calls `add` when a request enters (replaying resumed tokens), `mask` before each
    sampling, `advance` with each sampled token and `discard` when a request leaves.
    """

    def __init__(self, compiler: GrammarCompiler | None):
        self.compiler = compiler
        self._matchers: dict[str, RequestMatcher] = {}

    def add(self, req_id: str, constraint: OutputConstraint | None,
            output_token_ids: Sequence[int]) -> None:
        """Raises ValueError (ConstraintError) when the grammar does not compile or the resumed
        tokens do not follow it."""
        if constraint is None:
            return
        if self.compiler is None:
            raise ValueError("constrained decoding needs an engine built with a tokenizer")
        self._matchers[req_id] = self.compiler.matcher(constraint, output_token_ids)

    def mask(self, req_ids: Sequence[str]) -> LogitMask | None:
        """The logit mask of a batch whose row i belongs to req_ids[i]."""
        if not self._matchers:
            return None
        rows = {i: self._matchers[r] for i, r in enumerate(req_ids) if r in self._matchers}
        return LogitMask.of(rows, self.compiler.vocab_size) if rows else None

    def advance(self, req_id: str, token_id: int) -> None:
        matcher = self._matchers.get(req_id)
        if matcher is not None:
            matcher.advance([token_id])

    def discard(self, req_id: str) -> None:
        self._matchers.pop(req_id, None)

    def __len__(self) -> int:
        return len(self._matchers)
