"""Unit tests of the stop checker: token ids with no tokenizer, stop strings with a real one."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from kvfleet.shared.models import DEFAULT_MODEL, resolve_model_path
from kvfleet.shared.wire import RequestStatus, SamplingParams
from kvfleet.worker.engine.core.stopping import Stop, StopChecker

EOS = 2
STOPPED = RequestStatus.FINISHED_STOPPED
LENGTH = RequestStatus.FINISHED_LENGTH


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(resolve_model_path(DEFAULT_MODEL))


@pytest.fixture
def checker() -> StopChecker:
    return StopChecker(eos_token_ids=[EOS, 0], max_model_len=100)


def test_plain_tokens_do_not_stop(checker):
    assert checker.check(10, [5, 6, 7], SamplingParams(max_tokens=16)) is None


@pytest.mark.parametrize("eos", [EOS, 0])
def test_eos_stops(checker, eos):
    assert checker.check(10, [5, eos], SamplingParams()) == STOPPED


def test_ignore_eos_keeps_going(checker):
    assert checker.check(10, [5, EOS], SamplingParams(ignore_eos=True)) is None


def test_stop_token_ids_stop_even_with_ignore_eos(checker):
    params = SamplingParams(stop_token_ids=[9], ignore_eos=True)
    assert checker.check(10, [5, 9], params) == STOPPED
    assert checker.check(10, [9, 5], params) is None  # only the last token counts


def test_nothing_stops_before_min_tokens(checker):
    params = SamplingParams(min_tokens=3, stop_token_ids=[9])
    assert checker.check(10, [5, EOS], params) is None
    assert checker.check(10, [5, 9], params) is None
    assert checker.check(10, [5, 6, EOS], params) == STOPPED


def test_max_tokens(checker):
    params = SamplingParams(max_tokens=3)
    assert checker.check(10, [5, 6], params) is None
    assert checker.check(10, [5, 6, 7], params) == LENGTH


def test_context_length(checker):
    params = SamplingParams(max_tokens=1000)
    assert checker.check(97, [5, 6], params) is None
    assert checker.check(97, [5, 6, 7], params) == LENGTH  # 97 + 3 == max_model_len


def test_stop_beats_length_on_the_same_token(checker):
    assert checker.check(10, [5, 6, EOS], SamplingParams(max_tokens=3)) == STOPPED
    assert checker.check(98, [5, EOS], SamplingParams(max_tokens=100)) == STOPPED


def test_min_tokens_does_not_hold_off_length(checker):
    assert checker.check(10, [5, 6], SamplingParams(max_tokens=2, min_tokens=5)) == LENGTH


def test_stop_strings_need_a_tokenizer(checker):
    with pytest.raises(ValueError):
        checker.check(10, [5, 6], SamplingParams(stop=["x"]))


# --- stop strings ---------------------------------------------------------------------------------


def first_stop(checker: StopChecker, token_ids: list[int], params: SamplingParams) -> int | None:
    """Feed the tokens one by one, as the engine does: the output length at the first stop."""
    for n in range(1, len(token_ids) + 1):
        status = checker.check(5, token_ids[:n], params)
        if status is not None:
            assert status == STOPPED
            return n
    return None


def test_stop_string_split_across_tokens(tokenizer):
    checker = StopChecker([tokenizer.eos_token_id], max_model_len=10_000, tokenizer=tokenizer)
    token_ids = tokenizer.encode("Hello world, this is the end of it.")
    pieces = [tokenizer.decode([t]) for t in token_ids]
    assert pieces[5:7] == [" the", " end"]  # the stop string spans two tokens
    assert first_stop(checker, token_ids, SamplingParams(stop=["the end"], max_tokens=100)) == 7
    # inside one token, and one of several stop strings
    params = SamplingParams(stop=["nothing", "orl"], max_tokens=100)
    assert first_stop(checker, token_ids, params) == 2
    assert first_stop(checker, token_ids, SamplingParams(stop=["the ends"], max_tokens=100)) is None


def test_stop_string_inside_a_multibyte_character(tokenizer):
    checker = StopChecker([tokenizer.eos_token_id], max_model_len=10_000, tokenizer=tokenizer)
    token_ids = tokenizer.encode("ok 🦩 bird")
    assert [tokenizer.decode([t]) for t in token_ids[2:4]] == ["\ufffd", "\ufffd"]  # byte pieces
    assert first_stop(checker, token_ids, SamplingParams(stop=["🦩"], max_tokens=100)) == 4
    assert first_stop(checker, token_ids, SamplingParams(stop=["ok 🦩 b"], max_tokens=100)) == 5


def test_stop_string_at_the_end_of_a_long_output_decodes_a_short_window(tokenizer):
    decoded_lengths: list[int] = []

    class CountingTokenizer:
        def decode(self, token_ids, skip_special_tokens=True):
            decoded_lengths.append(len(token_ids))
            return tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    checker = StopChecker([], max_model_len=100_000, tokenizer=CountingTokenizer())
    filler = tokenizer.encode(" and so on" * 700)
    ending = tokenizer.encode(" until THE END")
    params = SamplingParams(stop=["THE END"], max_tokens=100_000)
    assert checker.check(5, filler, params) is None
    assert checker.check(5, filler + ending, params) == STOPPED
    assert len(filler) > 2000 and max(decoded_lengths) < 20


class PieceTokenizer:
    """Decodes ids to fixed strings; id 0 decodes to nothing (like a skipped special token), id 5
    is a special token that decodes to "<s>" unless special tokens are skipped."""

    PIECES = {0: "", 1: "a", 2: "b", 3: "c", 4: "xyz"}
    SPECIAL = {5: "<s>"}

    def decode(self, token_ids, skip_special_tokens=True):
        return "".join(self.PIECES.get(t, "" if skip_special_tokens else self.SPECIAL.get(t))
                       for t in token_ids)


def test_window_grows_over_tokens_that_decode_to_nothing():
    checker = StopChecker([], max_model_len=1000, tokenizer=PieceTokenizer())
    params = SamplingParams(stop=["abc"], max_tokens=1000)
    output = [4, 1] + [0] * 50 + [2, 0, 0, 3]
    assert first_stop(checker, output, params) == len(output)
    assert first_stop(checker, [1, 2, 4, 3], params) is None


# --- what stopped it (the final event's stop_reason / text_after_stop) --------------------------


def test_a_stop_token_is_its_id_and_eos_is_none(checker):
    params = SamplingParams(stop_token_ids=[9])
    assert checker.find_stop([5, 9], params) == Stop(9, 0)
    assert checker.find_stop([5, EOS], params) == Stop(None, 0)
    assert checker.find_stop([5, 6], params) is None
    # EOS among the stop ids is still EOS (vLLM V1), unless EOS is ignored
    assert checker.find_stop([5, EOS], SamplingParams(stop_token_ids=[EOS])) == Stop(None, 0)
    params = SamplingParams(stop_token_ids=[EOS], ignore_eos=True)
    assert checker.find_stop([5, EOS], params) == Stop(EOS, 0)


def test_a_stop_string_reports_itself_and_the_text_after_it():
    checker = StopChecker([], max_model_len=1000, tokenizer=PieceTokenizer())
    params = SamplingParams(stop=["zz", "bx"], max_tokens=1000)
    assert checker.find_stop([1, 2], params) is None
    assert checker.find_stop([1, 2, 4], params) == Stop("bx", 2)  # "ab|xyz": "yz" follows
    # several end in the last token's text: the earliest-starting one, the shorter on a tie
    params = SamplingParams(stop=["yz", "bxy", "bx"], max_tokens=1000)
    assert checker.find_stop([1, 2, 4], params) == Stop("bx", 2)


def test_the_stop_is_described_again_from_the_same_tokens(tokenizer):
    """A request resumed with all its tokens finishes at once: its stop is found again."""
    checker = StopChecker([tokenizer.eos_token_id], max_model_len=10_000, tokenizer=tokenizer)
    token_ids = tokenizer.encode("Hello world, this is the end of it.")
    params = SamplingParams(stop=["is the"], max_tokens=100)
    n = first_stop(checker, token_ids, params)
    text = tokenizer.decode(token_ids[:n])
    stop = checker.find_stop(token_ids[:n], params)
    assert stop.reason == "is the"
    assert text[:len(text) - stop.text_after].endswith("is the")


def test_stop_strings_match_the_text_as_the_client_sees_it():
    """skip_special_tokens False: a special token's text is part of the output, so a stop string
    can match across or next to it, and one that only matches without it does not."""
    checker = StopChecker([], max_model_len=1000, tokenizer=PieceTokenizer())
    output = [1, 5, 2]  # "a" <s> "b"
    shown = dict(max_tokens=1000, skip_special_tokens=False)
    assert first_stop(checker, output, SamplingParams(stop=["ab"], max_tokens=1000)) == 3
    assert first_stop(checker, output, SamplingParams(stop=["ab"], **shown)) is None
    assert first_stop(checker, output, SamplingParams(stop=["a<s"], **shown)) == 2
    assert checker.find_stop([1, 5], SamplingParams(stop=["<s>"], **shown)) == Stop("<s>", 0)
    assert first_stop(checker, output, SamplingParams(stop=["<s>"], max_tokens=1000)) is None


def test_special_tokens_shown_with_a_real_tokenizer(tokenizer):
    checker = StopChecker([tokenizer.eos_token_id], max_model_len=10_000, tokenizer=tokenizer)
    special = tokenizer.convert_tokens_to_ids("<|im_start|>")  # not EOS
    output = tokenizer.encode("Yes") + [special] + tokenizer.encode("\nmore")
    stop = ["<|im_start|>"]
    assert first_stop(checker, output, SamplingParams(stop=stop, max_tokens=100)) is None
    params = SamplingParams(stop=stop, max_tokens=100, skip_special_tokens=False)
    assert first_stop(checker, output, params) == len(tokenizer.encode("Yes")) + 1


def test_a_stop_string_inside_the_first_min_tokens_tokens_is_text():
    checker = StopChecker([], max_model_len=1000, tokenizer=PieceTokenizer())
    output = [1, 2, 3, 3, 1, 2, 4]  # "abcc" then "ab" again
    params = SamplingParams(stop=["ab"], max_tokens=1000)
    assert first_stop(checker, output, params) == 2
    params.min_tokens = 3
    assert first_stop(checker, output, params) == 6
    assert checker.find_stop(output[:2], params) is None
    # an occurrence that ends on the min_tokens-th token stops there
    params.min_tokens = 2
    assert first_stop(checker, output, params) == 2
