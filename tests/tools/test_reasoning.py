"""Think-tag splitting, whole and streamed in every split."""

from __future__ import annotations

import pytest

from kvfleet.gateway.output.reasoning import ReasoningSplitter, split_reasoning

CASES = [
    ("<think>Two plus two.\nIs four.</think>\n\nThe answer is 4.", False,
     "Two plus two.\nIs four.", "The answer is 4."),
    ("Plain answer, <think> later is text.", False, None, "Plain answer, <think> later is text."),
    ("already thinking</think>Done.", True, "already thinking", "Done."),
    ("<think>cut off mid thou", False, "cut off mid thou", ""),
    ("<thin", False, None, "<thin"),
]


@pytest.mark.parametrize("text, opened, reasoning, content", CASES)
def test_whole(text, opened, reasoning, content):
    assert split_reasoning(text, opened) == (reasoning, content)


@pytest.mark.parametrize("text, opened, reasoning, content", CASES)
@pytest.mark.parametrize("step", [1, 3, 7])
def test_streamed(text, opened, reasoning, content, step):
    splitter = ReasoningSplitter(opened)
    pieces = [splitter.feed(text[i:i + step]) for i in range(0, len(text), step)]
    pieces.append(splitter.finish())
    assert "".join(p.reasoning for p in pieces) == (reasoning or "")
    assert "".join(p.content for p in pieces) == content
    assert not any("<" in p.reasoning and "think" in p.reasoning for p in pieces)
