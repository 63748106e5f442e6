"""`--routing random` against a real Redis and a real Redis Cluster: the gateway writes each
request to the own stream of a uniformly random live worker that reads new requests, blind to
what the workers' caches hold, and never to the shared streams once it knows a worker. The
negative control: the same loop with `--routing affinity` sends a repeated prefix to one worker.

The draws come from a seeded `random.Random`, so every run makes the same choices; the bounds are
still the statistical ones (within 40% of the mean over 400 draws among 4 workers: ~4.6 standard
deviations), so another seed would pass too."""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from kvfleet.gateway.dashboard.router import routing_summary
from kvfleet.gateway.fleet.affinity import Router
from kvfleet.gateway.fleet.redis_client import RedisEngineClient
from kvfleet.gateway.fleet.redis_context import RedisContext
from kvfleet.shared.redis_connect import connect
from kvfleet.shared.settings import GatewaySettings
from kvfleet.shared.wire import GenerationRequest, Heartbeat, Keys, SamplingParams
from kvfleet.shared.wire.affinity import ANNOUNCE_BLOCKS, announce_blocks
from kvfleet.shared.wire.prefix_hash import block_hashes, pack_ids, root_hash

pytestmark = pytest.mark.topologies

MODEL = "tiny-model"
BLOCK = 16
TTL_MS = 10_000
TAKERS = ("w-a", "w-b", "w-c", "w-d")  # live, reading new requests
REQUESTS = 400


@pytest.fixture
def keys(redis_topology) -> Keys:
    return Keys("kvrr:", queue_shards=3 if redis_topology == "cluster" else 1)


@pytest.fixture
def sync(redis_url):
    connection = connect(redis_url)
    yield connection
    connection.close()


def beat(sync, keys, worker: str, **fields) -> None:
    """A live worker with its own streams, as a worker's start and heartbeat leave it."""
    heartbeat = Heartbeat(model=MODEL, ts=time.time(), blocks_total=1000, blocks_free=1000,
                          block_size=BLOCK, max_running=32, **fields)
    sync.hset(keys.worker(worker), mapping=heartbeat.encode())
    sync.expire(keys.worker(worker), 30)
    sync.sadd(keys.worker_queue_owners(MODEL), worker)


def fleet(sync, keys) -> None:
    """Four workers that take new requests, one draining and one decode-only (never chosen)."""
    for worker in TAKERS:
        beat(sync, keys, worker)
    beat(sync, keys, "w-draining", draining=1)
    beat(sync, keys, "w-decode", role="decode")


def own_entries(sync, keys, worker: str) -> int:
    return sum(sync.xlen(stream) for stream in keys.worker_queues(MODEL, worker))


async def send_repeated_prefix(engine: RedisEngineClient, prompt: list[int]) -> None:
    """REQUESTS requests of one prompt, each ended before the next (no load builds up, so only
    the policy decides where each goes)."""
    for i in range(REQUESTS):
        request = GenerationRequest(req_id=f"cmpl-rr-{i}", model=MODEL, prompt_token_ids=prompt,
                                    params=SamplingParams(max_tokens=4),
                                    deadline=time.time() + 30, created=time.time())
        assert await engine.enqueue(request)
        engine.router.finished(request.req_id)


async def started(redis_url, keys, router_of) -> RedisEngineClient:
    engine = RedisEngineClient.from_url(redis_url, keys, shard_shares=False)
    engine.router = router_of(engine)
    await engine.start()
    engine.router.follow(MODEL)
    await engine.router.refresh_loads(MODEL)
    return engine


async def test_random_routing_spreads_a_repeated_prefix_over_the_workers_own_streams(
        redis_url, sync, keys):
    fleet(sync, keys)
    engine = await started(redis_url, keys, lambda e: Router(
        e.redis, keys, policy="random", rng=random.Random(51), listing_ttl_ms=TTL_MS))
    try:
        assert engine.router.indexes == {}  # no announcements followed
        await send_repeated_prefix(engine, list(range(1000, 1200)))
        counts = {w: own_entries(sync, keys, w) for w in TAKERS}
        assert sum(counts.values()) == REQUESTS, counts
        mean = REQUESTS / len(TAKERS)
        assert all(0.6 * mean <= n <= 1.4 * mean for n in counts.values()), counts
        assert own_entries(sync, keys, "w-draining") == own_entries(sync, keys, "w-decode") == 0
        assert all(sync.xlen(stream) == 0 for stream in keys.all_queues(MODEL))
        assert engine.router.stats.routed == {"random": REQUESTS}
        assert routing_summary(engine.router) == {
            "mode": "random", "affinity": None, "least_loaded": None, "random": REQUESTS,
            "shared": 0}
    finally:
        await engine.router.close()
        await engine.close()


async def test_affinity_sends_the_same_repeated_prefix_to_one_worker(redis_url, sync, keys):
    """The negative control: the loop above with the affinity policy (workers announce the
    prefix once one holds it; before that, the router's expected blocks keep it on one)."""
    fleet(sync, keys)
    prompt = list(range(1000, 1200))
    engine = await started(redis_url, keys, lambda e: Router(e.redis, keys,
                                                              listing_ttl_ms=TTL_MS))
    try:
        deadline = time.monotonic() + 5
        while not engine.router.indexes[MODEL].synced:
            assert time.monotonic() < deadline, "the prefix index never synced"
            await asyncio.sleep(0.02)
        await send_repeated_prefix(engine, prompt)
        counts = {w: own_entries(sync, keys, w) for w in TAKERS}
        assert sorted(counts.values()) == [0, 0, 0, REQUESTS], counts
    finally:
        await engine.router.close()
        await engine.close()


async def test_an_announced_prefix_does_not_sway_random_routing(redis_url, sync, keys):
    """One worker announces the whole prompt: affinity would send every request there, random
    still spreads them."""
    fleet(sync, keys)
    prompt = list(range(5000, 5200))
    call = announce_blocks(keys, MODEL, "w-a", ttl_ms=TTL_MS, clear=True, removed=b"",
                           stored=pack_ids(block_hashes(prompt, BLOCK, root_hash(MODEL))))
    ANNOUNCE_BLOCKS.register(sync)(keys=call.keys, args=call.args)
    engine = await started(redis_url, keys, lambda e: Router(
        e.redis, keys, policy="random", rng=random.Random(7), listing_ttl_ms=TTL_MS))
    try:
        await send_repeated_prefix(engine, prompt)
        counts = {w: own_entries(sync, keys, w) for w in TAKERS}
        assert max(counts.values()) <= 0.4 * REQUESTS, counts
    finally:
        await engine.router.close()
        await engine.close()


async def test_the_setting_picks_the_policy(redis_url, keys):
    """`--routing random` builds the router with policy random; `shared` builds none."""
    for routing, policy in (("random", "random"), ("affinity", "affinity"), ("shared", None)):
        context = RedisContext(redis_url, keys)
        try:
            client = RedisEngineClient.from_settings(
                GatewaySettings(redis_url=redis_url, routing=routing), context)
            assert (client.router.policy if client.router is not None else None) == policy
        finally:
            await context.aclose()
    with pytest.raises(ValueError, match="routing policy"):
        Router(None, keys, policy="round_robin")
