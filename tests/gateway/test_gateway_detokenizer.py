"""Incremental detokenisation and stop strings, on the real SmolLM2 tokenizer."""

from __future__ import annotations

import pytest

from gateway.output.detokenizer import IncrementalDetokenizer, StopStringFilter, TextDecoder

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


# ---- the one-decode-per-token detokeniser against the reference algorithm --------------------

TRICKY = TEXTS + ["🇯🇵🇺🇸 flags, 1️⃣ keycaps, 🧑🏽‍🚀 skin tones", "中文，标点。한국어 텍스트",
                  "Ω≈ç√∫ ñ ü ß", " leading and trailing spaces  ", "a\u0301 combining, \u200b zwsp"]


class ReferenceDetokenizer:
    """The previous implementation: two `tokenizer.decode` calls per step, nothing cached."""

    def __init__(self, tokenizer, context):
        self._tokenizer = tokenizer
        self._ids = list(context[-5:])
        self._prefix_offset, self._read_offset = 0, len(self._ids)

    def _decode(self, ids):
        return self._tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, token_ids):
        self._ids.extend(token_ids)
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset:])
        if len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd"):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return full_text[len(prefix_text):]

    def flush(self):
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset:])
        self._prefix_offset = self._read_offset = len(self._ids)
        return full_text[len(prefix_text):] if full_text.startswith(prefix_text) else ""


class SlowTokenizer:
    """Hides the tokenizer's class, so TextDecoder must take the generic `decode` path."""

    def __init__(self, tokenizer):
        self._inner = tokenizer

    def decode(self, ids, skip_special_tokens=False):
        return self._inner.decode(ids, skip_special_tokens=skip_special_tokens)


def chunkings(ids: list[int]):
    yield [[t] for t in ids]  # one token per event, as workers publish them
    yield [ids[i:i + 3] for i in range(0, len(ids), 3)]  # several tokens per event
    yield [ids[:1], [], ids[1:2], ids[2:]]  # an empty event in between


@pytest.mark.parametrize("text", TRICKY)
@pytest.mark.parametrize("generic", [False, True])
def test_deltas_equal_the_reference_and_join_to_the_full_decode(tokenizer, text, generic):
    tok = SlowTokenizer(tokenizer) if generic else tokenizer
    context = tokenizer.encode("Prompt: 日本")
    ids = tokenizer.encode(text) + [tokenizer.eos_token_id]
    decoder = TextDecoder(tok)
    for events in chunkings(ids):
        fast = IncrementalDetokenizer(tok, context, decoder)
        slow = ReferenceDetokenizer(tokenizer, context)
        pieces = [fast.add(event) for event in events] + [fast.flush()]
        assert pieces == [slow.add(event) for event in events] + [slow.flush()]
        assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True)


def test_text_decoder_equals_tokenizer_decode(tokenizer):
    decoder = TextDecoder(tokenizer)
    ids = tokenizer.encode("".join(TRICKY)) + [tokenizer.eos_token_id]
    for window in [ids, ids[:1], ids[3:4], ids[5:9], [tokenizer.eos_token_id], []]:
        expected = tokenizer.decode(window, skip_special_tokens=True)
        assert decoder.decode(window) == expected
        assert decoder.decode(window) == expected  # the cached single-token text too


def test_one_backend_decode_per_token_in_the_steady_state(tokenizer):
    decoder = TextDecoder(tokenizer)
    calls = []
    inner = decoder._decode
    decoder._decode = lambda ids: calls.append(list(ids)) or inner(ids)
    ids = tokenizer.encode(" the quick brown fox jumps over the lazy dog")
    detokenizer = IncrementalDetokenizer(tokenizer, [], decoder)
    for token_id in ids:
        detokenizer.add([token_id])
    distinct = len(set(ids))
    assert len(calls) <= len(ids) + distinct  # one window decode each, plus first sight of a token


def test_the_fast_tokenizer_is_decoded_by_its_backend_and_others_by_decode(tokenizer):
    from gateway.output.detokenizer import _backend_decode

    assert _backend_decode(tokenizer) is not None
    assert _backend_decode(SlowTokenizer(tokenizer)) is None
