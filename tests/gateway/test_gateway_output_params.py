"""The text-side parameters clients send (vLLM's semantics): stop tokens' text, stop strings
with min_tokens and include_stop_str_in_output, special tokens, priority, default max_tokens,
content parts."""

from __future__ import annotations

import pytest

from tests.gateway.fakes import token_events
from tests.gateway.helpers import CONTEXT_LENGTH, MODEL


async def complete(http, **body):
    response = await http.post("/v1/completions", json={"model": MODEL, "prompt": "Say:", **body})
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def answer(engine, tokenizer, ids):
    engine.responder = lambda request: token_events(
        ids, prompt_tokens=len(request.prompt_token_ids))


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
    assert await complete(http, stop=["STOP"]) == "one two "
    say("one two STOP three")
    assert await complete(http, stop=["STOP"], include_stop_str_in_output=True) == "one two STOP"


async def test_min_tokens_keeps_an_early_stop_string(http, engine, tokenizer, say):
    text = "ab STOP cd STOP ef"
    ids = say(text, eos=False)
    first_stop_end = len(tokenizer.encode("ab STOP"))
    assert await complete(http, stop=["STOP"]) == "ab "
    say(text, eos=False)
    # the first STOP ends inside the first min_tokens tokens: it is text; the second ends it
    assert await complete(http, stop=["STOP"], min_tokens=first_stop_end + 1) == "ab STOP cd "
    assert first_stop_end + 1 < len(ids)


async def test_special_tokens_shown_on_request(http, engine, tokenizer):
    ids = tokenizer.encode("a") + [tokenizer.convert_tokens_to_ids("<|im_start|>")] + \
        tokenizer.encode("b")
    answer(engine, tokenizer, ids)
    assert await complete(http) == "ab"
    answer(engine, tokenizer, ids)
    assert await complete(http, skip_special_tokens=False) == "a<|im_start|>b"


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
