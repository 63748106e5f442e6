"""The output constraint of a request (structured outputs, constrained tool calls): what crosses
Redis inside SamplingParams, and how it becomes one llguidance grammar.

The gateway validates a constraint (a bad schema is a 400) and the worker compiles the very same
grammar text, so both sides agree on it; a request resumed on another worker recompiles it from
the request record and replays its checkpointed tokens through it (worker/structured/).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Literal

from llguidance import LLMatcher

ConstraintKind = Literal["json_schema", "json_object", "regex", "choice", "lark"]
CONSTRAINT_KINDS: tuple[str, ...] = ("json_schema", "json_object", "regex", "choice", "lark")

# JSON as `json.dumps` writes it: ", " and ": " and no other whitespace. A small model sampled
# at temperature 1 may otherwise emit whitespace until max_tokens ends the answer mid-object.
JSON_SEPARATORS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class ConstraintError(ValueError):
    """The constraint is not a grammar llguidance can compile (the client gets a 400)."""


@dataclass(frozen=True)
class OutputConstraint:
    """Output tokens must spell a word of this language, then end (EOS).

    `spec` by kind: json_schema -> the schema as JSON text; json_object -> ""; regex -> the
    pattern; choice -> a JSON list of the allowed strings; lark -> an llguidance Lark grammar
    (may embed `%json{...}` schemas; the tool-call grammars are of this kind).
    """

    kind: ConstraintKind
    spec: str = ""

    def to_dict(self) -> dict[str, str]:
        return {"kind": self.kind, "spec": self.spec}

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> OutputConstraint | None:
        if not data:
            return None
        if data.get("kind") not in CONSTRAINT_KINDS:
            raise ConstraintError(f"unknown constraint kind {data.get('kind')!r}")
        return cls(data["kind"], data.get("spec", ""))

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | bool) -> OutputConstraint:
        # Key order is kept: llguidance generates properties in the schema's order.
        return cls("json_schema", json.dumps(schema, separators=(",", ":"), ensure_ascii=False))

    @classmethod
    def choice(cls, choices: list[str]) -> OutputConstraint:
        return cls("choice", json.dumps(list(choices)))

    def grammar(self) -> str:
        """The llguidance grammar text (cached: the same constraint recurs across requests)."""
        return grammar_of(self)


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
        grammar = constraint.grammar()
    except (ValueError, TypeError) as exc:
        raise ConstraintError(str(exc)) from exc
    is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise ConstraintError("; ".join(messages) or "the grammar does not compile")
