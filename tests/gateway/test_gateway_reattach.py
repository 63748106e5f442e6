"""Re-attach (`GET /v1/requests/{id}/stream?after=N`) against a real Redis with a stand-in worker
that checkpoints and publishes like worker/protocol.py, and gap filling from the checkpoint."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from redis.asyncio import Redis

from kvfleet.gateway.app import create_app
from kvfleet.shared.settings import GatewaySettings
from kvfleet.shared.wire import (
    GenerationRequest,
    Keys,
    RequestRecord,
    RequestStatus,
    SamplingParams,
    TokenEvent,
    Usage,
    encode_checkpoint,
)
from tests.gateway.fakes import token_events
from tests.gateway.helpers import MODEL, sse_events
from kvfleet.worker.engine.core.stopping import Stop, StopChecker

PREFIX = "kvra:"
KEYS = Keys(PREFIX)


class StandInWorker:
    """Writes what a worker writes: request hash, checkpoint appended before each publish."""

    def __init__(self, redis: Redis, req_id: str, prompt: list[int], stop: list[str] = ()):
        self.redis = redis
        self.req_id = req_id
        self.request = GenerationRequest(req_id=req_id, model=MODEL, prompt_token_ids=prompt,
                                         params=SamplingParams(max_tokens=50, stop=list(stop)),
                                         created=1000.0)

    async def start(self, status: RequestStatus, attempt: int = 0) -> None:
        record = RequestRecord(self.request, attempt=attempt, status=status)
        await self.redis.hset(KEYS.request(self.req_id), mapping=record.encode())

    async def step(self, seq: int, token_ids: list[int], attempt: int = 0, publish: bool = True,
                   finish_reason: str | None = None, stop: Stop | None = None) -> None:
        await self.redis.append(KEYS.checkpoint(self.req_id), encode_checkpoint(token_ids))
        if finish_reason is not None:
            status = RequestStatus.for_finish_reason(finish_reason)
            await self.redis.hset(KEYS.request(self.req_id), RequestRecord.STATUS, status.value)
        if publish:
            event = TokenEvent(seq=seq, attempt=attempt, token_ids=token_ids,
                               finish_reason=finish_reason,
                               usage=Usage(3, seq + len(token_ids)) if finish_reason else None,
                               stop_reason=stop.reason if stop else None,
                               text_after_stop=stop.text_after if stop else None)
            await self.redis.publish(KEYS.tokens(self.req_id), event.pack(self.req_id))


@pytest.fixture
async def gateway(redis_url, tokenizer, model_info):
    settings = GatewaySettings(redis_url=redis_url, model=MODEL, key_prefix=PREFIX,
                               request_timeout_s=30, first_event_timeout_s=5)
    app = create_app(settings, None, tokenizer, model_info=model_info)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw", timeout=10) as http:
            yield app, http


@pytest.fixture
async def redis(redis_url):
    client = Redis.from_url(redis_url)
    yield client
    await client.aclose()


def chunks(body: str) -> list[dict]:
    events = sse_events(body)
    assert events[-1] == "[DONE]", body
    return [json.loads(e) for e in events[:-1]]


def delivered(body: str) -> tuple[list[int], str, str | None]:
    """(token ids in order, text, last finish_reason) of a re-attached stream; checks indices."""
    ids, text, reason = [], "", None
    for chunk in chunks(body):
        [choice] = chunk["choices"]
        assert choice["token_index"] == (ids and len(ids) + START[0] or START[0]), chunk
        ids += choice["token_ids"]
        text += choice["text"]
        reason = choice["finish_reason"] or reason
    return ids, text, reason


START = [0]  # first token index the current test asked for (`delivered` checks continuity)


async def wait_subscribed(app, count: int = 1) -> None:
    for _ in range(200):
        if app.state.client.fanout.num_subscribed >= count:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the gateway never subscribed")


async def test_finished_request_replays_the_rest_from_the_checkpoint(gateway, redis, tokenizer):
    app, http = gateway
    ids = tokenizer.encode(" The quick brown fox jumps over the lazy dog.")
    worker = StandInWorker(redis, "cmpl-done", tokenizer.encode("Say:"))
    await worker.start(RequestStatus.RUNNING)
    await worker.step(0, ids, finish_reason="stop")
    START[0] = 0
    whole = await http.get("/v1/requests/cmpl-done/stream")
    assert whole.status_code == 200
    got, text, reason = delivered(whole.text)
    assert got == ids and reason == "stop"
    assert text == tokenizer.decode(ids, skip_special_tokens=True)
    START[0] = 4
    rest = await http.get("/v1/requests/cmpl-done/stream", params={"after": 4})
    got, text, reason = delivered(rest.text)
    assert got == ids[4:] and reason == "stop"
    assert text == tokenizer.decode(ids, skip_special_tokens=True)[
        len(tokenizer.decode(ids[:4], skip_special_tokens=True)):]
    assert chunks(rest.text)[0]["id"] == "cmpl-done"
    assert app.state.client.fanout.num_subscribed == 0


async def test_running_request_continues_live_without_gap_or_repeat(gateway, redis, tokenizer):
    app, http = gateway
    ids = tokenizer.encode(" one two three four five six seven eight")
    worker = StandInWorker(redis, "cmpl-live", [1, 2, 3])
    await worker.start(RequestStatus.RUNNING, attempt=1)
    await worker.step(0, ids[:3], attempt=1)
    START[0] = 1
    task = asyncio.create_task(http.get("/v1/requests/cmpl-live/stream", params={"after": 1}))
    await wait_subscribed(app)
    # Published after the subscription but already in the checkpoint the gateway read (or not):
    await worker.step(3, ids[3:5], attempt=1)
    await redis.publish(KEYS.tokens("cmpl-live"),  # a stale attempt: dropped
                        TokenEvent(seq=3, attempt=0, token_ids=[99, 98]).pack("cmpl-live"))
    await redis.publish(KEYS.tokens("cmpl-live"),  # a repeat of tokens 2..4: nothing new sent
                        TokenEvent(seq=2, attempt=1, token_ids=ids[2:5]).pack("cmpl-live"))
    await worker.step(5, ids[5:], attempt=1, finish_reason="length")
    response = await asyncio.wait_for(task, 10)
    got, _text, reason = delivered(response.text)
    assert got == ids[1:] and reason == "length"


async def test_live_gap_is_filled_from_the_checkpoint(gateway, redis, tokenizer):
    app, http = gateway
    ids = tokenizer.encode(" alpha beta gamma delta epsilon zeta")
    worker = StandInWorker(redis, "cmpl-gap", [5])
    await worker.start(RequestStatus.RUNNING)
    await worker.step(0, ids[:2])
    START[0] = 0
    task = asyncio.create_task(http.get("/v1/requests/cmpl-gap/stream"))
    await wait_subscribed(app)
    await worker.step(2, ids[2:4], publish=False)  # lost on pub/sub, but checkpointed
    await worker.step(4, ids[4:], finish_reason="stop")
    response = await asyncio.wait_for(task, 10)
    got, text, reason = delivered(response.text)
    assert got == ids and reason == "stop"
    assert text == tokenizer.decode(ids, skip_special_tokens=True)


async def test_a_resumed_stream_ends_where_the_worker_stopped(gateway, redis, tokenizer):
    """The cut counts back from the end of the text, so it holds for a stream that starts at
    `after` and whose last tokens came partly from the checkpoint. Re-attached once the request
    has ended, the record has no final event: the first stop string after `after` ends it."""
    app, http = gateway
    ids = tokenizer.encode(" alpha beta STOP gamma delta")
    worker = StandInWorker(redis, "cmpl-stop", [5], stop=["STOP"])
    checker = StopChecker([], max_model_len=1000, tokenizer=tokenizer)
    n = next(n for n in range(1, len(ids)) if checker.find_stop(ids[:n], worker.request.params))
    stop = checker.find_stop(ids[:n], worker.request.params)
    assert stop.reason == "STOP" and n < len(ids)
    expected = tokenizer.decode(ids[:n]).split("STOP")[0][len(tokenizer.decode(ids[:1])):]
    await worker.start(RequestStatus.RUNNING)
    await worker.step(0, ids[:2])
    START[0] = 1
    task = asyncio.create_task(http.get("/v1/requests/cmpl-stop/stream", params={"after": 1}))
    await wait_subscribed(app)
    await worker.step(2, ids[2:n - 1], publish=False)  # lost on pub/sub, but checkpointed
    await worker.step(n - 1, ids[n - 1:n], finish_reason="stop", stop=stop)
    response = await asyncio.wait_for(task, 10)
    got, text, reason = delivered(response.text)
    assert got == ids[1:n] and text == expected and reason == "stop"
    assert chunks(response.text)[-1]["choices"][0]["stop_reason"] == "STOP"
    replay = await http.get("/v1/requests/cmpl-stop/stream", params={"after": 1})
    got, text, reason = delivered(replay.text)
    assert got == ids[1:n] and text == expected and reason == "stop"


async def test_an_adapters_request_is_named_by_the_adapter(gateway, redis, tokenizer):
    """A LoRA adapter's request decodes with its base model's tokenizer and names the adapter
    (as its live answer did); a request of a model no live worker serves is a 503."""
    app, http = gateway
    ids = tokenizer.encode(" adapted words")
    worker = StandInWorker(redis, "cmpl-lora", [5])
    worker.request.lora, worker.request.lora_path = "sql", "/adapters/sql"
    await worker.start(RequestStatus.RUNNING)
    await worker.step(0, ids, finish_reason="stop")
    START[0] = 0
    response = await http.get("/v1/requests/cmpl-lora/stream")
    got, text, _reason = delivered(response.text)
    assert got == ids and text == tokenizer.decode(ids)
    assert {chunk["model"] for chunk in chunks(response.text)} == {"sql"}
    gone = StandInWorker(redis, "cmpl-gone", [5])
    gone.request.model = "a-model-no-worker-serves"
    await gone.start(RequestStatus.RUNNING)
    response = await http.get("/v1/requests/cmpl-gone/stream")
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "model_unavailable"
    assert app.state.client.fanout.num_subscribed == 0


async def test_unknown_request_is_a_404_in_openai_shape(gateway):
    app, http = gateway
    response = await http.get("/v1/requests/cmpl-nope/stream", params={"after": 2})
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "request_not_found"
    assert app.state.client.fanout.num_subscribed == 0
    bad = await http.get("/v1/requests/cmpl-nope/stream", params={"after": -1})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "after"


async def test_checkpoint_decoding_matches_the_worker():
    from kvfleet.shared.wire import decode_checkpoint, encode_checkpoint
    assert decode_checkpoint(encode_checkpoint([0, 1, 70000, 2**32 - 1])) == [0, 1, 70000, 2**32 - 1]
    assert decode_checkpoint(None) == []


async def test_main_stream_fills_a_gap_from_the_checkpoint(http, engine, tokenizer):
    ids = tokenizer.encode(" red green blue yellow") + [tokenizer.eos_token_id]
    events = token_events(ids, prompt_tokens=2, per_event=1)
    del events[1:3]  # tokens 1 and 2 never arrive on pub/sub
    engine.responder = lambda request: events
    engine.default_checkpoint = ids
    body = (await http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi"})).json()
    assert body["choices"][0]["text"] == tokenizer.decode(ids, skip_special_tokens=True)
    assert body["usage"]["completion_tokens"] == len(ids)
