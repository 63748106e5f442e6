"""Incremental detokenisation and the rendering of stop strings, on the real SmolLM2 tokenizer."""

from __future__ import annotations

import pytest

from kvfleet.gateway.output.detokenizer import IncrementalDetokenizer, StopStringRenderer, TextDecoder

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


def test_text_that_may_become_a_stop_string_is_held_back():
    stops = StopStringRenderer(["STOP", "\n\n"])
    assert stops.feed("abc S") == "abc "
    assert stops.feed("T") == ""
    assert stops.feed("x") == "STx"
    assert stops.feed("\n") == ""
    assert stops.finish("", "length") == "\n"  # no more text: the held tail is text


def test_a_complete_stop_string_the_worker_did_not_stop_at_is_text():
    """The worker decides (min_tokens, special tokens the client sees): a stop string that more
    text of the answer follows goes out; one that ends the text so far is held, since the token
    that completed it may be the last (its final event not read yet)."""
    stops = StopStringRenderer(["STOP"])
    assert stops.feed("ab STOP") == "ab "
    assert stops.feed(" cd, and the answer goes on ST") == "STOP cd, and the answer goes on "
    assert stops.feed("OP ef") == ""
    assert stops.finish("", "length") == "STOP ef"
    assert StopStringRenderer([]).feed("anything") == "anything"


def test_a_stop_read_before_its_final_event_is_cut_by_that_event():
    """A stream re-attached while the request ends reads the tokens up to the stop from the
    checkpoint, then gets the final event with nothing new: no text past the stop is sent."""
    stops = StopStringRenderer(["STOP"])
    assert stops.feed(" alpha beta STOP") == " alpha beta "
    assert stops.finish("", "stop", "STOP", 0) == ""
    stops = StopStringRenderer(["STOP"])
    assert stops.feed(" alpha beta STOP.") == " alpha beta "
    assert stops.finish("", "stop", "STOP", 1) == ""


@pytest.mark.parametrize("include, expected", [(False, "one two "), (True, "one two STOP")])
def test_the_text_is_cut_where_the_worker_said(include, expected):
    stops = StopStringRenderer(["STOP"], include_stop=include)
    assert stops.feed("one two ST") == "one two "
    # the last token's text was "OP thr": four characters follow the stop string
    assert "one two " + stops.finish("OP thr", "stop", "STOP", 4) == expected


def test_the_workers_stop_wins_over_an_earlier_occurrence():
    """The first "ab" was inside min_tokens (text, already sent); the worker stopped at the last."""
    stops = StopStringRenderer(["ab"])
    sent = stops.feed("xab ya")
    assert sent == "x"  # "ab" ends near the end of the text so far: held until the next event
    assert sent + stops.finish("b z", "stop", "ab", 2) == "xab y"
    stops = StopStringRenderer(["ab", "b"])  # the worker's choice among several, as it said
    assert stops.finish("ab", "stop", "b", 0) == "a"


def test_a_stop_token_or_a_length_limit_cuts_nothing():
    stops = StopStringRenderer(["STOP"])
    assert stops.feed("a ST") == "a "
    assert stops.finish("OP b", "stop", 7, 0) == "STOP b"  # the worker stopped on token 7
    stops = StopStringRenderer(["STOP"])
    assert stops.finish("a STOP b", "length") == "a STOP b"


def test_an_older_workers_final_event_is_cut_at_the_first_stop_string():
    """No `text_after_stop` (TokenEvent's compatibility rule): the first occurrence, the earliest
    starting one among several; empty stop strings are ignored."""
    stops = StopStringRenderer(["", "world", "lo w"])
    assert stops.finish("hello world", "stop") == "hel"
    stops = StopStringRenderer(["world"], include_stop=True)
    assert stops.finish("hello world and world", "stop") == "hello world"
    assert StopStringRenderer(["x"]).finish("no stop here", "stop") == "no stop here"


def test_a_stop_that_began_in_text_already_sent_cuts_what_is_left():
    """A stream resumed after a token inside the stop string: the part before was not its own."""
    stops = StopStringRenderer(["STOP"])
    assert stops.finish("OP tail", "stop", "STOP", 5) == ""


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
    from kvfleet.gateway.output.detokenizer import _backend_decode

    assert _backend_decode(tokenizer) is not None
    assert _backend_decode(SlowTokenizer(tokenizer)) is None
