"""The grammar that forces a tool call (`tool_choice` "required" or a named function): the
model's own call format around JSON that must match one of the tools' parameter schemas, so the
arguments always parse and always fit."""

from __future__ import annotations

import json
from typing import Any

from shared.structured import JSON_SEPARATORS, OutputConstraint, lark_literal
from gateway.tools.formats import ToolFormat

EMPTY_OBJECT = {"type": "object", "properties": {}}


def call_schema(name: str, parameters: dict[str, Any] | None, arguments_key: str) -> dict:
    """One call object: {"name": <this name>, "<arguments_key>": <its parameters>}."""
    return {"type": "object",
            "properties": {"name": {"const": name}, arguments_key: parameters or EMPTY_OBJECT},
            "required": ["name", arguments_key], "additionalProperties": False}


def tool_call_constraint(functions: list[tuple[str, dict[str, Any] | None]], fmt: ToolFormat,
                         parallel: bool) -> OutputConstraint:
    """Output = one call (or, with `parallel`, one or more) of the given (name, parameters)."""
    calls = [call_schema(name, params, fmt.arguments_key) for name, params in functions]
    one = calls[0] if len(calls) == 1 else {"anyOf": calls}
    if fmt.name == "mistral":  # the calls are one JSON list
        array = {"type": "array", "items": one, "minItems": 1}
        if not parallel:
            array["maxItems"] = 1
        body = f"{lark_literal(fmt.start)} {_json(array)}"
        return OutputConstraint("lark", f"start: {body}")
    call = f"{lark_literal(fmt.start) if fmt.start else ''} {_json(one)} " \
           f"{lark_literal(fmt.end) if fmt.end else ''}".strip()
    rules = f"call: {call}\n"
    start = f'start: call ({lark_literal(fmt.separator)} call)*' if parallel else "start: call"
    return OutputConstraint("lark", f"{start}\n{rules}")


def _json(schema: dict) -> str:
    """An embedded schema, with the compact separators of every constrained JSON."""
    return "%json" + json.dumps({**schema, "x-guidance": JSON_SEPARATORS}, ensure_ascii=False)
