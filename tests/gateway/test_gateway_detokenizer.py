"""Incremental detokenisation and stop strings, on the real SmolLM2 tokenizer."""

from __future__ import annotations

import pytest

from gateway.detokenizer import IncrementalDetokenizer, StopStringFilter

TEXTS = ["Hello world", "emoji 😀🎉 and a flag 🇫🇷!", "日本語のテキスト", "  two  spaces\n\nnew",
         "café crème brûlée", "mixed 👩‍💻 zwj"]


@pytest.mark.parametrize("text", TEXTS)
def test_token_by_token_equals_full_decode_and_never_splits_a_character(tokenizer, text):
    ids = tokenizer.encode(text)
    detokenizer = IncrementalDetokenizer(tokenizer, tokenizer.encode("Prompt:"))
    pieces = [detokenizer.add([token_id]) for token_id in ids] + [detokenizer.flush()]
    assert "".join(pieces) == text
    assert all("\ufffd" not in piece for piece in pieces)


def test_special_tokens_are_skipped(tokenizer):
    detokenizer = IncrementalDetokenizer(tokenizer)
    assert detokenizer.add(tokenizer.encode("Hi")) == "Hi"
    assert detokenizer.add([tokenizer.eos_token_id]) == ""
    assert detokenizer.flush() == ""


def test_an_unfinished_character_is_flushed_as_a_replacement(tokenizer):
    ids = tokenizer.encode(" 😀")
    detokenizer = IncrementalDetokenizer(tokenizer)
    assert detokenizer.add(ids[:1]) == ""
    assert detokenizer.flush().endswith("\ufffd")


def test_stop_filter_holds_back_a_possible_stop_and_truncates():
    stops = StopStringFilter(["STOP", "\n\n"])
    assert stops.feed("abc S") == "abc "
    assert stops.feed("T") == ""
    assert stops.feed("OP and more") == ""
    assert stops.stopped and stops.flush() == ""


def test_stop_filter_releases_text_that_did_not_become_a_stop():
    stops = StopStringFilter(["STOP"])
    assert stops.feed("ST") == ""
    assert stops.feed("x") == "STx"
    assert stops.feed("S") == ""
    assert stops.flush() == "S" and not stops.stopped


def test_stop_filter_earliest_stop_wins_and_empty_stops_are_ignored():
    stops = StopStringFilter(["", "world", "lo w"])
    assert stops.feed("hello world") == "hel"
    assert StopStringFilter([]).feed("anything") == "anything"
