"""RedisEngineClient against a real Redis (flushed around each test) and a tiny fake worker."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest
from redis.asyncio import Redis

from kvfleet.gateway.fleet.client import EngineTimeout, EngineUnavailable
from kvfleet.gateway.fleet.redis_client import RedisEngineClient
from kvfleet.shared.wire import (
    GenerationRequest,
    Keys,
    QueueEntry,
    RequestRecord,
    RequestStatus,
    SamplingParams,
    TokenEvent,
    encode_checkpoint,
)
from tests.gateway.fake_worker import FakeWorker
from tests.gateway.fakes import token_events

MODEL = "tiny-model"
KEYS = Keys("kvtest:")


def make_request(req_id: str, prompt: list[int] | None = None, priority: str = "interactive",
                 timeout_s: float = 30.0) -> GenerationRequest:
    return GenerationRequest(req_id=req_id, model=MODEL, prompt_token_ids=prompt or [1, 2, 3],
                             params=SamplingParams(max_tokens=4, seed=7),
                             deadline=time.time() + timeout_s, priority=priority,
                             created=time.time())


def echo_script(request: GenerationRequest) -> list[TokenEvent]:
    """Echoes the prompt back two tokens per event."""
    return token_events(request.prompt_token_ids, prompt_tokens=len(request.prompt_token_ids),
                        per_event=2)


async def read_until_final(events) -> list[TokenEvent]:
    received = []
    async for event in events:
        received.append(event)
        if event.is_final:
            break
    await events.aclose()
    return received


@pytest.fixture
async def client(redis_url):
    engine = RedisEngineClient.from_url(redis_url, KEYS, first_event_timeout_s=5.0)
    await engine.start()
    yield engine
    await engine.close()


@pytest.fixture
async def redis(redis_url):
    connection = Redis.from_url(redis_url)
    yield connection
    await connection.aclose()


async def test_subscribes_before_enqueue_so_immediate_events_arrive(client, redis_url):
    async with FakeWorker(redis_url, KEYS, MODEL, echo_script):
        events = await client.submit(make_request("cmpl-a", [5, 6, 7, 8, 9]))
        received = await read_until_final(events)
    assert [t for e in received for t in e.token_ids] == [5, 6, 7, 8, 9]
    assert received[-1].finish_reason == "stop"
    assert received[-1].usage.completion_tokens == 5


async def test_enqueue_is_idempotent_and_writes_the_protocol_keys(client, redis):
    request = make_request("cmpl-once", priority="batch")
    assert await client.enqueue(request) is True
    assert await client.enqueue(request) is False
    stream = KEYS.queue(MODEL, "batch")
    assert await redis.xlen(stream) == 1
    assert await redis.xlen(KEYS.queue(MODEL)) == 0
    [(_entry_id, fields)] = await redis.xrange(stream)
    assert set(fields) == {b"id", b"payload", b"prompt_len"}
    assert fields[b"id"] == b"cmpl-once"
    assert int(fields[b"prompt_len"]) == len(request.prompt_token_ids)
    assert QueueEntry.decode(fields).request == request
    assert GenerationRequest.unpack(fields[b"payload"]) == request
    stored = await redis.hgetall(KEYS.request("cmpl-once"))
    assert stored == {b"payload": request.pack(), b"attempt": b"0", b"status": b"queued"}
    assert 3600 < await redis.ttl(KEYS.request("cmpl-once")) <= 3600 + 600
    assert await redis.ttl(KEYS.enqueued("cmpl-once")) > 3600


async def test_concurrent_requests_share_one_pubsub_connection(client, redis, redis_url):
    async with FakeWorker(redis_url, KEYS, MODEL, echo_script):
        streams = await asyncio.gather(
            *(client.submit(make_request(f"cmpl-c{i}", [10 + i] * (i + 1))) for i in range(8)))
        inbox = KEYS.inbox(client.gateway_id)
        subscribers = await redis.pubsub_numsub(inbox)
        channels = {c for c in await redis.pubsub_channels() if client.gateway_id.encode() in c}
        results = await asyncio.gather(*(read_until_final(s) for s in streams))
    for i, received in enumerate(results):
        assert [t for e in received for t in e.token_ids] == [10 + i] * (i + 1)
    assert subscribers == [(inbox.encode(), 1)]  # one channel, this gateway's inbox, once
    assert channels == {inbox.encode()}
    assert client.fanout.num_channels == 1
    assert client.fanout.connections_opened == 1
    for i in range(8):  # each request names it as its reply channel
        payload = await redis.hget(KEYS.request(f"cmpl-c{i}"), RequestRecord.PAYLOAD)
        assert GenerationRequest.unpack(payload).reply_to == KEYS.inbox(client.gateway_id)


async def test_a_finished_request_leaves_only_the_inbox_subscribed(client, redis, redis_url):
    """The inbox outlives its requests (the next request waits for no SUBSCRIBE); a request's
    own channel, subscribed by a reader attached by id, is left when that reader ends."""
    async with FakeWorker(redis_url, KEYS, MODEL, echo_script):
        await read_until_final(await client.submit(make_request("cmpl-u")))
        attached = await client.attach("cmpl-u")
        assert attached is not None
        await attached[1].aclose()
    inbox = KEYS.inbox(client.gateway_id).encode()

    async def ours() -> set[bytes]:  # other tests' gateways may share the server
        return {c for c in await redis.pubsub_channels()
                if client.gateway_id.encode() in c or b"cmpl-u" in c}

    for _ in range(50):
        if await ours() == {inbox}:
            break
        await asyncio.sleep(0.02)
    assert await ours() == {inbox}
    assert client.fanout.num_subscribed == 0
    assert client.fanout.num_channels == 1


async def test_cancel_is_published(client, redis):
    pubsub = redis.pubsub()
    await pubsub.subscribe(KEYS.cancel())
    await pubsub.get_message(timeout=1.0)  # the subscribe confirmation
    await client.cancel("cmpl-gone")
    message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=2.0)
    await pubsub.aclose()
    assert message["channel"] == KEYS.cancel().encode() and message["data"] == b"cmpl-gone"


async def test_request_waits_for_a_worker_that_starts_later(client, redis_url):
    events = await client.submit(make_request("cmpl-late", [4, 2]))
    await asyncio.sleep(0.3)  # no worker yet: the request waits in the stream
    async with FakeWorker(redis_url, KEYS, MODEL, echo_script):
        received = await read_until_final(events)
    assert [t for e in received for t in e.token_ids] == [4, 2]


async def test_no_first_event_in_time_is_a_timeout(redis_url):
    engine = RedisEngineClient.from_url(redis_url, KEYS, first_event_timeout_s=0.2)
    await engine.start()
    try:
        events = await engine.submit(make_request("cmpl-slow"))
        with pytest.raises(EngineTimeout, match="no worker answered"):
            await anext(events)
        await events.aclose()
    finally:
        await engine.close()


async def test_a_stream_whose_pubsub_connection_broke_subscribes_again(client, redis, redis_url):
    events = await client.submit(make_request("cmpl-lost", [9, 8, 7]))
    await redis.client_kill_filter(_type="pubsub")
    first = asyncio.create_task(anext(events))  # sees the lost connection, subscribes again
    await asyncio.sleep(1.0)
    assert not first.done()
    async with FakeWorker(redis_url, KEYS, MODEL, echo_script):
        received = [await asyncio.wait_for(first, 5)]
        received += await asyncio.wait_for(read_until_final(events), 5)
    assert [t for e in received for t in e.token_ids] == [9, 8, 7]
    assert received[-1].is_final and received[-1].error is None


async def test_a_request_that_ended_while_its_channel_was_down_ends_from_its_record(client, redis):
    events = await client.submit(make_request("cmpl-ended", [4, 5, 6]))
    # what a worker leaves when it finished while the gateway could not hear it
    await redis.set(KEYS.checkpoint("cmpl-ended"), encode_checkpoint([4, 5, 6]))
    await redis.hset(KEYS.request("cmpl-ended"), mapping={
        RequestRecord.STATUS: RequestStatus.FINISHED_LENGTH.value, RequestRecord.ATTEMPT: 1})
    await redis.client_kill_filter(_type="pubsub")
    final = await asyncio.wait_for(anext(events), 5)
    await events.aclose()
    assert final.is_final and final.finish_reason == "length"
    assert (final.seq, final.attempt, final.token_ids) == (3, 1, [])  # the checkpoint has 0..2


@contextlib.asynccontextmanager
async def engine_on_own_redis(**options):
    """A private Redis server (the test may stop it) and an engine client on it, with short
    timeouts."""
    from kvfleet.shared.redis_server import EmbeddedRedis

    server = EmbeddedRedis().start()
    engine = RedisEngineClient.from_url(server.url, KEYS, connect_timeout_s=0.3,
                                        command_timeout_s=0.3, **options)
    await engine.start()
    try:
        yield server, engine
    finally:
        await engine.close()
        server.stop()


async def test_a_fleet_unreachable_past_the_reconnect_window_ends_the_stream():
    async with engine_on_own_redis(first_event_timeout_s=30.0, stream_reconnect_s=1.5) as (
            server, engine):
        events = await engine.submit(make_request("cmpl-gone"))
        server.stop()
        started = time.monotonic()
        with pytest.raises(EngineUnavailable, match="could not subscribe again within 1.5 s"):
            await asyncio.wait_for(anext(events), 15)
        assert 1.4 < time.monotonic() - started < 10
        await events.aclose()


async def test_a_checkpoint_that_cannot_be_read_is_an_error_not_an_empty_filler():
    async with engine_on_own_redis() as (server, engine):
        redis = Redis.from_url(server.url)
        await redis.set(KEYS.checkpoint("cmpl-ckpt"), encode_checkpoint([3, 1, 4]))
        await redis.aclose()
        assert await engine.read_checkpoint("cmpl-ckpt") == [3, 1, 4]
        server.stop()
        with pytest.raises(EngineUnavailable, match="cannot read the checkpoint"):
            await engine.read_checkpoint("cmpl-ckpt")


async def test_unreachable_redis_is_unavailable_quickly():
    engine = RedisEngineClient.from_url("redis://127.0.0.1:1/0", KEYS, connect_timeout_s=0.5)
    await engine.start()
    try:
        started = time.monotonic()
        with pytest.raises(EngineUnavailable):
            await engine.submit(make_request("cmpl-down"))
        assert await engine.is_ready() is False
        assert time.monotonic() - started < 10
    finally:
        await engine.close()


async def test_the_gateway_survives_a_redis_restart():
    """Not ready while Redis is down; ready again and serving once it is back (same address)."""
    from kvfleet.shared.redis_server import EmbeddedRedis

    server = EmbeddedRedis().start()
    engine = RedisEngineClient.from_url(server.url, KEYS, connect_timeout_s=0.5,
                                        first_event_timeout_s=5.0)
    await engine.start()
    try:
        assert await engine.is_ready() is True
        server.stop()
        assert await engine.is_ready() is False
        with pytest.raises(EngineUnavailable):
            await engine.submit(make_request("cmpl-while-down"))
        server = EmbeddedRedis(port=server.port).start()
        deadline = time.monotonic() + 20
        while not await engine.is_ready():
            assert time.monotonic() < deadline, "gateway never saw Redis again"
            await asyncio.sleep(0.1)
        async with FakeWorker(server.url, KEYS, MODEL, echo_script):
            for attempt in range(50):  # the pub/sub reader reconnects with backoff
                try:
                    events = await engine.submit(make_request(f"cmpl-after-{attempt}", [5, 6, 7]))
                    break
                except EngineUnavailable:
                    await asyncio.sleep(0.2)
            received = await asyncio.wait_for(read_until_final(events), 10)
        assert [t for e in received for t in e.token_ids] == [5, 6, 7]
    finally:
        await engine.close()
        server.stop()


async def test_a_pubsub_connection_torn_down_under_a_command_serves_again(client, redis_url,
                                                                           monkeypatch):
    """redis-py's asyncio connection fails with its own errors when it is torn down under a
    command in flight (in a Redis restart: AttributeError on a writer or reader already gone).
    A subscribe that fails so tells its waiter at once, and a read that fails so reconnects:
    the link serves again instead of its reader task dying with it."""
    pubsub = client.fanout._links[""]._pubsub
    real_subscribe, real_parse = pubsub.subscribe, pubsub.parse_response
    failures = {"subscribe": 1, "read": 0}

    async def subscribe(*keys):
        if failures["subscribe"]:
            failures["subscribe"] -= 1
            raise AttributeError("'NoneType' object has no attribute 'writelines'")
        return await real_subscribe(*keys)

    async def parse_response(*args, **kwargs):
        if failures["read"]:
            failures["read"] -= 1
            raise AttributeError("'NoneType' object has no attribute 'read'")
        return await real_parse(*args, **kwargs)

    monkeypatch.setattr(pubsub, "subscribe", subscribe)
    monkeypatch.setattr(pubsub, "parse_response", parse_response)
    started = time.monotonic()
    with pytest.raises(EngineUnavailable, match="torn down under a command"):
        await client.submit(make_request("cmpl-torn-subscribe", [1, 2]))
    assert time.monotonic() - started < 2.0  # told at once, not at the subscribe timeout
    failures["read"] = 1
    deadline = time.monotonic() + 5
    while failures["read"]:  # the reader meets the failure and starts the connection again
        assert time.monotonic() < deadline, "the reader never read again"
        await asyncio.sleep(0.05)
    async with FakeWorker(redis_url, KEYS, MODEL, echo_script):
        events = await client.submit(make_request("cmpl-after-torn", [5, 6, 7]))
        received = await asyncio.wait_for(read_until_final(events), 10)
    assert [t for e in received for t in e.token_ids] == [5, 6, 7]
