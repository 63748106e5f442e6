"""Splits a reasoning model's output into `reasoning_content` (inside think tags) and `content`,
as it streams.

The model writes `<think>` ... `</think>` then its answer; a chat template may already open the
think block in the prompt (Qwen3 with `enable_thinking`), so the output starts inside it. A tag
split over several deltas is held back until it is complete, so neither side ever shows a
fragment of a tag.
"""

from __future__ import annotations

from dataclasses import dataclass

THINK_START = "<think>"
THINK_END = "</think>"


@dataclass
class ReasoningPiece:
    reasoning: str = ""
    content: str = ""


class ReasoningSplitter:
    def __init__(self, starts_in_reasoning: bool = False,
                 start_tag: str = THINK_START, end_tag: str = THINK_END):
        self._start_tag = start_tag
        self._end_tag = end_tag
        # "start": the opening tag may still come; "reasoning": inside; "after": just closed;
        # "content": the answer
        self._state = "reasoning" if starts_in_reasoning else "start"
        self._held = ""

    def feed(self, text: str) -> ReasoningPiece:
        piece = ReasoningPiece()
        self._held += text
        while self._held:
            if self._state == "start":
                head = self._held.lstrip()
                if not head or (self._start_tag.startswith(head) and head != self._start_tag):
                    return piece  # may still become the opening tag
                if head.startswith(self._start_tag):
                    self._held = head[len(self._start_tag):]
                    self._state = "reasoning"
                else:
                    self._state = "content"
            elif self._state == "reasoning":
                at = self._held.find(self._end_tag)
                if at >= 0:
                    piece.reasoning += self._held[:at]
                    self._held = self._held[at + len(self._end_tag):]
                    self._state = "after"
                    continue
                keep = _partial_suffix(self._held, self._end_tag)
                piece.reasoning += self._held[:len(self._held) - keep]
                self._held = self._held[len(self._held) - keep:]
                return piece
            elif self._state == "after":  # the newlines that follow the closing tag are layout
                self._held = self._held.lstrip("\n")
                if self._held:
                    self._state = "content"
            else:
                piece.content += self._held
                self._held = ""
        return piece

    def finish(self) -> ReasoningPiece:
        """The end of the output: a held fragment goes where it stands."""
        held, self._held = self._held, ""
        if self._state == "reasoning":
            return ReasoningPiece(reasoning=held)
        return ReasoningPiece(content=held)


def _partial_suffix(text: str, tag: str) -> int:
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0


def split_reasoning(text: str, starts_in_reasoning: bool = False) -> tuple[str | None, str]:
    """A finished answer: (reasoning or None, content)."""
    splitter = ReasoningSplitter(starts_in_reasoning)
    first, last = splitter.feed(text), splitter.finish()
    reasoning = first.reasoning + last.reasoning
    seen = starts_in_reasoning or text.lstrip().startswith(THINK_START)
    return (reasoning if seen else None), first.content + last.content


def supports_reasoning(tokenizer) -> bool:
    """`auto`: the vocabulary has both think tags as single tokens (Qwen3, DeepSeek-R1, ...)."""
    vocab = tokenizer.get_vocab()
    return THINK_START in vocab and THINK_END in vocab


def prompt_opens_reasoning(prompt_text_tail: str) -> bool:
    """The template left the think block open at the end of the prompt."""
    tail = prompt_text_tail.rstrip()
    return tail.endswith(THINK_START)
