"""Gateway shard shares: a gateway's place among the live gateways picks the stream shards its new
requests go to, so that on a cluster each gateway talks to as few primaries as balance allows
(gateway/fleet/homes.py). The layout is checked for balance; the roster and the ids it gives are
checked against a real Redis Cluster and a real single Redis."""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections import Counter

import pytest
from redis.asyncio import Redis
from redis.crc import key_slot

from kvfleet.gateway.fleet.homes import GatewayHomes
from kvfleet.gateway.fleet.redis_client import RedisEngineClient
from kvfleet.shared.redis_cluster import slot_range
from kvfleet.shared.redis_connect import connect
from kvfleet.shared.redis_server import free_port
from kvfleet.shared.wire import GenerationRequest, Keys, SamplingParams
from kvfleet.shared.wire.scripts import gateway_shard_shares
from tests.gateway.fake_worker import FakeWorker
from tests.gateway.fakes import token_events

MODEL = "tiny-model"


@pytest.mark.parametrize("gateways", range(1, 8))
@pytest.mark.parametrize("shards", range(1, 6))
def test_shares_give_every_shard_an_equal_part_and_each_gateway_few_shards(gateways, shards):
    layout = [gateway_shard_shares(i, gateways, shards) for i in range(gateways)]
    for shares in layout:
        assert math.isclose(sum(share for _, share in shares), 1.0)
        assert all(share > 0 for _, share in shares)
        # one shard per gateway when the gateways are a multiple of the shards, else the few
        # whose part of [0, 1) overlaps the gateway's
        assert len(shares) <= math.ceil(shards / gateways) + 1
        if gateways % shards == 0:
            assert len(shares) == 1
    load = Counter()
    for shares in layout:  # each gateway carries one unit of requests
        for shard, share in shares:
            load[shard] += share
    assert sorted(load) == list(range(shards))
    for shard in range(shards):
        assert math.isclose(load[shard], gateways / shards)


def test_a_gateway_without_a_place_sends_to_every_shard_alike():
    assert gateway_shard_shares(-1, 0, 3) == ((0, 1 / 3), (1, 1 / 3), (2, 1 / 3))
    assert gateway_shard_shares(5, 0, 1) == ((0, 1.0),)


def test_request_ids_land_on_the_shards_in_proportion_to_the_shares():
    keys = Keys("kvs:", queue_shards=3)
    homes = GatewayHomes(Redis(port=free_port()), keys, rng=random.Random(7))  # never called
    homes.shares = ((0, 2 / 3), (1, 1 / 3))  # gateway 0 of 2 over 3 shards
    counts = Counter(keys.shard_of("cmpl-" + homes.request_hex("cmpl-")) for _ in range(600))
    assert set(counts) == {0, 1}
    # 400 expected on shard 0: a binomial standard deviation is ~11.5, the bound is ~5 of them
    assert 340 <= counts[0] <= 460


def make_request(req_id: str) -> GenerationRequest:
    return GenerationRequest(req_id=req_id, model=MODEL, prompt_token_ids=[1, 2, 3],
                             params=SamplingParams(max_tokens=3, seed=1),
                             deadline=time.time() + 30, created=time.time())


@pytest.fixture
def cluster_url(redis_cluster) -> str:
    redis_cluster.flush()
    yield redis_cluster.url
    redis_cluster.flush()


def roster_size(url: str, keys: Keys) -> int:
    """Gateways on the roster, read with a client of its own."""
    client = connect(url)
    try:
        return client.zcard(keys.gateway_roster())
    finally:
        client.close()


async def started(url: str, keys: Keys, **options) -> RedisEngineClient:
    engine = RedisEngineClient.from_url(url, keys, first_event_timeout_s=5.0, **options)
    await engine.start()
    return engine


async def test_three_gateways_on_three_shards_each_send_to_one_primary(cluster_url):
    keys = Keys("kvs:", queue_shards=3)
    engines = [await started(cluster_url, keys) for _ in range(3)]
    try:
        for engine in engines:  # every gateway sees all three once each has joined
            await engine.homes.update()
        places = sorted(engine.homes.place for engine in engines)
        assert places == [(0, 3), (1, 3), (2, 3)]
        homes = []
        for engine in engines:
            shards = {keys.shard_of("cmpl-" + engine.new_request_hex("cmpl-")) for _ in range(30)}
            assert len(shards) == 1
            homes.append(shards.pop())
        assert sorted(homes) == [0, 1, 2]
        # the ids' keys live on the primary owning the home shard's slot range, and a request
        # submitted under such an id is served and streams back as any other
        engine = engines[0]
        req_id = "cmpl-" + engine.new_request_hex("cmpl-")
        low, high = slot_range(keys.shard_of(req_id), 3)
        assert low <= key_slot(req_id.encode()) <= high
        async with FakeWorker(cluster_url, keys, MODEL,
                              lambda r: token_events([5, 6, 7], prompt_tokens=3)):
            events = await engine.submit(make_request(req_id))
            tokens = []
            async for event in events:
                tokens += event.token_ids
                if event.is_final:
                    break
            await events.aclose()
        assert tokens == [5, 6, 7]
    finally:
        for engine in engines:
            await engine.close()


async def test_a_gateway_that_leaves_gives_its_shares_to_the_others(cluster_url):
    keys = Keys("kvs:", queue_shards=3)
    first, second = await started(cluster_url, keys), await started(cluster_url, keys)
    try:
        await first.homes.update()
        assert first.homes.place == (0, 2)
        assert [s for s, _ in first.homes.shares] == [0, 1]  # 2/3 to shard 0, 1/3 to shard 1
        await second.close()  # leaves the roster at once, not after its TTL
        await first.homes.update()
        assert first.homes.place == (0, 1)
        assert [s for s, _ in first.homes.shares] == [0, 1, 2]
        assert roster_size(cluster_url, keys) == 1
    finally:
        await first.close()


async def test_the_setting_off_keeps_random_ids_and_no_roster(cluster_url):
    keys = Keys("kvs:", queue_shards=3)
    engine = await started(cluster_url, keys, shard_shares=False)
    try:
        assert engine.homes is None
        shards = Counter(keys.shard_of("cmpl-" + engine.new_request_hex("cmpl-"))
                         for _ in range(90))
        assert set(shards) == {0, 1, 2}
        assert roster_size(cluster_url, keys) == 0
    finally:
        await engine.close()


async def test_a_single_redis_with_one_shard_needs_no_roster(redis_server):
    redis_server.flush()
    keys = Keys("kvs:", queue_shards=1)
    engine = await started(redis_server.url, keys)
    try:
        assert engine.homes is None
        hex_id = engine.new_request_hex("cmpl-")
        assert len(hex_id) == 32 and int(hex_id, 16) >= 0
        assert roster_size(redis_server.url, keys) == 0
    finally:
        await engine.close()


async def test_a_roster_that_cannot_be_read_keeps_the_last_shares():
    keys = Keys("kvs:", queue_shards=3)
    dead = Redis(port=free_port(), socket_connect_timeout=0.2)
    homes = GatewayHomes(dead, keys, command_timeout_s=1.0)
    try:
        assert await homes.update() is False
        assert homes.place == (-1, 0)
        assert homes.shares == gateway_shard_shares(-1, 0, 3)
        assert {keys.shard_of("x" + homes.request_hex("x")) for _ in range(60)} == {0, 1, 2}
    finally:
        await dead.aclose()


async def test_the_gateway_metrics_export_the_place_and_shares(cluster_url):
    from prometheus_client.exposition import generate_latest

    from kvfleet.gateway.dashboard.metrics import GatewayMetrics

    keys = Keys("kvs:", queue_shards=3)
    engines = [await started(cluster_url, keys) for _ in range(2)]
    try:
        await engines[0].homes.update()
        metrics = GatewayMetrics("m")
        metrics.watch_shard_shares(engines[0].homes)
        text = generate_latest(metrics.registry).decode()
        assert 'kvfleet_gateway_live_gateways{model="m"} 2.0' in text
        assert 'kvfleet_gateway_shard_share{model="m",shard="0"} 0.666' in text
        assert 'kvfleet_gateway_shard_share{model="m",shard="1"} 0.333' in text
        assert 'shard="2"' not in text
    finally:
        for engine in engines:
            await engine.close()


async def test_the_roster_task_outlives_an_unexpected_error():
    keys = Keys("kvs:", queue_shards=3)
    homes = GatewayHomes(Redis(port=free_port()), keys, ttl_s=0.04)
    calls = []

    async def flaky_update(join: bool = True) -> bool:
        calls.append(join)
        if len(calls) == 1:
            raise RuntimeError("Future attached to a different loop")
        return True

    homes.update = flaky_update
    task = asyncio.create_task(homes.run())
    await asyncio.sleep(0.1)  # renewals every 10 ms
    assert not task.done()
    task.cancel()
    assert len(calls) >= 3  # it went on after the first one raised
