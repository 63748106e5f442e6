"""Gateway inboxes (gateway/fleet/inboxes.py) against a real Redis and a real Redis Cluster: a
request names its gateway's inbox as reply channel, a worker's step sends each inbox one message
with the events of all its requests there, the gateway subscribes once per inbox, events
published while its connection was being made anew are not lost, and a reader attached by id
still gets every event on the request's own channel."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis
from redis.crc import key_slot

from kvfleet.gateway.fleet.redis_client import RedisEngineClient
from kvfleet.shared.redis_connect import connect
from kvfleet.shared.wire import (
    GenerationRequest,
    Keys,
    RequestRecord,
    RequestStatus,
    SamplingParams,
    TokenEvent,
)
from tests.helpers.channels import next_message, subscribe
from kvfleet.worker.protocol import Publication, WorkerProtocol

pytestmark = pytest.mark.topologies

MODEL = "tiny-model"


def make_request(req_id: str) -> GenerationRequest:
    return GenerationRequest(req_id=req_id, model=MODEL, prompt_token_ids=[1, 2, 3],
                             params=SamplingParams(max_tokens=8, seed=7),
                             deadline=time.time() + 30, created=time.time())


@pytest.fixture
def keys(redis_topology) -> Keys:
    return Keys("kvi:", queue_shards=3 if redis_topology == "cluster" else 1)


@pytest.fixture
async def client(redis_url, keys):
    engine = RedisEngineClient.from_url(redis_url, keys, first_event_timeout_s=5.0,
                                        shard_shares=False)
    await engine.start()
    yield engine
    await engine.close()


@pytest.fixture
def sync(redis_url):
    connection = connect(redis_url)
    yield connection
    connection.close()


def stored_request(sync, keys: Keys, req_id: str) -> GenerationRequest:
    return GenerationRequest.unpack(sync.hget(keys.request(req_id), RequestRecord.PAYLOAD))


def worker_step(sync, keys: Keys, requests: list[GenerationRequest], seq: int,
                final: bool = False) -> None:
    """What a worker does for one step of these requests (attempt 1): PUBLISH_STEP."""
    protocol = WorkerProtocol(sync, keys, MODEL, "w1")
    items = [Publication(r.req_id, 1, TokenEvent(seq=seq, attempt=1, token_ids=[100 + seq],
                                                 finish_reason="length" if final else None),
                         RequestStatus.FINISHED_LENGTH if final else None, "", "", r.reply_to)
             for r in requests]
    assert protocol.publish(items) == [True] * len(requests)


def started(sync, keys: Keys, req_ids: list[str]) -> list[GenerationRequest]:
    for req_id in req_ids:
        sync.hset(keys.request(req_id), RequestRecord.ATTEMPT, 1)
    return [stored_request(sync, keys, req_id) for req_id in req_ids]


def ssubscribe_calls(sync) -> int:
    nodes = ([sync.get_redis_connection(n) for n in sync.get_primaries()]
             if hasattr(sync, "get_primaries") else [sync])
    return sum(node.info("commandstats").get(name, {}).get("calls", 0)
               for node in nodes for name in ("cmdstat_ssubscribe", "cmdstat_subscribe"))


async def test_a_step_is_one_message_per_inbox_and_every_stream_gets_its_events(
        client, sync, keys):
    req_ids = [f"cmpl-in-{i}" for i in range(12)]
    streams = [await client.submit(make_request(req_id)) for req_id in req_ids]
    requests = started(sync, keys, req_ids)
    inboxes = {r.reply_to for r in requests}
    assert all(inbox.startswith(keys.inbox(client.gateway_id).split("{")[0]) for inbox in inboxes)
    if client.context.cluster:  # an inbox per primary, each on its requests' primary
        assert len(inboxes) == 3
        for r in requests:
            assert (sync.nodes_manager.get_node_from_slot(key_slot(r.reply_to.encode())).name
                    == sync.nodes_manager.get_node_from_slot(
                        key_slot(keys.request(r.req_id).encode())).name)
    else:
        assert inboxes == {keys.inbox(client.gateway_id)}
    listener = subscribe(sync, *inboxes)
    worker_step(sync, keys, requests, 0)
    messages = [next_message(listener, 2.0) for _ in inboxes]
    listener.close()
    carried = sorted(e.req_id for m in messages for e in TokenEvent.unpack_many(m["data"]))
    assert carried == sorted(req_ids)  # every event, in one message per inbox
    worker_step(sync, keys, requests, 1, final=True)
    for req_id, events in zip(req_ids, streams):
        first = await asyncio.wait_for(anext(events), 5)
        final = await asyncio.wait_for(anext(events), 5)
        await events.aclose()
        assert (first.req_id, first.token_ids) == (req_id, [100])
        assert final.token_ids == [101] and final.finish_reason == "length"
    assert client.fanout.num_subscribed == 0
    assert client.fanout.num_channels == len(inboxes)


async def test_later_requests_on_a_subscribed_inbox_send_no_subscribe(client, sync):
    first = [await client.submit(make_request(f"cmpl-a-{i}")) for i in range(9)]
    channels = client.fanout.num_channels
    before = ssubscribe_calls(sync)
    second = [await client.submit(make_request(f"cmpl-b-{i}")) for i in range(9)]
    assert ssubscribe_calls(sync) == before
    assert client.fanout.num_channels == channels
    for events in first + second:
        await events.aclose()


async def test_events_published_while_the_connection_was_made_anew_are_not_lost(
        client, sync, keys, redis_deployment):
    """redis-py makes a broken pub/sub connection anew by itself and subscribes its channels
    again; a final event published in between reaches nobody, so the stream must hear of the
    reconnection and end from the request's record instead of waiting for its timeout."""
    events = await client.submit(make_request("cmpl-gap"))
    [request] = started(sync, keys, ["cmpl-gap"])
    ports = ([node.port for node in redis_deployment.primaries()]
             if client.context.cluster else [redis_deployment.port])
    # in one turn of the gateway's event loop, so it cannot subscribe again in between:
    for port in ports:
        node = redis.Redis(port=port)
        node.client_kill_filter(_type="pubsub")
        node.close()
    worker_step(sync, keys, [request], 0, final=True)  # published to no subscriber
    started_at = time.monotonic()
    final = await asyncio.wait_for(anext(events), 10)
    await events.aclose()
    assert final.is_final and final.finish_reason == "length"
    assert (final.seq, final.token_ids) == (1, [])  # the checkpoint holds token 0
    assert time.monotonic() - started_at < 4.0  # not the 5 s first-event timeout


async def test_a_reader_attached_by_id_gets_the_events_beside_the_inbox(client, sync, keys):
    events = await client.submit(make_request("cmpl-two"))
    [request] = started(sync, keys, ["cmpl-two"])
    worker_step(sync, keys, [request], 0)
    snapshot, attached = await client.attach("cmpl-two")
    assert snapshot.token_ids == [100]
    assert sync.hget(keys.request("cmpl-two"), RequestRecord.WATCHED) == b"1"
    worker_step(sync, keys, [request], 1, final=True)
    original = [await asyncio.wait_for(anext(events), 5) for _ in range(2)]
    second = await asyncio.wait_for(anext(attached), 5)
    for stream in (events, attached):
        await stream.aclose()
    assert [e.token_ids for e in original] == [[100], [101]]
    assert second.token_ids == [101] and second.is_final


async def test_attach_marks_only_a_request_that_exists(client, sync, keys):
    assert await client.attach("cmpl-nobody") is None
    assert not sync.exists(keys.request("cmpl-nobody"))


async def test_the_gateway_metrics_count_messages_and_events(client, sync, keys):
    from prometheus_client.exposition import generate_latest

    from kvfleet.gateway.dashboard.metrics import GatewayMetrics

    req_ids = [f"cmpl-m-{i}" for i in range(6)]
    streams = [await client.submit(make_request(req_id)) for req_id in req_ids]
    requests = started(sync, keys, req_ids)
    worker_step(sync, keys, requests, 0, final=True)
    for events in streams:
        await asyncio.wait_for(anext(events), 5)
        await events.aclose()
    metrics = GatewayMetrics("m")
    metrics.watch_fanout(client.fanout)
    text = generate_latest(metrics.registry).decode()
    inboxes = len({r.reply_to for r in requests})
    assert f'kvfleet_gateway_token_events_total{{model="m"}} 6.0' in text
    assert f'kvfleet_gateway_token_messages_total{{model="m"}} {float(inboxes)}' in text
    assert f'kvfleet_gateway_pubsub_channels{{model="m"}} {float(inboxes)}' in text
    assert 'kvfleet_gateway_undecodable_messages_total{model="m"} 0.0' in text


async def test_a_bad_value_in_a_message_loses_only_itself(client, sync, keys):
    """Events before a malformed value are delivered; a field the gateway does not know (a newer
    worker's) is left out, not a reason to drop the event."""
    import msgpack

    inbox = keys.inbox("gw-test")
    first = await client.fanout.subscribe(inbox, "r1", pinned=True)
    second = await client.fanout.subscribe(inbox, "r2", pinned=True)
    newer = msgpack.packb({"seq": 0, "attempt": 1, "token_ids": [7], "req_id": "r2",
                           "from_a_newer_worker": True})
    message = (TokenEvent(seq=0, attempt=1, token_ids=[5]).pack("r1") + newer
               + b"\xc1 not msgpack")
    publish = sync.spublish if client.context.cluster else sync.publish
    publish(inbox, message)
    one = await asyncio.wait_for(first.get(5), 5)
    two = await asyncio.wait_for(second.get(5), 5)
    assert (one.req_id, one.token_ids) == ("r1", [5])
    assert (two.req_id, two.token_ids) == ("r2", [7])
    for _ in range(50):
        if client.fanout.undecodable_messages:
            break
        await asyncio.sleep(0.02)
    assert client.fanout.undecodable_messages == 1
    assert client.fanout.events_received == 2
    client.fanout.release(inbox, "r1")
    client.fanout.release(inbox, "r2")
