"""Finds tool calls in a model's output as it streams: content text passes through, calls come
out as OpenAI's deltas (index, id and name first, then argument fragments).

The whole-answer parse is the same parser fed at once, so a streamed and a non-streamed answer
agree to the byte. Arguments are the model's own JSON text (the constrained formats write it in
`json.dumps` style), so the concatenated fragments equal the final `arguments`.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from kvfleet.gateway.tools.formats import ToolFormat

_HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\S)')
_PYTHON_TAG = "<|python_tag|>"
_TAIL = re.compile(r"[\s}]*$")  # may still close the arguments and the call: held back


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCallDelta:
    """One streamed piece of call `index`: its id and name come once, then argument text."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass
class ParsedToolCall:
    id: str
    name: str
    arguments: str  # JSON text of the arguments object


@dataclass
class ParsedPiece:
    content: str = ""
    calls: list[ToolCallDelta] = field(default_factory=list)


class ToolCallParser:
    """Feed output text in order; each feed returns what can be sent now."""

    def __init__(self, fmt: ToolFormat):
        self.fmt = fmt
        self._mode = "content" if fmt.start and fmt.name != "mistral" else "sniff"
        self._held = ""  # content that may still open a call
        self._buffer = ""  # text of the calls (from the first call on)
        self._pos = 0  # consumed part of the buffer
        self.calls: list[ParsedToolCall] = []
        self._current: _OpenCall | None = None

    # ---- feeding --------------------------------------------------------------------------

    def feed(self, text: str) -> ParsedPiece:
        if self._mode == "calls":
            self._buffer += text
            return ParsedPiece(calls=self._advance(final=False))
        self._held += text
        if self._mode == "sniff":  # formats whose calls make up the whole answer
            head = self._held.lstrip()
            openers = [m for m in (self.fmt.start, _PYTHON_TAG, "{", "[") if m]
            if not head or any(m.startswith(head) and m != head for m in openers):
                return ParsedPiece()  # too short to tell ("[" may become "[TOOL_CALLS]")
            if any(head.startswith(m) for m in openers):
                return self._enter_calls(len(self._held) - len(head))
            self._mode = "content" if self.fmt.start else "plain"
        if self._mode == "plain":
            out, self._held = self._held, ""
            return ParsedPiece(content=out)
        at = self._held.find(self.fmt.start)
        if at >= 0:
            return self._enter_calls(at)
        keep = _partial_suffix(self._held, self.fmt.start)
        # whitespace before a call is not content: hold it until the next word shows
        out = self._held[:len(self._held) - keep].rstrip()
        self._held = self._held[len(out):]
        return ParsedPiece(content=out)

    def finish(self) -> ParsedPiece:
        """The end of the output: held text, the last call, or unparsable call text as content."""
        if self._mode != "calls":
            out, self._held = self._held, ""
            return ParsedPiece(content=out)
        calls = self._advance(final=True)
        rest = self._buffer[self._pos:].strip()
        if self._current is not None or (rest and rest not in (self.fmt.separator.strip(),)):
            # not (only) well-formed calls: what was not sent as a call is the model's text
            return ParsedPiece(content=self._buffer[self._pos:] if self.calls else self._buffer,
                               calls=calls)
        return ParsedPiece(calls=calls)

    def _enter_calls(self, at: int) -> ParsedPiece:
        content = self._held[:at]
        self._buffer, self._held, self._mode = self._held[at:], "", "calls"
        return ParsedPiece(content=content.rstrip(), calls=self._advance(final=False))

    # ---- calls ----------------------------------------------------------------------------

    def _advance(self, final: bool) -> list[ToolCallDelta]:
        deltas: list[ToolCallDelta] = []
        while True:
            if self._current is None:
                start = self._next_object()
                if start is None:
                    return deltas
                self._current = _OpenCall(len(self.calls), start)
            delta, done = self._current.step(self._buffer)
            if delta is not None:
                deltas.append(delta)
            if not done:
                return deltas
            call, end = done
            self.calls.append(call)
            self._pos, self._current = end, None
            if self.fmt.end and self._buffer.startswith(self.fmt.end, self._pos):
                self._pos += len(self.fmt.end)

    def _next_object(self) -> int | None:
        """Index of the next call object's `{` past markers and separators, if it has come."""
        pos = self._pos
        markers = [m for m in (self.fmt.start, self.fmt.end, self.fmt.separator.strip(),
                               _PYTHON_TAG, self.fmt.start.strip(), self.fmt.end.strip(), "[", "]")
                   if m]
        while pos < len(self._buffer):
            if self._buffer[pos].isspace():
                pos += 1
                continue
            marker = next((m for m in markers if self._buffer.startswith(m, pos)), None)
            if marker is not None:
                pos += len(marker)
                continue
            if self._buffer[pos] == "{":
                self._pos = pos
                return pos
            return None  # not a call: finish() turns it into content
        self._pos = pos  # only markers and separators so far
        return None


class _OpenCall:
    """A call whose JSON object is still arriving."""

    def __init__(self, index: int, start: int):
        self.index = index
        self.start = start
        self.id = new_call_id()
        self.name: str | None = None
        self.args_start = 0
        self.sent = ""

    def step(self, buffer: str) -> tuple[ToolCallDelta | None, tuple[ParsedToolCall, int] | None]:
        text = buffer[self.start:]
        delta = None
        if self.name is None:
            header = _HEADER.match(text)
            if header:
                self.name = json.loads(f'"{header.group(1)}"')
                self.args_start = header.end()
                delta = ToolCallDelta(self.index, self.id, self.name, "")
        try:
            obj, end = json.JSONDecoder().raw_decode(text)
        except json.JSONDecodeError:
            if self.name is not None:  # stream the arguments, holding back a possible `}` tail
                safe = _TAIL.sub("", text[self.args_start:])
                if len(safe) > len(self.sent) and safe.startswith(self.sent):
                    piece, self.sent = safe[len(self.sent):], safe
                    delta = delta or ToolCallDelta(self.index)
                    delta.arguments += piece
            return delta, None
        call = self._complete(obj, text)
        if call is None:
            return delta, None
        rest = call.arguments[len(self.sent):] if call.arguments.startswith(self.sent) else ""
        if self.name is None:  # the whole object came at once (or arguments came first)
            self.name = call.name
            delta = ToolCallDelta(self.index, self.id, call.name, call.arguments)
        elif rest:
            delta = delta or ToolCallDelta(self.index)
            delta.arguments += rest
        return delta, (call, self.start + end)

    def _complete(self, obj, text: str) -> ParsedToolCall | None:
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        key = "arguments" if "arguments" in obj else "parameters"
        arguments = obj.get(key, {})
        if isinstance(arguments, str):
            return ParsedToolCall(self.id, obj["name"], arguments)
        if self.args_start:  # the model's own text of the value
            _, end = json.JSONDecoder().raw_decode(text, self.args_start)
            raw = text[self.args_start:end]
        else:
            raw = json.dumps(arguments, ensure_ascii=False)
        return ParsedToolCall(self.id, obj["name"], raw)


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:size]):
            return size
    return 0


def parse_tool_calls(text: str, fmt: ToolFormat) -> tuple[str, list[ParsedToolCall]]:
    """A finished answer: (content, calls)."""
    parser = ToolCallParser(fmt)
    first, last = parser.feed(text), parser.finish()
    return first.content + last.content, parser.calls
