"""/tokenize, /detokenize, /version, X-Request-Id, and a non-streaming request cancelled when its
client goes away."""

from __future__ import annotations

import asyncio
import json

from tests.gateway.helpers import CONTEXT_LENGTH, MODEL

MESSAGES = [{"role": "user", "content": "Hi there"}]


async def test_tokenize_prompt_and_messages(http, tokenizer):
    response = await http.post("/tokenize", json={"model": MODEL, "prompt": "Hello world",
                                                  "return_token_strs": True})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["tokens"] == tokenizer.encode("Hello world") and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == CONTEXT_LENGTH
    assert body["token_strs"] == tokenizer.convert_ids_to_tokens(body["tokens"])
    chat = (await http.post("/tokenize", json={"model": MODEL, "messages": MESSAGES})).json()
    expected = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)["input_ids"]
    assert chat["tokens"] == list(expected)


async def test_tokenize_counts_what_a_chat_request_sends(http, engine, say):
    say("ok")
    await http.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES})
    counted = (await http.post("/tokenize", json={"model": MODEL, "messages": MESSAGES})).json()
    assert counted["tokens"] == engine.submitted[0].prompt_token_ids


async def test_detokenize(http, tokenizer):
    ids = tokenizer.encode("Bonjour 🦩")
    response = await http.post("/detokenize", json={"model": MODEL, "tokens": ids})
    assert response.json() == {"prompt": "Bonjour 🦩"}
    bad = await http.post("/detokenize", json={"model": MODEL, "tokens": [10**9]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    wrong = await http.post("/detokenize", json={"model": "other", "tokens": ids})
    assert wrong.status_code == 404


async def test_tokenize_needs_one_input(http):
    response = await http.post("/tokenize", json={"model": MODEL})
    assert response.status_code == 400


async def test_version(http):
    response = await http.get("/version")
    assert response.status_code == 200 and response.json()["version"]


async def test_request_id_in_and_out(http, say):
    say("ok")
    given = await http.post("/v1/chat/completions", headers={"X-Request-Id": "trace-42"},
                            json={"model": MODEL, "messages": MESSAGES})
    assert given.headers["x-request-id"] == "trace-42"
    made = await http.get("/health")
    assert len(made.headers["x-request-id"]) == 32
    error = await http.post("/v1/chat/completions", headers={"X-Request-Id": "e-1"}, json={})
    assert error.status_code == 400 and error.headers["x-request-id"] == "e-1"


async def test_non_streaming_request_is_cancelled_when_the_client_leaves(app, engine):
    """The client sends its body, then hangs up while the worker is still generating."""
    engine.responder = lambda request: []  # no token ever comes
    body = json.dumps({"model": MODEL, "messages": MESSAGES}).encode()
    scope = {"type": "http", "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions",
             "query_string": b"", "root_path": "", "server": ("gateway", 80),
             "client": ("client", 1234), "headers": [(b"content-type", b"application/json"),
                                                      (b"content-length", str(len(body)).encode())]}
    sent: list[dict] = []
    hang_up = asyncio.Event()
    messages = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive():
        if messages:
            return messages.pop(0)
        await hang_up.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    async with asyncio.timeout(10):
        async with app.router.lifespan_context(app):
            serving = asyncio.create_task(app(scope, receive, send))
            while not engine.submitted:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.1)
            assert engine.cancelled == [] and not serving.done()
            hang_up.set()
            await serving
            await app.state.background.drain()
    assert engine.cancelled == [engine.submitted[0].req_id]
    assert sent[0]["status"] == 499
