"""/v1/chat/completions handlers against a scripted fake engine."""

from __future__ import annotations

import json

from kvfleet.shared.wire import TokenEvent, Usage
from tests.gateway.fakes import token_events
from tests.gateway.helpers import MODEL, sse_events

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]


async def test_non_stream_shape_and_usage(http, engine, say, tokenizer):
    say("Hello! How can I help?", cached_tokens=4)
    response = await http.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["id"].startswith("cmpl-") and body["object"] == "chat.completion"
    assert body["model"] == MODEL and isinstance(body["created"], int)
    [choice] = body["choices"]
    assert choice == {"index": 0, "logprobs": None, "finish_reason": "stop", "stop_reason": None,
                      "message": {"role": "assistant", "content": "Hello! How can I help?"}}
    [request] = engine.submitted
    prompt_len = len(request.prompt_token_ids)
    completion_len = len(tokenizer.encode("Hello! How can I help?")) + 1
    assert body["usage"] == {"prompt_tokens": prompt_len, "completion_tokens": completion_len,
                             "total_tokens": prompt_len + completion_len,
                             "prompt_tokens_details": {"cached_tokens": 4}}
    # The gateway applied the chat template with the generation prompt; the worker sees ids only.
    expected = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)["input_ids"]
    assert request.prompt_token_ids == list(expected)
    assert request.req_id == body["id"]


async def test_stream_chunk_format_with_usage(http, say):
    say("Hi there", per_event=1)
    response = await http.post("/v1/chat/completions", json={
        "model": MODEL, "messages": MESSAGES, "stream": True,
        "stream_options": {"include_usage": True}})
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    events = sse_events(response.text)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert len({c["id"] for c in chunks}) == 1
    assert all(c["object"] == "chat.completion.chunk" and c["model"] == MODEL for c in chunks)
    assert chunks[0]["choices"] == [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                     "logprobs": None, "finish_reason": None}]
    contents = [c["choices"][0]["delta"]["content"] for c in chunks[1:-2]]
    assert "".join(contents) == "Hi there" and all(contents)
    assert all("role" not in c["choices"][0]["delta"] for c in chunks[1:-1])
    assert chunks[-2]["choices"] == [{"index": 0, "delta": {}, "logprobs": None,
                                      "finish_reason": "stop", "stop_reason": None}]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3
    assert all(c["usage"] is None for c in chunks[:-1])


async def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(http, say, engine):
    ids = say("Hi there", per_event=1)
    response = await http.post("/v1/chat/completions", json={
        "model": MODEL, "messages": MESSAGES, "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    assert response.status_code == 200, response.text
    chunks = [json.loads(e) for e in sse_events(response.text)[:-1]]
    prompt_tokens = len(engine.submitted[0].prompt_token_ids)
    usages = [c["usage"] for c in chunks]
    assert all(u["prompt_tokens"] == prompt_tokens for u in usages)
    assert all(u["total_tokens"] == prompt_tokens + u["completion_tokens"] for u in usages)
    completions = [u["completion_tokens"] for u in usages]
    assert completions[0] == 0 and completions == sorted(completions)
    assert completions[-2] == completions[-1] == len(ids)  # the finish chunk, the usage chunk
    # without include_usage, vLLM sends no usage at all
    say("Hi there", per_event=1)
    response = await http.post("/v1/chat/completions", json={
        "model": MODEL, "messages": MESSAGES, "stream": True,
        "stream_options": {"continuous_usage_stats": True}})
    assert all(json.loads(e)["usage"] is None for e in sse_events(response.text)[:-1])


async def test_stream_without_include_usage_has_no_usage_chunk(http, say):
    say("Hi")
    response = await http.post("/v1/chat/completions", json={
        "model": MODEL, "messages": MESSAGES, "stream": True})
    chunks = [json.loads(e) for e in sse_events(response.text)[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert all(c["choices"] for c in chunks)


async def test_multibyte_character_split_over_tokens_is_never_broken(http, engine, tokenizer):
    text = "Smile 😀, heart ❤️ and 日本語!"
    ids = tokenizer.encode(text)
    # The emoji really is spread over several byte-level tokens of this tokenizer.
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)
    engine.responder = lambda request: token_events(ids, prompt_tokens=5, per_event=1)
    response = await http.post("/v1/chat/completions", json={
        "model": MODEL, "messages": MESSAGES, "stream": True})
    chunks = [json.loads(e) for e in sse_events(response.text)[:-1]]
    contents = [c["choices"][0]["delta"].get("content", "") for c in chunks]
    assert all("\ufffd" not in piece for piece in contents)
    assert "".join(contents) == text


async def test_stale_attempt_and_repeated_tokens_are_dropped(http, engine, tokenizer):
    ids = tokenizer.encode("one two three four five six")
    assert len(ids) == 6
    garbage = tokenizer.encode(" GARBAGE")
    script = [
        TokenEvent(seq=0, attempt=0, token_ids=ids[0:2]),
        TokenEvent(seq=2, attempt=0, token_ids=ids[2:3]),
        # attempt 0's worker died; attempt 1 resumed from a checkpoint of two tokens and
        # repeats token 2, which the client already has.
        TokenEvent(seq=2, attempt=1, token_ids=ids[2:4]),
        TokenEvent(seq=3, attempt=0, token_ids=garbage),  # the stale worker is still talking
        TokenEvent(seq=4, attempt=1, token_ids=ids[4:4]),
        TokenEvent(seq=3, attempt=1, token_ids=ids[3:5]),  # a repeat of token 3
        TokenEvent(seq=5, attempt=0, token_ids=garbage, finish_reason="stop",
                   usage=Usage(5, 99, 0)),  # a stale final event
        TokenEvent(seq=5, attempt=1, token_ids=ids[5:], finish_reason="length",
                   usage=Usage(5, 6, 0)),
    ]
    engine.responder = lambda request: list(script)
    for stream in (False, True):
        response = await http.post("/v1/chat/completions", json={
            "model": MODEL, "messages": MESSAGES, "stream": stream})
        if stream:
            chunks = [json.loads(e) for e in sse_events(response.text)[:-1]]
            text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
            finish = chunks[-1]["choices"][0]["finish_reason"]
        else:
            text = response.json()["choices"][0]["message"]["content"]
            finish = response.json()["choices"][0]["finish_reason"]
            assert response.json()["usage"]["completion_tokens"] == 6
        assert text == "one two three four five six"
        assert finish == "length"


async def test_stop_string_truncates_and_is_never_streamed(http, say, engine):
    say("The answer is 42.\nUser: next question", per_event=1)
    for stream in (False, True):
        response = await http.post("/v1/chat/completions", json={
            "model": MODEL, "messages": MESSAGES, "stop": ["\nUser:"], "stream": stream})
        if stream:
            chunks = [json.loads(e) for e in sse_events(response.text)[:-1]]
            pieces = [c["choices"][0]["delta"].get("content", "") for c in chunks]
            text = "".join(pieces)
            assert not any("\n" in piece for piece in pieces)  # held back, then dropped
            assert all("stop_reason" not in c["choices"][0] for c in chunks[:-1])
            last = chunks[-1]["choices"][0]
        else:
            last = response.json()["choices"][0]
            text = last["message"]["content"]
        assert text == "The answer is 42."
        assert (last["finish_reason"], last["stop_reason"]) == ("stop", "\nUser:")
    assert engine.submitted[0].params.stop == ["\nUser:"]


async def test_n_choices_are_separate_requests_merged_by_index(http, engine, tokenizer):
    answers = ["Red", "Green", "Blue"]

    def responder(request):
        index = int(request.req_id.rsplit("-", 1)[1])
        return token_events(tokenizer.encode(answers[index]), prompt_tokens=7,
                            finish_reason="length", cached_tokens=2)
    engine.responder = responder
    response = await http.post("/v1/chat/completions", json={
        "model": MODEL, "messages": MESSAGES, "n": 3, "seed": 100})
    body = response.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert [c["message"]["content"] for c in body["choices"]] == answers
    assert [c["finish_reason"] for c in body["choices"]] == ["length"] * 3
    base = body["id"]
    assert [r.req_id for r in engine.submitted] == [f"{base}-{i}" for i in range(3)]
    assert [r.params.seed for r in engine.submitted] == [100, 101, 102]
    # The prompt is counted once, the completions of every choice are summed.
    assert body["usage"]["prompt_tokens"] == 7
    assert body["usage"]["completion_tokens"] == sum(len(tokenizer.encode(a)) for a in answers)


async def test_n_choices_stream(http, engine, tokenizer):
    engine.responder = lambda request: token_events(tokenizer.encode("ab cd"), prompt_tokens=3)
    response = await http.post("/v1/chat/completions", json={
        "model": MODEL, "messages": MESSAGES, "n": 2, "stream": True})
    chunks = [json.loads(e) for e in sse_events(response.text)[:-1]]
    for index in (0, 1):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == index]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        assert "".join(c["delta"].get("content", "") for c in mine) == "ab cd"
        assert mine[-1]["finish_reason"] == "stop"


async def test_logprobs_shape(http, engine, tokenizer):
    ids = tokenizer.encode("Hi 😀")
    engine.responder = lambda request: token_events(ids, prompt_tokens=3, logprobs=True)
    response = await http.post("/v1/chat/completions", json={
        "model": MODEL, "messages": MESSAGES, "logprobs": True, "top_logprobs": 2})
    choice = response.json()["choices"][0]
    content = choice["logprobs"]["content"]
    assert len(content) == len(ids)
    assert engine.submitted[0].params.logprobs == 2
    for entry in content:
        assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
        assert entry["logprob"] == -0.5 and len(entry["top_logprobs"]) == 2
        assert entry["top_logprobs"][1]["logprob"] == -1.5
    # The token bytes, joined, are exactly the UTF-8 of the text (even where a token alone is not).
    assert b"".join(bytes(e["bytes"]) for e in content) == "Hi 😀".encode()


async def test_parameters_reach_the_engine(http, engine, say):
    say("ok")
    response = await http.post("/v1/chat/completions", json={
        "model": MODEL, "messages": MESSAGES, "max_tokens": 50, "max_completion_tokens": 20,
        "temperature": 0, "top_p": 0.9, "top_k": 40, "min_p": 0.05, "repetition_penalty": 1.1,
        "presence_penalty": 0.5, "frequency_penalty": -0.5, "stop": "END", "seed": 3,
        "min_tokens": 2, "ignore_eos": True, "priority": "batch", "skip_prefix_cache": True,
        "num_speculative_tokens": 0, "user": "alice", "some_unknown_field": {"x": 1}})
    assert response.status_code == 200, response.text
    [request] = engine.submitted
    params = request.params
    assert (params.max_tokens, params.temperature, params.top_p, params.top_k) == (20, 0.0, 0.9, 40)
    assert (params.min_p, params.repetition_penalty) == (0.05, 1.1)
    assert (params.presence_penalty, params.frequency_penalty) == (0.5, -0.5)
    assert (params.stop, params.seed, params.min_tokens, params.ignore_eos) == (["END"], 3, 2, True)
    assert params.skip_prefix_cache and params.logprobs is None
    assert params.num_speculative_tokens == 0
    assert request.priority == "batch" and request.model == MODEL


async def test_default_max_tokens_and_random_seed(http, engine, say, settings):
    say("ok")
    await http.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, "n": 2})
    first, second = engine.submitted
    assert first.params.max_tokens == settings.default_max_tokens
    assert first.params.seed is not None and second.params.seed == first.params.seed + 1


async def test_worker_error_is_503_not_500(http, engine):
    engine.responder = lambda request: [TokenEvent(seq=0, attempt=2, finish_reason="error",
                                                   error="poison request: delivered 3 times")]
    response = await http.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES})
    assert response.status_code == 503
    assert "poison request" in response.json()["error"]["message"]


async def test_worker_error_in_stream_is_an_error_event_then_done(http, engine, tokenizer):
    engine.responder = lambda request: [
        TokenEvent(seq=0, attempt=0, token_ids=tokenizer.encode("Hel")),
        TokenEvent(seq=1, attempt=0, finish_reason="abort")]
    response = await http.post("/v1/chat/completions", json={
        "model": MODEL, "messages": MESSAGES, "stream": True})
    events = sse_events(response.text)
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["type"] == "service_unavailable" and "abort" in error["message"]
    assert json.loads(events[1])["choices"][0]["delta"]["content"] == "Hel"


def test_default_temperature_follows_the_model_unless_configured(tmp_path):
    from transformers import GenerationConfig

    from kvfleet.gateway.openai.request_schemas import ChatCompletionRequest
    from kvfleet.gateway.models.tokenization import _generation_temperature

    GenerationConfig(do_sample=False).save_pretrained(tmp_path / "greedy")
    GenerationConfig(do_sample=True, temperature=0.6).save_pretrained(tmp_path / "sampled")
    assert _generation_temperature(str(tmp_path / "greedy")) == 0.0
    assert _generation_temperature(str(tmp_path / "sampled")) == 0.6
    assert _generation_temperature(str(tmp_path / "missing")) == 0.0
    request = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}])
    assert request.to_sampling_params(8, 1, default_temperature=0.0).temperature == 0.0
    explicit = ChatCompletionRequest(model="m", temperature=0.9,
                                     messages=[{"role": "user", "content": "hi"}])
    assert explicit.to_sampling_params(8, 1, default_temperature=0.0).temperature == 0.9
