"""The gateway's fleet client on a real Redis Cluster (3 primaries + 3 replicas) with 3 stream
shards: requests spread over the shards, token events arrive by sharded pub/sub on one
connection per node, cancels and queue load work across nodes."""

from __future__ import annotations

import asyncio
import time
from collections import Counter

import pytest
import redis
from redis.crc import key_slot

from kvfleet.gateway.fleet.redis_client import RedisEngineClient
from kvfleet.shared.redis_cluster import slot_range
from kvfleet.shared.redis_connect import connect
from kvfleet.shared.wire import GenerationRequest, Keys, RequestRecord, SamplingParams, TokenEvent
from tests.gateway.fake_worker import FakeWorker
from tests.gateway.fakes import token_events
from tests.helpers.channels import next_message, subscribe

MODEL = "tiny-model"
KEYS = Keys("kvc:", queue_shards=3)


def make_request(req_id: str, prompt: list[int]) -> GenerationRequest:
    return GenerationRequest(req_id=req_id, model=MODEL, prompt_token_ids=prompt,
                             params=SamplingParams(max_tokens=4, seed=7),
                             deadline=time.time() + 30, created=time.time())


def echo_script(request: GenerationRequest) -> list[TokenEvent]:
    return token_events(request.prompt_token_ids, prompt_tokens=len(request.prompt_token_ids),
                        per_event=2)


async def read_until_final(events) -> list[int]:
    tokens = []
    async for event in events:
        tokens.extend(event.token_ids)
        if event.is_final:
            break
    await events.aclose()
    return tokens


@pytest.fixture
def cluster_url(redis_cluster) -> str:
    redis_cluster.flush()
    yield redis_cluster.url
    redis_cluster.flush()


@pytest.fixture
async def client(cluster_url):
    engine = RedisEngineClient.from_url(cluster_url, KEYS, first_event_timeout_s=5.0)
    await engine.start()
    yield engine
    await engine.close()


async def test_requests_spread_over_shards_and_stream_back_over_one_connection_per_node(
        client, cluster_url):
    assert client.context.cluster
    ids = [f"cmpl-{i}" for i in range(30)]
    async with FakeWorker(cluster_url, KEYS, MODEL, echo_script) as worker:
        streams = await asyncio.gather(*(client.submit(make_request(req_id, [i, i + 1, i + 2]))
                                         for i, req_id in enumerate(ids)))
        connections = client.fanout.num_connections
        results = await asyncio.gather(*(read_until_final(s) for s in streams))
    assert results == [[i, i + 1, i + 2] for i in range(len(ids))]
    assert connections == 3  # one sharded subscription per primary, not one per request
    shards = Counter(KEYS.shard_of(r.req_id) for r in worker.received)
    assert set(shards) == {0, 1, 2}
    for shard in range(3):  # each shard's streams live on the primary of its slot range
        low, high = slot_range(shard, 3)
        assert low <= key_slot(KEYS.queue(MODEL, "interactive", shard).encode()) <= high
    assert client.fanout.num_subscribed == 0


async def test_enqueue_is_idempotent_on_the_cluster(client, cluster_url):
    request = make_request("cmpl-once", [1, 2])
    assert await client.enqueue(request) is True
    assert await client.enqueue(request) is False
    sync = connect(cluster_url)
    try:
        stream = KEYS.queue(MODEL, "interactive", KEYS.shard_of("cmpl-once"))
        assert sync.xlen(stream) == 1
        assert sum(sync.xlen(s) for s in KEYS.all_queues(MODEL) if sync.exists(s)) == 1
        assert sync.hget(KEYS.request("cmpl-once"), "status") == b"queued"
    finally:
        sync.close()


async def test_cancel_reaches_a_sharded_subscriber(client, cluster_url):
    sync = connect(cluster_url)
    pubsub = subscribe(sync, KEYS.cancel())
    try:
        await client.cancel("cmpl-gone")
        message = await asyncio.to_thread(next_message, pubsub, 3.0)
        assert message is not None and message["data"] == b"cmpl-gone"
    finally:
        pubsub.close()
        sync.close()


async def test_queue_load_counts_every_shard(client):
    for i in range(9):
        assert await client.enqueue(make_request(f"cmpl-q{i}", [1]))
    load = await client.queue_load(MODEL)
    assert load.undelivered == 9


def reads_processed(port: int) -> int:
    node = redis.Redis(port=port)
    try:
        return node.info("stats")["total_reads_processed"]
    finally:
        node.close()


def sharded_subscribers(port: int) -> int:
    node = redis.Redis(port=port)
    try:
        return sum(int(c.get("ssub", 0)) for c in node.client_list())
    finally:
        node.close()


async def test_a_burst_of_subscriptions_to_many_slots_costs_a_node_one_read(client, redis_cluster):
    """One SSUBSCRIBE per slot (the server refuses one spanning slots), but all of a burst's in
    one write: the node reads them at once, confirms each, and the same holds for leaving."""
    node = redis_cluster.nodes[0]
    low, high = slot_range(0, 3)
    channels = [KEYS.tokens(f"burst-{i}") for i in range(400)]
    channels = [c for c in channels if low <= key_slot(c.encode()) <= high][:30]
    assert len({key_slot(c.encode()) for c in channels}) > 20  # many slots, one node
    already = sharded_subscribers(node.port)  # other tests' subscribers (a worker's cancels)
    await client.fanout.subscribe(channels[0], "r")  # the node's connection, opened once
    before = reads_processed(node.port)
    await asyncio.gather(*(client.fanout.subscribe(c, "r") for c in channels[1:]))
    reads = reads_processed(node.port) - before - 1  # less the INFO of this read
    assert sharded_subscribers(node.port) - already == len(channels)
    # one read for the burst, plus the node's other traffic (replication acks, other clients):
    # one read per slot (29 and more) when each SSUBSCRIBE was a write of its own
    assert reads <= 14
    for channel in channels:
        client.fanout.release(channel, "r")
    deadline = time.monotonic() + 5
    while sharded_subscribers(node.port) > already and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert sharded_subscribers(node.port) == already
    assert client.fanout.num_subscribed == 0


async def test_streams_whose_node_connection_broke_subscribe_again_and_finish(
        client, cluster_url, redis_cluster):
    """A node's sharded subscription breaks (as when a primary fails over): the streams on it
    subscribe again through a fresh slot map and get every token."""
    prompts = {f"cmpl-re-{i}": [i + 1, i + 2, i + 3] for i in range(6)}
    streams = {req_id: await client.submit(make_request(req_id, prompt))
               for req_id, prompt in prompts.items()}
    for node in redis_cluster.primaries():  # every node's gateway subscription breaks
        connection = redis.Redis(host="127.0.0.1", port=node.port)
        connection.client_kill_filter(_type="pubsub")
        connection.close()
    firsts = {req_id: asyncio.create_task(anext(events)) for req_id, events in streams.items()}
    await asyncio.sleep(1.0)  # each stream saw its lost connection and subscribed again
    assert not any(task.done() for task in firsts.values())
    async with FakeWorker(cluster_url, KEYS, MODEL, echo_script):
        for req_id, events in streams.items():
            first = await asyncio.wait_for(firsts[req_id], 10)
            rest = await asyncio.wait_for(read_until_final(events), 10)
            assert first.token_ids + rest == prompts[req_id]
    assert client.fanout.connections_opened >= 4  # at least one node's link was made anew


def test_a_message_for_an_inbox_on_another_node_is_forwarded_by_the_worker(cluster_url):
    """A stale slot map (the inbox's slot moved): the node holding the request cannot publish to
    the inbox, hands the message back, and the worker publishes it where the inbox lives."""
    from kvfleet.worker.protocol import Publication, WorkerProtocol

    sync = connect(cluster_url)
    try:
        sync.hset(KEYS.request("cmpl-far"), RequestRecord.ATTEMPT, 1)
        home = sync.nodes_manager.get_node_from_slot(key_slot(KEYS.request("cmpl-far").encode()))
        far = next(KEYS.inbox("gw-far", part) for part in range(100)
                   if sync.nodes_manager.get_node_from_slot(
                       key_slot(KEYS.inbox("gw-far", part).encode())).name != home.name)
        listener = subscribe(sync, far)
        event = TokenEvent(seq=0, attempt=1, token_ids=[5])
        protocol = WorkerProtocol(sync, KEYS, MODEL, "w1")
        assert protocol.publish([Publication("cmpl-far", 1, event, None, "", "", far)]) == [True]
        message = next_message(listener, 2.0)
        listener.close()
    finally:
        sync.close()
    assert message is not None
    [received] = TokenEvent.unpack_many(message["data"])
    assert (received.req_id, received.token_ids) == ("cmpl-far", [5])
