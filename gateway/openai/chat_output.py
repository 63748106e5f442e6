"""One chat choice's text split into what the reply carries: `reasoning_content` (think tags),
`content`, and `tool_calls` — streamed as deltas, or whole (the same code fed at once)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvfleet.gateway.openai.responses import (
    FunctionCallDelta, FunctionCallOut, ToolCallDeltaOut, ToolCallOut)
from kvfleet.gateway.output.reasoning import ReasoningSplitter
from kvfleet.gateway.tools.formats import ToolFormat
from kvfleet.gateway.tools.parser import ToolCallParser


@dataclass
class ChatPiece:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallDeltaOut] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)


@dataclass
class ChatOutputOptions:
    """Per request: which splitters run."""

    tool_format: ToolFormat | None = None  # None: tools are off (no parsing)
    reasoning: bool = False
    starts_in_reasoning: bool = False  # the template opened the think block in the prompt
    # parallel_tool_calls false: the first call only; what the model writes after it is dropped
    max_tool_calls: int | None = None


class ChatOutput:
    def __init__(self, options: ChatOutputOptions):
        self._reasoning = (ReasoningSplitter(options.starts_in_reasoning)
                           if options.reasoning else None)
        self._tools = ToolCallParser(options.tool_format) if options.tool_format else None
        self._max_calls = options.max_tool_calls
        self.saw_reasoning = False

    def feed(self, text: str) -> ChatPiece:
        if not text:
            return ChatPiece()
        return self._split(text, final=False)

    def finish(self) -> ChatPiece:
        return self._split("", final=True)

    def _split(self, text: str, final: bool) -> ChatPiece:
        piece = ChatPiece()
        content = text
        if self._reasoning is not None:
            part = self._reasoning.finish() if final else self._reasoning.feed(text)
            piece.reasoning, content = part.reasoning, part.content
            self.saw_reasoning = self.saw_reasoning or bool(part.reasoning)
            if final and content:  # what the splitter held goes through the tool parser first
                piece = self._tools_piece(piece, content, final=False)
                content = ""
        return self._tools_piece(piece, content, final)

    def _tools_piece(self, piece: ChatPiece, content: str, final: bool) -> ChatPiece:
        if self._tools is None:
            piece.content += content
            return piece
        if self._calls_done:  # past the last call the client may get: nothing more
            return piece
        if content:  # a feed's content is text before its calls
            self._add(piece, self._tools.feed(content), keep_content=True)
        if final and not self._calls_done:
            last = self._tools.finish()
            # finish's content is text after the calls: dropped if the last call it may keep came
            self._add(piece, last, keep_content=not self._calls_done)
        return piece

    def _add(self, piece: ChatPiece, part, keep_content: bool) -> None:
        if keep_content:
            piece.content += part.content
        piece.tool_calls += [ToolCallDeltaOut(
            index=d.index, id=d.id, type="function" if d.id else None,
            function=FunctionCallDelta(name=d.name, arguments=d.arguments))
            for d in part.calls if self._max_calls is None or d.index < self._max_calls]

    @property
    def _calls_done(self) -> bool:
        return (self._tools is not None and self._max_calls is not None
                and len(self._tools.calls) >= self._max_calls)

    @property
    def tool_calls(self) -> list[ToolCallOut]:
        """The calls found (complete ones), for the whole reply."""
        if self._tools is None:
            return []
        calls = self._tools.calls[:self._max_calls]  # [:None]: all
        return [ToolCallOut(id=c.id, function=FunctionCallOut(name=c.name, arguments=c.arguments))
                for c in calls]
