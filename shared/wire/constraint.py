"""OutputConstraint: the grammar a request's output must follow (structured outputs, forced
tool calls), carried inside SamplingParams in the request record, so a request resumed on
another worker stays constrained. shared/structured.py turns it into llguidance grammar text."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

ConstraintKind = Literal["json_schema", "json_object", "regex", "choice", "lark"]
CONSTRAINT_KINDS: tuple[str, ...] = ("json_schema", "json_object", "regex", "choice", "lark")


class ConstraintError(ValueError):
    """Not a constraint kvfleet can enforce (the client gets a 400; a worker fails the request)."""


@dataclass(frozen=True)
class OutputConstraint:
    """Output tokens must spell a word of this language, then end (EOS).

    Encoding: the dict {"kind", "spec"} inside the msgpack of SamplingParams. `spec` by kind:
    json_schema -> the schema as JSON text (key order kept: properties are generated in it);
    json_object -> ""; regex -> the pattern; choice -> a JSON list of the allowed strings;
    lark -> an llguidance Lark grammar (may embed `%json{...}` schemas).
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
        return cls("json_schema", json.dumps(schema, separators=(",", ":"), ensure_ascii=False))

    @classmethod
    def choice(cls, choices: list[str]) -> OutputConstraint:
        return cls("choice", json.dumps(list(choices), ensure_ascii=False))
