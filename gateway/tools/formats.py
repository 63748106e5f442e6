"""The tool-call formats models are trained on, and which one a chat template speaks.

hermes       <tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>   (Hermes, Qwen 2/2.5/3)
llama3_json  {"name": ..., "parameters": {...}}  (several joined by "; "), maybe after <|python_tag|>
mistral      [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]

A template without tools (the default model's) gets the Hermes format described in the system
prompt (tools/prompting.py): it is the one small models imitate best and the easiest to parse.
"""

from __future__ import annotations

from dataclasses import dataclass

TOOL_CALL_PARSERS = ("auto", "hermes", "llama3_json", "mistral")


@dataclass(frozen=True)
class ToolFormat:
    name: str
    start: str  # text that opens the calls ("" = the output starts with the JSON itself)
    end: str  # text that closes one call ("" = the JSON's own end)
    arguments_key: str  # "arguments", or "parameters" for Llama 3
    separator: str  # between parallel calls


HERMES = ToolFormat("hermes", "<tool_call>\n", "\n</tool_call>", "arguments", "\n")
LLAMA3_JSON = ToolFormat("llama3_json", "", "", "parameters", "; ")
MISTRAL = ToolFormat("mistral", "[TOOL_CALLS]", "", "arguments", ", ")
FORMATS = {f.name: f for f in (HERMES, LLAMA3_JSON, MISTRAL)}


def template_has_tools(chat_template: str | None) -> bool:
    """Whether the template renders a `tools` list itself."""
    return bool(chat_template) and "tools" in chat_template


def format_for_template(chat_template: str | None, configured: str = "auto") -> ToolFormat:
    """The configured format, or (auto) the one the chat template's own markers reveal."""
    if configured != "auto":
        return FORMATS[configured]
    template = chat_template or ""
    if "[TOOL_CALLS]" in template:
        return MISTRAL
    if "<tool_call>" in template:
        return HERMES
    if "<|python_tag|>" in template or ("ipython" in template and "parameters" in template):
        return LLAMA3_JSON
    return HERMES
