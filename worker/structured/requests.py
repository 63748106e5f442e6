"""The engine's constrained requests: one matcher each, kept in step with their output tokens."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from kvfleet.shared.structured import OutputConstraint
from kvfleet.worker.structured.compiler import GrammarCompiler
from kvfleet.worker.structured.logit_mask import LogitMask
from kvfleet.worker.structured.matcher import RequestMatcher

log = logging.getLogger(__name__)


class ConstrainedRequests:
    """req_id -> RequestMatcher for the requests in the engine that carry a constraint.

    The engine calls `add` when a request enters (replaying resumed tokens), `mask_ahead` before
    each sampling, `advance` with each step's new tokens and `discard` when a request leaves.
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

    def mask_ahead(self, rows: Sequence[tuple[str, list[int]]]) -> LogitMask | None:
        """The logit mask of a batch of (req_id, proposals) groups of 1 + len(proposals) rows
        each: a group's rows are masked as if its proposals were accepted one by one."""
        if not self._matchers:
            return None
        groups, first = {}, 0
        for req_id, proposals in rows:
            if req_id in self._matchers:
                groups[first] = (self._matchers[req_id], proposals)
            first += 1 + len(proposals)
        return LogitMask.ahead(groups, self.compiler.vocab_size) if groups else None

    def advance(self, req_id: str, token_ids: Sequence[int]) -> None:
        matcher = self._matchers.get(req_id)
        if matcher is not None:
            matcher.advance(token_ids)

    def discard(self, req_id: str) -> None:
        self._matchers.pop(req_id, None)

    def __len__(self) -> int:
        return len(self._matchers)
