"""/v1/completions and /v1/models handlers against a scripted fake engine."""

from __future__ import annotations

import json

import httpx
import openai

from tests.gateway.fakes import token_events
from tests.gateway.helpers import CONTEXT_LENGTH, MODEL, sse_events


async def test_non_stream_shape(http, engine, say, tokenizer):
    say(" world", cached_tokens=1)
    response = await http.post("/v1/completions", json={"model": MODEL, "prompt": "Hello"})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["id"].startswith("cmpl-") and body["object"] == "text_completion"
    assert body["choices"] == [{"index": 0, "text": " world", "logprobs": None,
                                "finish_reason": "stop", "stop_reason": None}]  # EOS
    assert body["usage"]["prompt_tokens"] == len(tokenizer.encode("Hello"))
    assert body["usage"]["prompt_tokens_details"] == {"cached_tokens": 1}
    assert engine.submitted[0].prompt_token_ids == tokenizer.encode("Hello")
    assert engine.submitted[0].req_id == body["id"]


async def test_prompt_forms(http, engine, say, tokenizer):
    say("x")
    response = await http.post("/v1/completions", json={"model": MODEL, "prompt": [5, 6, 7]})
    assert response.status_code == 200 and engine.submitted[-1].prompt_token_ids == [5, 6, 7]
    engine.submitted.clear()
    response = await http.post("/v1/completions", json={"model": MODEL, "prompt": [[5], [6, 7]]})
    assert [r.prompt_token_ids for r in engine.submitted] == [[5], [6, 7]]
    assert [c["index"] for c in response.json()["choices"]] == [0, 1]
    engine.submitted.clear()
    response = await http.post("/v1/completions", json={"model": MODEL, "prompt": ["a b", "c"]})
    assert [r.prompt_token_ids for r in engine.submitted] == [tokenizer.encode("a b"),
                                                           tokenizer.encode("c")]


async def test_several_prompts_times_n(http, engine, tokenizer):
    def responder(request):
        return token_events(tokenizer.encode(f"#{request.req_id[-1]}"),
                            prompt_tokens=len(request.prompt_token_ids))
    engine.responder = responder
    response = await http.post("/v1/completions", json={
        "model": MODEL, "prompt": [[1, 2, 3], [4]], "n": 2, "seed": 9})
    body = response.json()
    assert [c["text"] for c in body["choices"]] == ["#0", "#1", "#2", "#3"]
    assert [r.prompt_token_ids for r in engine.submitted] == [[1, 2, 3], [1, 2, 3], [4], [4]]
    assert [r.params.seed for r in engine.submitted] == [9, 10, 11, 12]
    assert body["usage"]["prompt_tokens"] == 3 + 1  # each prompt counted once


async def test_echo(http, say):
    say(" there")
    response = await http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi",
                                                        "echo": True})
    assert response.json()["choices"][0]["text"] == "Hi there"
    response = await http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi",
                                                        "echo": True, "stream": True})
    chunks = [json.loads(e) for e in sse_events(response.text)[:-1]]
    assert chunks[0]["choices"][0]["text"] == "Hi"
    assert "".join(c["choices"][0]["text"] for c in chunks) == "Hi there"


async def test_continuous_usage_stats_count_every_choice(http, say):
    say(" a b c", eos=False, per_event=1, finish_reason="length")
    response = await http.post("/v1/completions", json={
        "model": MODEL, "prompt": [[5, 6], [7]], "n": 2, "stream": True, "max_tokens": 3,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    assert response.status_code == 200, response.text
    usages = [json.loads(e)["usage"] for e in sse_events(response.text)[:-1]]
    assert all(u["prompt_tokens"] == 3 for u in usages)  # each prompt once
    completions = [u["completion_tokens"] for u in usages]
    assert completions == sorted(completions) and completions[-1] == 4 * 3


async def test_stream_chunks_and_usage(http, say):
    say(" a b c", per_event=2, finish_reason="length")
    response = await http.post("/v1/completions", json={
        "model": MODEL, "prompt": "x", "stream": True, "max_tokens": 4,
        "stream_options": {"include_usage": True}})
    events = sse_events(response.text)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "text_completion" for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == " a b c"
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] == 1 + 4


async def test_stop_string_truncates(http, say):
    say("12, 13, 14, 15", per_event=1)
    response = await http.post("/v1/completions", json={"model": MODEL, "prompt": "11,",
                                                        "stop": [", 14", "zzz"]})
    assert response.json()["choices"][0] == {"index": 0, "text": "12, 13", "logprobs": None,
                                             "finish_reason": "stop", "stop_reason": ", 14"}


async def test_logprobs_shape(http, engine, tokenizer):
    ids = tokenizer.encode(" foo bar")
    engine.responder = lambda request: token_events(ids, prompt_tokens=1, logprobs=True)
    response = await http.post("/v1/completions", json={"model": MODEL, "prompt": "x",
                                                        "logprobs": 2})
    logprobs = response.json()["choices"][0]["logprobs"]
    assert logprobs["tokens"] == [" foo", " bar"]
    assert logprobs["token_logprobs"] == [-0.5, -0.5]
    assert logprobs["top_logprobs"][0] == {" foo": -0.5, tokenizer.decode([ids[0] + 1]): -1.5}
    assert logprobs["text_offset"] == [0, 4]
    assert engine.submitted[0].params.logprobs == 2


async def test_models_health_ready(http, engine):
    models = (await http.get("/v1/models")).json()
    assert models["object"] == "list"
    assert models["data"][0]["id"] == MODEL and models["data"][0]["object"] == "model"
    assert models["data"][0]["max_model_len"] == CONTEXT_LENGTH
    assert (await http.get("/health")).status_code == 200
    assert (await http.get("/ready")).status_code == 200
    engine.ready = False
    not_ready = await http.get("/ready")
    assert not_ready.status_code == 503 and "error" in not_ready.json()


async def test_openai_sdk_streams_chat(app, say):
    """The official client parses our chunks (it is what users will point at us)."""
    ids = say("Hello from kvfleet")
    http_client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app))
    client = openai.AsyncOpenAI(base_url="http://gateway/v1", api_key="none",
                                http_client=http_client)
    stream = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], stream=True,
        stream_options={"include_usage": True})
    pieces, usage = [], None
    async for chunk in stream:
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
        usage = chunk.usage or usage
    completion = await client.completions.create(model=MODEL, prompt="hi", max_tokens=5)
    await http_client.aclose()
    assert "".join(pieces) == "Hello from kvfleet"
    assert usage.completion_tokens == len(ids) and usage.prompt_tokens_details.cached_tokens == 0
    assert completion.choices[0].text == "Hello from kvfleet"


async def test_create_app_defaults_to_redis_and_the_models_own_tokenizer_and_context(redis_url):
    from kvfleet.gateway.app import create_app
    from kvfleet.gateway.fleet.redis_client import RedisEngineClient
    from kvfleet.shared.settings import GatewaySettings

    app = create_app(GatewaySettings(redis_url=redis_url, model=MODEL))
    assert isinstance(app.state.client, RedisEngineClient)
    assert app.state.model.served_id == MODEL
    assert app.state.model.context_length == 8192  # max_position_embeddings of SmolLM2-135M
