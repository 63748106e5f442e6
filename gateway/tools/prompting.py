"""How a conversation with tools reaches the chat template.

A template that renders tools itself gets OpenAI's `tools` list and the messages' `tool_calls`
(arguments as objects, as the Hermes/Qwen/Llama/Mistral templates expect them). A template
without tools (the default model's) gets the tools described in the system prompt, in the Hermes
format the parser reads; earlier calls are written into the assistant text in that format and
tool results come back as user turns wrapped in <tool_response>.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from kvfleet.gateway.tools.formats import HERMES

SYSTEM_TOOLS_HEADER = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n")
SYSTEM_TOOLS_FOOTER = (
    "\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


@dataclass
class TemplateInput:
    """What `apply_chat_template` gets."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    kwargs: dict[str, Any] = field(default_factory=dict)


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def native_messages(messages) -> list[dict[str, Any]]:
    """ChatMessages as a tools-aware template reads them."""
    out = []
    for m in messages:
        item: dict[str, Any] = {"role": m.role, "content": m.text()}
        if m.name:
            item["name"] = m.name
        if m.tool_calls:
            item["tool_calls"] = [
                {"id": c.id, "type": "function",
                 "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)}}
                for c in m.tool_calls]
        if m.tool_call_id:
            item["tool_call_id"] = m.tool_call_id
        if m.reasoning_content:
            item["reasoning_content"] = m.reasoning_content
        out.append(item)
    return out


def described_messages(messages, tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """ChatMessages for a template without tools: tools in the system prompt, calls and results
    as text in the Hermes format."""
    out: list[dict[str, Any]] = []
    for m in messages:
        if m.role == "tool":
            out.append({"role": "user",
                        "content": f"<tool_response>\n{m.text()}\n</tool_response>"})
            continue
        text = m.text()
        if m.tool_calls:
            calls = [f"{HERMES.start}{json.dumps({'name': c.function.name, 'arguments': _arguments(c.function.arguments)}, ensure_ascii=False)}{HERMES.end}"
                     for c in m.tool_calls]
            text = "\n".join(([text] if text else []) + calls)
        item = {"role": m.role, "content": text}
        if m.name:
            item["name"] = m.name
        out.append(item)
    if tools:
        description = SYSTEM_TOOLS_HEADER + "\n".join(
            json.dumps(t, ensure_ascii=False) for t in tools) + SYSTEM_TOOLS_FOOTER
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{description}".lstrip()}
        else:
            out.insert(0, {"role": "system", "content": description})
    return out


def template_input(messages, tools: list[dict[str, Any]] | None, native: bool,
                   kwargs: dict[str, Any] | None = None) -> TemplateInput:
    """`native`: the template renders tools itself. `tools` None = keep them out of the prompt."""
    if native:
        return TemplateInput(native_messages(messages), tools or None, dict(kwargs or {}))
    return TemplateInput(described_messages(messages, tools), None, dict(kwargs or {}))
