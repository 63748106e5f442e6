"""Request fields kvfleet does not implement: OpenAI's are refused by name, others are ignored
with a warning in the log (as vLLM does), so a client is never silently given less than it
asked for."""

from __future__ import annotations

import logging
from typing import Any

from kvfleet.gateway.http.errors import bad_request

log = logging.getLogger(__name__)

# OpenAI fields of the chat API with no implementation here (text-only models, no storage, no
# hosted tools), and why; a field sent as null or with its "off" value is accepted.
UNSUPPORTED_CHAT: dict[str, str] = {
    "audio": "audio output is not supported (text-only models)",
    "prediction": "predicted outputs are not supported",
    "web_search_options": "web search is not supported",
    "functions": "the deprecated `functions` is not supported; use `tools`",
    "function_call": "the deprecated `function_call` is not supported; use `tool_choice`",
    "verbosity": "`verbosity` is not supported",
    "prompt_cache_key": "`prompt_cache_key` is not supported (prefix caching is automatic)",
    "prompt_cache_retention": "`prompt_cache_retention` is not supported",
}
UNSUPPORTED_COMPLETIONS: dict[str, str] = {}
# Values of an unsupported field that mean "not used" (clients send them by default).
OFF_VALUES: dict[str, tuple[Any, ...]] = {"verbosity": ("medium",)}


def check_extra_fields(extra: dict[str, Any] | None, unsupported: dict[str, str],
                       endpoint: str) -> None:
    """400 naming an unsupported OpenAI field; a warning for fields OpenAI does not define."""
    if not extra:
        return
    ignored = []
    for name, value in extra.items():
        if name in unsupported:
            if value is None or value in OFF_VALUES.get(name, ()):
                continue
            raise bad_request(f"`{name}`: {unsupported[name]}.", param=name,
                              code="unsupported_parameter")
        ignored.append(name)
    if ignored:
        log.warning("%s: the following fields were present in the request but ignored: %s",
                    endpoint, sorted(ignored))
