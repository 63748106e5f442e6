"""How an output constraint (shared/wire/constraint.py) becomes one llguidance grammar, and its
validation.

The gateway validates a constraint (a bad schema is a 400) and the worker compiles the very same
grammar text, so both sides agree on it; a request resumed on another worker recompiles it from
the request record and replays its checkpointed tokens through it (worker/structured/).
"""

from __future__ import annotations

import json
from functools import lru_cache

from llguidance import LLMatcher

from kvfleet.shared.wire.constraint import ConstraintError, OutputConstraint

__all__ = ["JSON_SEPARATORS", "ConstraintError", "OutputConstraint", "grammar_of", "lark_literal",
           "validate"]

# JSON as `json.dumps` writes it: ", " and ": " and no other whitespace. A small model sampled
# at temperature 1 may otherwise emit whitespace until max_tokens ends the answer mid-object.
JSON_SEPARATORS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@lru_cache(maxsize=256)
def grammar_of(constraint: OutputConstraint) -> str:
    kind, spec = constraint.kind, constraint.spec
    if kind == "json_object":
        return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_SEPARATORS)
    if kind == "json_schema":
        try:
            schema = json.loads(spec)
        except json.JSONDecodeError as exc:
            raise ConstraintError(f"the JSON schema is not valid JSON: {exc}") from exc
        return LLMatcher.grammar_from_json_schema(schema, defaults=JSON_SEPARATORS)
    if kind == "regex":
        return LLMatcher.grammar_from_regex(spec)
    if kind == "choice":
        choices = json.loads(spec)
        if not choices or not all(isinstance(c, str) for c in choices):
            raise ConstraintError("a choice constraint needs a non-empty list of strings")
        return LLMatcher.grammar_from_lark("start: " + " | ".join(lark_literal(c) for c in choices))
    return LLMatcher.grammar_from_lark(spec)


def lark_literal(text: str) -> str:
    """A Lark string literal matching `text` exactly (JSON string escapes are Lark's too)."""
    return json.dumps(text, ensure_ascii=False)


def validate(constraint: OutputConstraint) -> None:
    """Raises ConstraintError naming what llguidance refuses (unsupported schema keyword, bad
    regex, grammar syntax) — without a tokenizer: the gateway checks before it enqueues."""
    try:
        grammar = grammar_of(constraint)
    except (ValueError, TypeError) as exc:
        raise ConstraintError(str(exc)) from exc
    is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise ConstraintError("; ".join(messages) or "the grammar does not compile")
