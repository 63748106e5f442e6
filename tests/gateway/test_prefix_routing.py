"""Prefix-affinity routing in the gateway against a real Redis and a real Redis Cluster: the prefix
index follows the workers' announcements (made here with the workers' own script), takes a
snapshot again when its position was trimmed away, forgets dead workers; the router sends a
request to the worker holding most of its prompt unless load outweighs it, and to the shared
streams when no worker holds enough; enqueue writes the chosen worker's own stream."""

from __future__ import annotations

import asyncio
import time

import pytest

from kvfleet.gateway.dashboard.metrics import _RouterCollector
from kvfleet.gateway.dashboard.router import add_routing, routing_summary
from kvfleet.gateway.fleet.affinity import Router
from kvfleet.gateway.fleet.prefix_index import PrefixIndex
from kvfleet.gateway.fleet.redis_client import RedisEngineClient
from kvfleet.shared.redis_connect import connect
from kvfleet.shared.wire import GenerationRequest, Heartbeat, Keys, QueueEntry, SamplingParams
from kvfleet.shared.wire.affinity import ANNOUNCE_BLOCKS, KvEvent, announce_blocks
from kvfleet.shared.wire.prefix_hash import block_hashes, lora_root, pack_ids, root_hash

pytestmark = pytest.mark.topologies

MODEL = "tiny-model"
BLOCK = 16
TTL_MS = 10_000


@pytest.fixture
def keys(redis_topology) -> Keys:
    return Keys("kvr:", queue_shards=3 if redis_topology == "cluster" else 1)


@pytest.fixture
def sync(redis_url):
    connection = connect(redis_url)
    yield connection
    connection.close()


def prompt_of(tenant: int, length: int) -> list[int]:
    return [1000 * tenant + i for i in range(length)]


def hashes(prompt: list[int]) -> list[bytes]:
    return block_hashes(prompt, BLOCK, root_hash(MODEL))


def announce(sync, keys, worker: str, stored=(), removed=(), clear=False, host=()) -> None:
    call = announce_blocks(keys, MODEL, worker, ttl_ms=TTL_MS, stored=pack_ids(stored),
                           removed=pack_ids(removed), clear=clear, host=pack_ids(host))
    ANNOUNCE_BLOCKS.register(sync)(keys=call.keys, args=call.args)


def beat(sync, keys, worker: str, *, running=0, blocks_free=1000, ttl_s=30, **fields) -> None:
    """A live worker with its own streams, as a worker's start and heartbeat leave it."""
    heartbeat = Heartbeat(model=MODEL, ts=time.time(), blocks_total=1000,
                          blocks_free=blocks_free, running=running, block_size=BLOCK,
                          max_running=32, **fields)
    sync.hset(keys.worker(worker), mapping=heartbeat.encode())
    sync.expire(keys.worker(worker), ttl_s)
    sync.sadd(keys.worker_queue_owners(MODEL), worker)


async def eventually(check, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "condition never held"
        await asyncio.sleep(0.02)


@pytest.fixture
async def router(redis_url, keys):
    engine = RedisEngineClient.from_url(redis_url, keys, shard_shares=False,
                                        router=None)
    router = Router(engine.redis, keys, balance=1.25, listing_ttl_ms=TTL_MS)
    yield router
    await router.close()
    await engine.close()


async def test_the_index_starts_from_a_snapshot_and_follows_the_events(router, sync, keys):
    a = hashes(prompt_of(1, 128))
    # live workers: the router's load follower drops the sets of workers without a heartbeat,
    # which raced this test's first reads when it ran before them
    beat(sync, keys, "w-a")
    beat(sync, keys, "w-b")
    announce(sync, keys, "w-a", stored=a[:3], clear=True)  # before the gateway looks
    router.follow(MODEL)
    index = router.indexes[MODEL]
    await eventually(lambda: index.synced)
    assert index.leading("w-a", [h[:8] for h in a]) == 3
    announce(sync, keys, "w-a", stored=a[3:4], removed=a[1:2])
    announce(sync, keys, "w-b", stored=a[:2], clear=True)
    await eventually(lambda: index.leading("w-b", [h[:8] for h in a]) == 2)
    assert index.leading("w-a", [h[:8] for h in a]) == 1  # its second block was evicted
    assert index.sets["w-a"] == {h[:8] for h in (a[0], a[2], a[3])}
    announce(sync, keys, "w-a", stored=a[5:6], clear=True)  # a restart under the same id
    await eventually(lambda: index.sets["w-a"] == {a[5][:8]})
    index.forget_except({"w-b"})
    assert "w-a" not in index.sets and index.leading("w-b", [h[:8] for h in a]) == 2
    # Dropped while its heartbeat was missing, w-a announces again: the index reads it whole.
    announce(sync, keys, "w-a", stored=a[6:7])
    await eventually(lambda: index.sets.get("w-a") == {a[5][:8], a[6][:8]})


async def test_an_index_behind_a_trimmed_stream_takes_a_snapshot_again(redis_url, sync, keys):
    engine = RedisEngineClient.from_url(redis_url, keys, shard_shares=False)
    try:
        index = PrefixIndex(engine.redis, keys, MODEL, listing_ttl_ms=TTL_MS, block_ms=10)
        a = hashes(prompt_of(2, 160))
        announce(sync, keys, "w-a", stored=a[:1], clear=True)
        await index.take_snapshot()
        assert not await index.position_lost()
        for block in a[1:]:  # events the index has not read ...
            announce(sync, keys, "w-a", stored=[block])
        sync.xtrim(keys.kv_events(MODEL), maxlen=2, approximate=False)  # ... trimmed away but for the last two
        assert await index.position_lost()
        index.last_id = None
        await index.take_snapshot()
        assert index.sets["w-a"] == {h[:8] for h in a} and not await index.position_lost()
    finally:
        await engine.close()


def ids(blocks) -> set[bytes]:
    return {h[:8] for h in blocks}


async def test_the_index_keeps_each_blocks_tier_as_blocks_move_between_tiers(redis_url, sync,
                                                                              keys):
    """device -> host tier -> dropped, host tier -> device, new straight into the host tier:
    after each event the index (and Redis's sets) hold each block in its tier, as a snapshot
    taken then does; a reader that knows no tiers sees every block held, in either tier."""
    engine = RedisEngineClient.from_url(redis_url, keys, shard_shares=False)
    try:
        follower = PrefixIndex(engine.redis, keys, MODEL, listing_ttl_ms=TTL_MS, block_ms=10)
        a = hashes(prompt_of(6, 160))
        announce(sync, keys, "w-a", stored=a[:6], clear=True)
        await follower.take_snapshot()
        steps = [  # (announcement, held afterwards, of them in the host tier)
            (dict(host=a[3:6]), a[:6], a[3:6]),  # the pool evicts three blocks into the tier
            (dict(removed=a[5:6]), a[:5], a[3:5]),  # the tier drops one
            (dict(stored=a[3:4]), a[:5], a[4:5]),  # one is brought back into the pool
            # new, straight into the tier
            (dict(stored=a[6:7], host=a[6:7]), a[:5] + a[6:7], a[4:5] + a[6:7]),
            (dict(removed=a[4:5] + a[0:1]), a[1:4] + a[6:7], a[6:7]),  # dropped, evicted
        ]
        old_view = {h[:8] for h in a[:6]}  # what a gateway reading only `s` and `r` holds
        for change, held, host in steps:
            announce(sync, keys, "w-a", **change)
            while await follower.read_events():
                pass
            assert (follower.sets["w-a"], follower.host["w-a"]) == (ids(held), ids(host))
            assert sync.smembers(keys.kv_blocks(MODEL, "w-a")) == ids(held)
            assert sync.smembers(keys.kv_host_blocks(MODEL, "w-a")) == ids(host)
            fresh = PrefixIndex(engine.redis, keys, MODEL, listing_ttl_ms=TTL_MS)
            await fresh.take_snapshot()
            assert (fresh.sets, fresh.host) == (follower.sets, follower.host)
            last = KvEvent.decode(sync.xrevrange(keys.kv_events(MODEL), count=1)[0][1])
            old_view = (old_view - set(last.removed)) | set(last.stored)
            assert old_view == ids(held)  # an older gateway: held, at one weight
        assert follower.num_host_blocks == 1 and follower.num_blocks == 4
        announce(sync, keys, "w-a", stored=a[:1], clear=True)  # a new start empties both
        while await follower.read_events():
            pass
        assert (follower.sets["w-a"], follower.host["w-a"]) == (ids(a[:1]), set())
        assert not sync.exists(keys.kv_host_blocks(MODEL, "w-a"))
    finally:
        await engine.close()


async def test_a_host_tier_block_scores_below_a_device_block_and_above_none(redis_url, sync,
                                                                             keys):
    """Three workers, one prompt: w-a holds its first 6 blocks on device, w-b the same 6 with
    the last 4 in its host tier, w-c none. Weight 0.75: w-a, then w-b over w-c; weight 1.0
    (the negative control): w-b scores like w-a (the tie goes to the less loaded); weight 0:
    w-b's host-tier blocks count as absent (w-b holding 2 device blocks ranks as holding 2)."""
    tenant = prompt_of(7, 200)
    a = hashes(tenant)
    for worker in ("w-a", "w-b", "w-c"):
        beat(sync, keys, worker)
    announce(sync, keys, "w-a", stored=a[:6], clear=True)
    announce(sync, keys, "w-b", stored=a[:6], host=a[2:6], clear=True)
    announce(sync, keys, "w-c", clear=True)
    engine = RedisEngineClient.from_url(redis_url, keys, shard_shares=False, router=None)
    routers = []
    try:
        async def make(weight: float, host_blocks: int = 4) -> Router:
            router = Router(engine.redis, keys, listing_ttl_ms=TTL_MS, balance=10.0,
                            host_tier_weight=weight)
            routers.append(router)
            await synced_router(router, sync, keys, ["w-a", "w-b", "w-c"])
            await eventually(lambda: router.indexes[MODEL].num_host_blocks == host_blocks)
            return router

        default = await make(0.75)
        route = default.route(MODEL, tenant)
        assert (route.worker, route.cached_tokens, route.host_tier_tokens) == ("w-a", 6 * BLOCK, 0)
        # without w-a (draining), the host-tier holder beats the worker holding nothing
        beat(sync, keys, "w-a", draining=1)
        await default.refresh_loads(MODEL)
        route = default.route(MODEL, tenant)
        assert (route.worker, route.reason) == ("w-b", "affinity")
        # its admission counts only the device blocks as cached; the rest comes from the tier
        assert (route.cached_tokens, route.host_tier_tokens) == (2 * BLOCK, 4 * BLOCK)
        assert default.stats.host_tier_tokens == 4 * BLOCK
        samples = {(m.name, sample.value) for m in _RouterCollector(default).collect()
                   for sample in m.samples}
        assert ("kvfleet_gateway_routed_host_tier_tokens", 4 * BLOCK) in samples
        assert ("kvfleet_gateway_prefix_index_host_blocks", 4) in samples
        beat(sync, keys, "w-a")
        await default.refresh_loads(MODEL)

        # weight 1.0: host-tier blocks score like device ones; w-a has one in flight, so w-b
        alike = await make(1.0)
        alike.loads[MODEL].routed("w-a")
        assert alike.route(MODEL, tenant).worker == "w-b"
        # ... while at 0.75 the device holder wins despite that request in flight
        default.loads[MODEL].routed("w-b")
        default.loads[MODEL].routed("w-a")
        assert default.route(MODEL, tenant).worker == "w-a"

        # weight 0: a host-tier block adds nothing: w-b scores as a worker holding 2 blocks,
        # which loses to w-c holding 3 on device (announced now)
        announce(sync, keys, "w-c", stored=a[:3])
        absent = await make(0.0)
        await eventually(lambda: len(absent.indexes[MODEL].sets.get("w-c", ())) == 3)
        beat(sync, keys, "w-a", draining=1)
        await absent.refresh_loads(MODEL)
        assert absent.route(MODEL, tenant).worker == "w-c"
        # and with only host-tier blocks and weight 0, w-b holds nothing here: least loaded (a
        # new router: the last one expects the prompt at w-c, where it routed it)
        announce(sync, keys, "w-b", stored=a[:6], host=a[:6], clear=True)
        announce(sync, keys, "w-c", clear=True)  # (w-a, holding it on device, drains)
        nothing = await make(0.0, host_blocks=6)
        await eventually(lambda: not nothing.indexes[MODEL].sets.get("w-c"))
        assert nothing.route(MODEL, tenant).reason == "least_loaded"
        with pytest.raises(ValueError):
            Router(engine.redis, keys, host_tier_weight=1.5)
    finally:
        for router in routers:
            await router.close()
        await engine.close()


async def synced_router(router, sync, keys, workers) -> Router:
    router.follow(MODEL)
    await router.refresh_loads(MODEL)
    await eventually(lambda: router.indexes[MODEL].synced)
    assert sorted(router.loads[MODEL].beats) == sorted(workers)
    return router


async def test_the_router_picks_the_worker_holding_the_longest_prefix(router, sync, keys):
    tenant, other = prompt_of(3, 200), prompt_of(4, 200)
    for worker in ("w-a", "w-b", "w-c"):
        beat(sync, keys, worker)
    announce(sync, keys, "w-a", stored=hashes(tenant)[:4], clear=True)
    announce(sync, keys, "w-b", stored=hashes(tenant)[:9], clear=True)
    announce(sync, keys, "w-c", stored=hashes(other)[:12], clear=True)
    await synced_router(router, sync, keys, ["w-a", "w-b", "w-c"])
    await eventually(lambda: router.indexes[MODEL].num_blocks == 25)
    route = router.route(MODEL, tenant)
    assert (route.worker, route.cached_tokens, route.reason) == ("w-b", 9 * BLOCK, "affinity")
    # A prompt nobody holds goes to the least loaded worker (w-b has one in flight) ...
    fresh = prompt_of(5, 200)
    route = router.route(MODEL, fresh)
    assert (route.worker, route.cached_tokens, route.reason) == ("w-a", 0, "least_loaded")
    # ... which the next request sharing its first blocks follows before any announcement.
    route = router.route(MODEL, fresh[:100] + prompt_of(9, 100))
    assert (route.worker, route.cached_tokens, route.reason) == ("w-a", 0, "affinity")
    # The last prompt token is always computed: a prompt of exactly 4 blocks reuses at most 3
    # (w-a and w-b hold them; w-b has fewer requests in flight now).
    route = router.route(MODEL, tenant[:4 * BLOCK])
    assert (route.worker, route.cached_tokens) == ("w-b", 3 * BLOCK)
    assert router.stats.routed == {"affinity": 3, "least_loaded": 1}
    # the dashboard's rows: blocks in this gateway's index and requests routed, per worker
    rows = [{"id": w} for w in ("w-a", "w-b", "w-c")]
    add_routing(rows, router, MODEL)
    assert [(r["indexed_blocks"], r["routed"]) for r in rows] == [(4, 2), (9, 2), (12, 0)]
    assert routing_summary(router) == {"mode": "affinity", "affinity": 3, "least_loaded": 1,
                                       "random": None, "shared": 0}


async def test_load_wins_over_affinity_when_the_holder_is_busy(router, sync, keys):
    tenant = prompt_of(6, 200)
    beat(sync, keys, "w-hot", running=6)
    beat(sync, keys, "w-cold")
    beat(sync, keys, "w-warm")
    announce(sync, keys, "w-hot", stored=hashes(tenant)[:10], clear=True)
    announce(sync, keys, "w-warm", stored=hashes(tenant)[:2], clear=True)
    await synced_router(router, sync, keys, ["w-hot", "w-cold", "w-warm"])
    await eventually(lambda: router.indexes[MODEL].num_blocks == 12)
    # 6 running against a mean of 7/3: the holder of 10 blocks is past the balance; the holder
    # of 2 takes it.
    assert router.route(MODEL, tenant).worker == "w-warm"
    # Requests this gateway routed count as load: loads (6, 0, 4) after three more, with a mean
    # of 11/3 after the next one, whose 1.25x the warm worker's 5 would pass; then the least
    # loaded worker takes it, and from then on is expected to hold the prompt too: the next
    # request, which the balance lets the warm worker take again, goes there (it announced
    # two of the blocks, the cold worker none yet).
    routes = [router.route(MODEL, tenant) for _ in range(5)]
    assert [(r.worker, r.reason) for r in routes] == [
        ("w-warm", "affinity"), ("w-warm", "affinity"), ("w-warm", "affinity"),
        ("w-cold", "least_loaded"), ("w-warm", "affinity")]
    assert router.stats.by_worker == {"w-warm": 5, "w-cold": 1}


async def test_a_worker_whose_free_kv_cannot_hold_the_prompt_is_passed_over(router, sync, keys):
    tenant = prompt_of(7, 400)
    beat(sync, keys, "w-full", blocks_free=3)  # 48 tokens free
    beat(sync, keys, "w-roomy")
    announce(sync, keys, "w-full", stored=hashes(tenant)[:12], clear=True)
    announce(sync, keys, "w-roomy", stored=hashes(tenant)[:5], clear=True)
    await synced_router(router, sync, keys, ["w-full", "w-roomy"])
    await eventually(lambda: router.indexes[MODEL].num_blocks == 17)
    assert router.route(MODEL, tenant).worker == "w-roomy"


async def test_draining_and_decode_workers_are_never_chosen(router, sync, keys):
    """They read no new requests: whatever they hold, a request goes to a worker that does, or
    to the shared streams while none does."""
    tenant = prompt_of(11, 200)
    beat(sync, keys, "w-draining", draining=1)
    beat(sync, keys, "w-decode", role="decode")
    beat(sync, keys, "w-prefill", role="prefill", running=5)
    announce(sync, keys, "w-draining", stored=hashes(tenant)[:10], clear=True)
    announce(sync, keys, "w-decode", stored=hashes(tenant)[:9], clear=True)
    await synced_router(router, sync, keys, ["w-decode", "w-draining", "w-prefill"])
    await eventually(lambda: router.indexes[MODEL].num_blocks == 19)
    routes = [router.route(MODEL, tenant) for _ in range(3)]
    assert [(r.worker, r.cached_tokens) for r in routes] == [("w-prefill", 0)] * 3
    beat(sync, keys, "w-prefill", role="prefill", draining=1)  # the last one drains too
    await router.refresh_loads(MODEL)
    route = router.route(MODEL, tenant)
    assert (route.worker, route.reason) == (None, "shared")


async def test_enqueue_writes_the_chosen_workers_own_stream(redis_url, sync, keys):
    tenant = prompt_of(8, 100)
    beat(sync, keys, "w-a")
    announce(sync, keys, "w-a", stored=hashes(tenant)[:5], clear=True)
    engine = RedisEngineClient.from_url(redis_url, keys, shard_shares=False)
    engine.router = Router(engine.redis, keys, listing_ttl_ms=TTL_MS)
    await engine.start()
    try:
        await synced_router(engine.router, sync, keys, ["w-a"])
        request = GenerationRequest(req_id="cmpl-affinity-1", model=MODEL,
                                    prompt_token_ids=tenant, params=SamplingParams(max_tokens=4),
                                    deadline=time.time() + 30, created=time.time())
        assert await engine.enqueue(request)
        (entry_id, fields), = sync.xrange(keys.worker_queue(MODEL, "w-a"))
        entry = QueueEntry.decode(fields)
        assert entry.request.req_id == request.req_id and entry.cached_tokens == 5 * BLOCK
        assert all(sync.xlen(stream) == 0 for stream in keys.all_queues(MODEL))
        # Backpressure counts what waits in own streams too.
        load = await engine.queue_load(MODEL)
        assert load.undelivered == 1
    finally:
        await engine.router.close()
        await engine.close()


async def test_an_adapters_prompts_are_routed_by_the_adapters_blocks(redis_url, sync, keys):
    """Workers hash a LoRA adapter's blocks from lora_root(model, name, path): the router matches an
    adapter's prompt there, never against the base model's blocks of the same tokens; the entry
    carries the adapter's name and directory."""
    tenant = prompt_of(10, 100)
    beat(sync, keys, "w-base")
    beat(sync, keys, "w-sql")
    announce(sync, keys, "w-base", stored=hashes(tenant)[:5], clear=True)
    announce(sync, keys, "w-sql", stored=block_hashes(tenant, BLOCK,
                                                  lora_root(MODEL, "sql", "/adapters/sql"))[:3],
             clear=True)
    engine = RedisEngineClient.from_url(redis_url, keys, shard_shares=False)
    engine.router = Router(engine.redis, keys, listing_ttl_ms=TTL_MS)
    await engine.start()
    try:
        await synced_router(engine.router, sync, keys, ["w-base", "w-sql"])
        await eventually(lambda: engine.router.indexes[MODEL].num_blocks == 8)
        request = GenerationRequest(req_id="cmpl-lora-1", model=MODEL, prompt_token_ids=tenant,
                                    params=SamplingParams(max_tokens=4),
                                    deadline=time.time() + 30, created=time.time(), lora="sql",
                                    lora_path="/adapters/sql")
        assert await engine.enqueue(request)
        (_entry_id, fields), = sync.xrange(keys.worker_queue(MODEL, "w-sql"))
        entry = QueueEntry.decode(fields)
        assert (entry.request.lora, entry.request.lora_path, entry.cached_tokens) == \
            ("sql", "/adapters/sql", 3 * BLOCK)
        # the base model's request of the same prompt goes to the base blocks' holder
        route = engine.router.route(MODEL, tenant)
        assert (route.worker, route.cached_tokens) == ("w-base", 5 * BLOCK)
        assert engine.router.model_stats[MODEL].routed == {"affinity": 2}
    finally:
        await engine.router.close()
        await engine.close()
