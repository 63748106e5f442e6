"""The text-side parameters clients send (vLLM's semantics): stop tokens' text, stop strings
with min_tokens and include_stop_str_in_output, special tokens, priority, default max_tokens,
content parts."""

from __future__ import annotations

import json

import pytest

from tests.gateway.fakes import worker_events
from tests.gateway.helpers import CONTEXT_LENGTH, MODEL, sse_events


async def complete(http, **body):
    return (await choice(http, **body))["text"]


async def choice(http, **body):
    response = await http.post("/v1/completions", json={"model": MODEL, "prompt": "Say:", **body})
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


async def streamed(http, **body) -> tuple[list[str], dict]:
    """The text pieces of a streamed completion and its last choice."""
    response = await http.post("/v1/completions", json={"model": MODEL, "prompt": "Say:",
                                                        "stream": True, **body})
    chunks = [json.loads(e)["choices"][0] for e in sse_events(response.text)[:-1]]
    return [c["text"] for c in chunks], chunks[-1]


def answer(engine, tokenizer, ids, per_event=1):
    """The worker's answer runs to `ids` unless it stops first (a worker's StopChecker)."""
    engine.responder = lambda request: worker_events(request, ids, tokenizer,
                                                     per_event=per_event)


async def test_stop_token_text_is_left_out_unless_asked(http, engine, tokenizer):
    ids = tokenizer.encode("Hello world.")
    stop_id = ids[-1]  # "."
    answer(engine, tokenizer, ids)
    assert await complete(http, stop_token_ids=[stop_id]) == "Hello world"
    answer(engine, tokenizer, ids)
    assert await complete(http, stop_token_ids=[stop_id],
                          include_stop_str_in_output=True) == "Hello world."


async def test_stop_string_kept_with_include_stop_str(http, engine, say):
    say("one two STOP three")
    assert await choice(http, stop=["STOP"]) == {
        "index": 0, "text": "one two ", "logprobs": None, "finish_reason": "stop",
        "stop_reason": "STOP"}
    say("one two STOP three")
    assert await complete(http, stop=["STOP"], include_stop_str_in_output=True) == "one two STOP"


async def test_stop_reason_is_the_stop_token_id_or_none_for_eos(http, engine, tokenizer, say):
    ids = tokenizer.encode("Hello world.")
    answer(engine, tokenizer, ids)
    assert (await choice(http, stop_token_ids=[ids[-1]]))["stop_reason"] == ids[-1]
    say("Hello")  # then EOS
    last = await choice(http, stop_token_ids=[ids[-1]])
    assert (last["finish_reason"], last["stop_reason"]) == ("stop", None)
    pieces, last = await streamed(http, stop_token_ids=[ids[-1]])
    assert "".join(pieces) == "Hello" and last["stop_reason"] is None
    answer(engine, tokenizer, ids)
    pieces, last = await streamed(http, stop_token_ids=[ids[-1]])
    assert "".join(pieces) == "Hello world" and last["stop_reason"] == ids[-1]


async def test_no_text_past_a_stop_string_is_streamed(http, engine, tokenizer, say):
    say("one two STOP three", per_event=1)
    pieces, last = await streamed(http, stop=["STOP"])
    assert "".join(pieces) == "one two "
    assert (last["finish_reason"], last["stop_reason"]) == ("stop", "STOP")


async def test_min_tokens_keeps_an_early_stop_string(http, engine, tokenizer, say):
    text = "ab STOP cd STOP ef"
    ids = say(text, eos=False)
    first_stop_end = len(tokenizer.encode("ab STOP"))
    assert await complete(http, stop=["STOP"]) == "ab "
    # the first STOP ends inside the first min_tokens tokens: it is text; the second ends it
    for per_event in (1, len(ids)):  # one event spanning min_tokens was cut at the first STOP
        say(text, eos=False, per_event=per_event)
        assert await complete(http, stop=["STOP"], min_tokens=first_stop_end + 1) == "ab STOP cd "
        say(text, eos=False, per_event=per_event)
        pieces, _ = await streamed(http, stop=["STOP"], min_tokens=first_stop_end + 1)
        assert "".join(pieces) == "ab STOP cd "
    assert first_stop_end + 1 < len(ids)


async def test_special_tokens_shown_on_request(http, engine, tokenizer):
    ids = tokenizer.encode("a") + [tokenizer.convert_tokens_to_ids("<|im_start|>")] + \
        tokenizer.encode("b")
    answer(engine, tokenizer, ids)
    assert await complete(http) == "ab"
    answer(engine, tokenizer, ids)
    assert await complete(http, skip_special_tokens=False) == "a<|im_start|>b"


@pytest.mark.parametrize("stream", [False, True])
async def test_stop_strings_match_the_text_the_client_sees(http, engine, tokenizer, stream):
    """With special tokens shown, a stop string across one ends the answer, and one that only
    matches with them skipped does not (the worker used to decode without them, so it and the
    gateway stopped in different places)."""
    ids = tokenizer.encode("a") + [tokenizer.convert_tokens_to_ids("<|im_start|>")] + \
        tokenizer.encode("b c")
    shown = {"skip_special_tokens": False}

    async def text(**body):
        if stream:
            pieces, last = await streamed(http, **body)
            return "".join(pieces), last["stop_reason"]
        last = await choice(http, **body)
        return last["text"], last["stop_reason"]
    for body, expected in [
            ({"stop": ["<|im_start|>b"], **shown}, ("a", "<|im_start|>b")),
            ({"stop": ["t|>"], **shown}, ("a<|im_star", "t|>")),
            ({"stop": ["ab"], **shown}, ("a<|im_start|>b c", None)),
            ({"stop": ["ab"]}, ("", "ab")),
            ({"stop": ["<|im_start|>b"]}, ("ab c", None))]:
        answer(engine, tokenizer, ids)
        assert await text(**body) == expected, body


@pytest.mark.parametrize("priority, queue", [(0, "interactive"), (-5, "interactive"),
                                             (3, "batch"), ("batch", "batch")])
async def test_integer_priority(http, engine, say, priority, queue):
    say("x")
    await complete(http, priority=priority)
    assert engine.submitted[0].priority == queue


async def test_max_tokens_absent_is_the_rest_of_the_context(app, http, engine, say, settings):
    settings.default_max_tokens = None
    say("x")
    await complete(http)
    request = engine.submitted[0]
    assert request.params.max_tokens == CONTEXT_LENGTH - len(request.prompt_token_ids)


async def test_content_parts_are_joined_with_newlines(http, engine, say, tokenizer):
    say("ok")
    parts = [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]
    response = await http.post("/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": parts}]})
    assert response.status_code == 200
    assert "first\nsecond" in tokenizer.decode(engine.submitted[0].prompt_token_ids)
