"""Compiles output constraints into llguidance matchers for one tokenizer, with a cache.

llguidance's view of the vocabulary is built once per worker (about 0.5 s for a 49k vocabulary),
lazily, when the first constrained request arrives. A compiled grammar is kept as a matcher that
never consumed a token; each request gets a deep copy of it, which shares the compiled lexer and
parser tables, so a schema that recurs (the common case: one app, one schema) compiles once.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence

import llguidance
import llguidance.hf

from kvfleet.shared.structured import ConstraintError, OutputConstraint, grammar_of
from kvfleet.worker.structured.matcher import RequestMatcher

log = logging.getLogger(__name__)

DEFAULT_CACHE_SIZE = 256


class GrammarCompiler:
    """Constraint -> RequestMatcher for one tokenizer; compiled grammars cached (LRU)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: Sequence[int],
                 cache_size: int = DEFAULT_CACHE_SIZE):
        self.vocab_size = vocab_size  # width of the model's logits (may exceed the tokenizer's)
        self._tokenizer = tokenizer
        self._eos = eos_token_ids[0] if eos_token_ids else None
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._cache: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()  # the service's loop and tests may compile from two threads
        self.hits = 0
        self.misses = 0

    @property
    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        if self._ll_tokenizer is None:
            self._ll_tokenizer = llguidance.hf.from_tokenizer(
                self._tokenizer, n_vocab=self.vocab_size, eos_token=self._eos)
        return self._ll_tokenizer

    def matcher(self, constraint: OutputConstraint,
                output_token_ids: Sequence[int] = ()) -> RequestMatcher:
        """A matcher at the start of the constraint's grammar, advanced over `output_token_ids`
        (a resumed request replays its checkpoint, so its next masks are the ones the first
        worker would have computed). Raises ConstraintError."""
        matcher = RequestMatcher(self._compiled(grammar_of(constraint)).deep_copy())
        if output_token_ids:
            matcher.advance(output_token_ids)
        return matcher

    def _compiled(self, grammar: str) -> llguidance.LLMatcher:
        with self._lock:
            fresh = self._cache.get(grammar)
            if fresh is not None:
                self._cache.move_to_end(grammar)
                self.hits += 1
                return fresh
            self.misses += 1
            fresh = llguidance.LLMatcher(self.ll_tokenizer, grammar)
            if fresh.is_error():
                raise ConstraintError(f"the grammar does not compile: {fresh.get_error()}")
            self._cache[grammar] = fresh
            if len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
            return fresh
