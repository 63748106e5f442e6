"""One chat choice's text split into what the reply carries: `reasoning_content` (think tags),
`content`, and `tool_calls` — streamed as deltas, or whole (the same code fed at once)."""

from __future__ import annotations

from dataclasses import dataclass, field

from gateway.openai.responses import (
    FunctionCallDelta, FunctionCallOut, ToolCallDeltaOut, ToolCallOut)
from gateway.output.reasoning import ReasoningSplitter
from gateway.tools.formats import ToolFormat
from gateway.tools.parser import ToolCallParser


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


class ChatOutput:
    def __init__(self, options: ChatOutputOptions):
        self._reasoning = (ReasoningSplitter(options.starts_in_reasoning)
                           if options.reasoning else None)
        self._tools = ToolCallParser(options.tool_format) if options.tool_format else None
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
        parsed = self._tools.feed(content) if content else None
        pieces = [p for p in (parsed, self._tools.finish() if final else None) if p is not None]
        for part in pieces:
            piece.content += part.content
            piece.tool_calls += [ToolCallDeltaOut(
                index=d.index, id=d.id, type="function" if d.id else None,
                function=FunctionCallDelta(name=d.name, arguments=d.arguments))
                for d in part.calls]
        return piece

    @property
    def tool_calls(self) -> list[ToolCallOut]:
        """The calls found (complete ones), for the whole reply."""
        if self._tools is None:
            return []
        return [ToolCallOut(id=c.id, function=FunctionCallOut(name=c.name, arguments=c.arguments))
                for c in self._tools.calls]
