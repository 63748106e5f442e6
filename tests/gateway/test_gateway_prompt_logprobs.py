"""Prompt logprobs through the gateway and a real Redis: `echo` with `logprobs` (OpenAI's legacy
shape, streamed and not), `max_tokens: 0`, and vLLM's `prompt_logprobs` field. A fake worker
publishes the events a worker would (the values themselves are checked against transformers in
tests/engine/test_prompt_logprobs.py and tests/integration/test_worker_service.py)."""

from __future__ import annotations

import json

import httpx
import pytest

from kvfleet.gateway.app import create_app
from kvfleet.shared.settings import GatewaySettings
from kvfleet.shared.wire import GenerationRequest, Keys, TokenEvent, TokenLogprob
from tests.gateway.fake_worker import FakeWorker
from tests.gateway.fakes import token_events
from tests.gateway.helpers import MODEL, sse_events

PREFIX = "kvplp:"
OTHER = 17  # the alternative every position reports beside the prompt's own token


def prompt_entries(request: GenerationRequest) -> list[TokenLogprob]:
    """What a worker reports for prompt token i + 1: logprob -(i + 1) / 10, rank i + 1."""
    n = request.params.prompt_logprobs
    return [TokenLogprob(t, -(i + 1) / 10, [(OTHER, -0.01), (t, -(i + 1) / 10)][:n], i + 1)
            for i, t in enumerate(request.prompt_token_ids[1:])]


def script_for(tokenizer, text: str):
    ids = tokenizer.encode(text)

    def script(request: GenerationRequest) -> list[TokenEvent]:
        out = ids[:request.params.max_tokens]
        events = token_events(out, prompt_tokens=len(request.prompt_token_ids),
                              finish_reason="length", logprobs=request.params.logprobs is not None)
        if request.params.prompt_logprobs is not None:
            events[0].prompt_logprobs = prompt_entries(request)
        return events
    return script


@pytest.fixture
async def post(redis_url, tokenizer, model_info):
    settings = GatewaySettings(redis_url=redis_url, model=MODEL, key_prefix=PREFIX,
                               request_timeout_s=30, first_event_timeout_s=5)

    async def send(path: str, body: dict, text: str = " world and more") -> tuple[httpx.Response, list]:
        app = create_app(settings, None, tokenizer, model_info=model_info)  # one lifespan each
        async with FakeWorker(redis_url, Keys(PREFIX), MODEL, script_for(tokenizer, text)) as w:
            async with app.router.lifespan_context(app):
                transport = httpx.ASGITransport(app=app)
                async with httpx.AsyncClient(transport=transport, base_url="http://gw") as http:
                    response = await http.post(path, json={"model": MODEL, **body})
        return response, w.received
    return send


def token_texts(tokenizer, ids: list[int]) -> list[str]:
    return [tokenizer.decode([t]) for t in ids]


async def test_echo_with_logprobs_puts_the_prompt_tokens_first(post, tokenizer):
    prompt = "The quick brown fox"
    prompt_ids = tokenizer.encode(prompt)
    response, [request] = await post("/v1/completions", {
        "prompt": prompt, "echo": True, "logprobs": 1, "max_tokens": 2})
    assert response.status_code == 200, response.text
    assert request.params.prompt_logprobs == 1 and request.params.logprobs == 1
    choice = response.json()["choices"][0]
    assert choice["text"].startswith(prompt)
    logprobs = choice["logprobs"]
    n = len(prompt_ids)
    assert logprobs["tokens"][:n] == token_texts(tokenizer, prompt_ids)
    assert len(logprobs["tokens"]) == n + 2
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert logprobs["token_logprobs"][1:n] == pytest.approx([-(i + 1) / 10 for i in range(n - 1)])
    # the top-1 alternative and the prompt's own token
    assert logprobs["top_logprobs"][1] == {tokenizer.decode([OTHER]): -0.01,
                                           tokenizer.decode([prompt_ids[1]]): -0.1}
    assert logprobs["text_offset"][:2] == [0, len(logprobs["tokens"][0])]
    assert logprobs["text_offset"][n] == len(prompt)  # the completion starts after the echo
    assert "prompt_logprobs" not in choice  # vLLM's field only when asked for


async def test_max_tokens_zero_scores_the_prompt(post, tokenizer):
    prompt_ids = tokenizer.encode("Paris is the capital of France")
    response, [request] = await post("/v1/completions", {
        "prompt": prompt_ids, "echo": True, "logprobs": 0, "max_tokens": 0})
    assert response.status_code == 200, response.text
    assert request.params.max_tokens == 0
    body = response.json()
    choice = body["choices"][0]
    assert choice["text"] == tokenizer.decode(prompt_ids)
    assert choice["finish_reason"] == "length"
    assert len(choice["logprobs"]["tokens"]) == len(prompt_ids)
    assert sum(choice["logprobs"]["token_logprobs"][1:]) == pytest.approx(
        sum(-(i + 1) / 10 for i in range(len(prompt_ids) - 1)))
    assert body["usage"]["completion_tokens"] == 0


async def test_streamed_echo_carries_the_prompt_logprobs(post, tokenizer):
    prompt = "Hello there friend"
    prompt_ids = tokenizer.encode(prompt)
    response, _ = await post("/v1/completions", {
        "prompt": prompt, "echo": True, "logprobs": 0, "max_tokens": 2, "stream": True})
    assert response.status_code == 200, response.text
    chunks = [json.loads(e) for e in sse_events(response.text)[:-1]]
    first = chunks[0]["choices"][0]
    assert first["text"] == prompt
    assert first["logprobs"]["tokens"] == token_texts(tokenizer, prompt_ids)
    assert first["logprobs"]["token_logprobs"][0] is None
    later = [c["choices"][0]["logprobs"] for c in chunks[1:] if c["choices"][0]["logprobs"]]
    assert later and later[0]["text_offset"][0] == len(prompt)


async def test_vllm_prompt_logprobs_field_on_chat_and_completions(post, tokenizer):
    response, [request] = await post("/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}], "prompt_logprobs": 1, "max_tokens": 2})
    assert response.status_code == 200, response.text
    field = response.json()["choices"][0]["prompt_logprobs"]
    prompt_ids = request.prompt_token_ids
    assert len(field) == len(prompt_ids) and field[0] is None
    second = field[1]
    assert second[str(prompt_ids[1])] == {"logprob": -0.1, "rank": 1,
                                          "decoded_token": tokenizer.decode([prompt_ids[1]])}
    assert second[str(OTHER)]["rank"] == 1 and second[str(OTHER)]["logprob"] == -0.01
    response, _ = await post("/v1/completions", {"prompt": "a b c", "prompt_logprobs": 0,
                                                 "max_tokens": 1})
    field = response.json()["choices"][0]["prompt_logprobs"]
    assert field[0] is None and all(len(entry) == 1 for entry in field[1:])


@pytest.mark.parametrize("body", [
    {"prompt": "x", "prompt_logprobs": 1, "stream": True},
    {"prompt": "x", "prompt_logprobs": 21},
    {"prompt": "x", "max_tokens": -1},
])
async def test_bad_prompt_logprobs_requests_are_400s(post, body):
    response, received = await post("/v1/completions", body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    assert not received
