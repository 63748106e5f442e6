"""The grammars of tool calls: the model's own call format around JSON that must match one of
the tools' parameter schemas, so the arguments always parse and always fit. `tool_choice`
"required" or a named function forces a call; "auto" leaves the model free to answer in text,
but once it opens a call, the call is constrained (formats whose calls open with a text marker:
Hermes/Qwen)."""

from __future__ import annotations

import json
from typing import Any

from kvfleet.shared.structured import JSON_SEPARATORS, OutputConstraint, lark_literal
from kvfleet.gateway.tools.formats import ToolFormat

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


def auto_tool_constraint(functions: list[tuple[str, dict[str, Any] | None]], fmt: ToolFormat,
                         parallel: bool) -> OutputConstraint | None:
    """Output = free text without the call marker, or text up to the first marker and then
    calls (one, unless `parallel`) and nothing after them. None for formats whose calls do not
    open with a text marker (the whole answer would have to be sniffed: left free)."""
    marker = fmt.start.rstrip()
    if not marker or fmt.name == "mistral":  # [TOOL_CALLS] is a special token there
        return None
    rest = fmt.start[len(marker):]  # after the marker, before the JSON ("\n" for Hermes)
    calls = [call_schema(name, params, fmt.arguments_key) for name, params in functions]
    one = calls[0] if len(calls) == 1 else {"anyOf": calls}
    call = " ".join(part for part in (lark_literal(rest) if rest else "", _json(one),
                                      lark_literal(fmt.end) if fmt.end else "") if part)
    escaped = _regex_escape(marker)
    # The lexer reads both terminals at once: PLAIN dies when the marker shows, LEAD ends at it.
    lines = [
        "start: PLAIN | LEAD calls",
        f"PLAIN: /(?s:.*)/ & ~/(?s:.*{escaped}.*)/",
        f"LEAD: /(?s:.*{escaped})/ & ~/(?s:.*{escaped}.+)/",
        f"calls: call ({lark_literal(fmt.separator + marker)} call)*" if parallel
        else "calls: call",
        f"call: {call}",
    ]
    return OutputConstraint("lark", "\n".join(lines))


def _regex_escape(text: str) -> str:
    """`text` as a literal inside a /.../ regex of a Lark grammar."""
    return "".join("\\" + c if c in r"\.^$|?*+()[]{}/-" else c for c in text)
