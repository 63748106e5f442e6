"""The worker's side of prefix-affinity routing on a real Redis and a real Redis Cluster: block
announcements, own streams read first, other workers' own streams after a bounded wait (at once
when their owner is gone or cannot hold the entry), admission counting cached tokens, and the
resume of a dead worker's request by the worker holding its prefix."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import redis

from kvfleet.gateway.fleet.affinity import Router
from kvfleet.gateway.fleet.redis_client import RedisEngineClient
from kvfleet.shared.redis_connect import connect
from kvfleet.shared.wire import GenerationRequest, Heartbeat, Keys, RequestRecord, SamplingParams, scripts
from kvfleet.shared.wire.affinity import KvEvent, PREFIX_MATCH, prefix_match
from kvfleet.shared.wire.prefix_hash import block_hashes, pack_ids, root_hash
from tests.engine.tiny_models import TinyModel, random_prompt
from tests.helpers.channels import fleet_keys
from tests.integration.test_worker_service import MODEL, Client, make_service, run_until
from kvfleet.worker.protocol import WorkerProtocol

pytestmark = pytest.mark.topologies

BS = 4  # make_service's engines


@pytest.fixture(scope="module")
def tiny() -> TinyModel:
    return TinyModel("llama")


@pytest.fixture
def client(redis_client) -> Client:
    return Client(redis_client, fleet_keys(redis_client))


def enqueue(client: redis.Redis, keys: Keys, req_id: str, prompt_len: int = 3,
            owner: str = "", cached_tokens: int = 0) -> None:
    """A request in the shared streams, or in `owner`'s own stream with `cached_tokens`."""
    request = GenerationRequest(req_id, MODEL, list(range(10, 10 + prompt_len)),
                                SamplingParams(max_tokens=4))
    client.hset(keys.request(req_id), mapping=RequestRecord(request).encode())
    stream, fields = scripts.queue_entry(keys, request, owner, cached_tokens)
    client.xadd(stream, fields)


def protocol_of(client: redis.Redis, worker_id: str, steal_after_ms: int = 0,
                gone_grace_s: float = 60.0) -> WorkerProtocol:
    """A worker's protocol that reads the owners at every fill."""
    protocol = WorkerProtocol(client, fleet_keys(client), MODEL, worker_id, result_ttl_s=60,
                              affinity_steal_after_ms=steal_after_ms, owners_refresh_s=0,
                              owner_gone_grace_s=gone_grace_s)
    protocol.ensure_groups()
    return protocol


def beat(protocol: WorkerProtocol, blocks_free: int = 1000, block_size: int = BS) -> None:
    protocol.heartbeat(Heartbeat(MODEL, 0.0, blocks_total=blocks_free, blocks_free=blocks_free,
                                 block_size=block_size), ttl_s=30)


def taken(protocol: WorkerProtocol, budget_tokens: int = 1000) -> list[tuple[str, str]]:
    return [(d.request.req_id, d.source) for d in protocol.read_batch(budget_tokens, 10).deliveries]


# ---- announcements ---------------------------------------------------------------------------

def test_a_workers_cached_blocks_land_in_redis_and_another_worker_matches_them(
        redis_url, client, tiny):
    worker = make_service(redis_url, tiny, "w1")
    keys = client.keys
    events = client.redis.xrange(keys.kv_events(MODEL))
    assert [KvEvent.decode(f) for _, f in events] == [KvEvent("w1", cleared=True)]  # at connect
    prompt = random_prompt(13, seed=3)
    req_id = client.send(prompt, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    run_until(worker, lambda: client.final(req_id))
    hashes = block_hashes(prompt + client.text(req_id)[:3], BS, root_hash(MODEL))  # 16 computed
    assert client.redis.smembers(keys.kv_blocks(MODEL, "w1")) == set(h[:8] for h in hashes)
    assert client.redis.zscore(keys.kv_workers(MODEL), "w1") is not None
    stored = [h for _, f in client.redis.xrange(keys.kv_events(MODEL))[1:]
              for h in KvEvent.decode(f).stored]
    assert sorted(stored) == sorted(h[:8] for h in hashes)  # each once, in the steps' events

    # what a second worker (resuming a request) or a gateway asks of the index
    other = protocol_of(client.redis, "w2")
    call = prefix_match(keys, MODEL, ["w1", "w2"], pack_ids(block_hashes(prompt, BS,
                                                                         root_hash(MODEL))))
    assert [int(n) for n in PREFIX_MATCH.register(other.client)(keys=call.keys,
                                                                args=call.args)] == [3, 0]
    text = worker.metrics.render().decode()
    labels = 'model="tiny",worker="w1"'
    assert f'kvfleet_worker_kv_indexed_blocks{{{labels}}} 4.0' in text
    assert f'kvfleet_worker_kv_announced_blocks_total{{change="stored",{labels}}} 4.0' in text
    assert f'kvfleet_worker_kv_announced_blocks_total{{change="removed",{labels}}} 0.0' in text


def test_an_announcement_lost_to_an_outage_is_sent_with_the_next(redis_url, client, tiny):
    worker = make_service(redis_url, tiny, "w1")
    worker.protocol.announce = failing = _Failing(worker.protocol.announce)
    req_id = client.send(random_prompt(9, seed=4), SamplingParams(max_tokens=1, ignore_eos=True))
    with pytest.raises(redis.ConnectionError):
        run_until(worker, lambda: client.final(req_id))
    assert failing.calls == 1 and worker.announcer._unannounced  # kept
    worker.protocol.announce = failing.announce
    worker.announcer.announce()  # nothing new since: the kept change alone goes out
    assert client.redis.scard(client.keys.kv_blocks(MODEL, "w1")) == 2


class _Failing:
    """An announce that fails once, as Redis going away would make it."""

    def __init__(self, announce):
        self.announce, self.calls = announce, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        raise redis.ConnectionError("Redis went away")


def test_a_set_lost_in_redis_is_announced_again_in_whole(redis_url, client, tiny):
    worker = make_service(redis_url, tiny, "w1")
    req_id = client.send(random_prompt(9, seed=4), SamplingParams(max_tokens=1, ignore_eos=True))
    run_until(worker, lambda: client.final(req_id))
    blocks = client.keys.kv_blocks(MODEL, "w1")
    assert client.redis.scard(blocks) == 2
    client.redis.delete(blocks)  # expired (a heartbeat thread stalled) or a Redis restart
    worker._beat()
    worker.run_once()
    assert client.redis.scard(blocks) == 2
    last = KvEvent.decode(client.redis.xrevrange(client.keys.kv_events(MODEL), count=1)[0][1])
    assert last.cleared and len(last.stored) == 2


def test_a_worker_routing_to_shared_streams_announces_nothing(redis_url, client, tiny):
    worker = make_service(redis_url, tiny, "w1", routing="shared")
    req_id = client.send(random_prompt(9, seed=4), SamplingParams(max_tokens=2, ignore_eos=True))
    run_until(worker, lambda: client.final(req_id))
    worker._beat()
    assert not client.redis.exists(client.keys.kv_blocks(MODEL, "w1"))
    assert not client.redis.exists(client.keys.kv_workers(MODEL))


def test_the_heartbeat_tells_block_size_max_running_and_own_queue(redis_url, client, tiny):
    worker = make_service(redis_url, tiny, "w1", max_running=3)
    for name in ("a", "b"):
        enqueue(client.redis, client.keys, name, owner="w1")
    worker._snapshot_stats()
    worker._beat()
    beat = Heartbeat.decode(client.redis.hgetall(client.keys.worker("w1")))
    assert (beat.block_size, beat.max_running, beat.own_queue) == (BS, 3, 2)


# ---- own streams -----------------------------------------------------------------------------

def test_a_worker_takes_its_own_streams_entries_before_the_shared_ones(redis_client):
    protocol = protocol_of(redis_client, "w1")
    keys = protocol.keys
    enqueue(redis_client, keys, "shared-1")
    enqueue(redis_client, keys, "own-1", owner="w1")
    assert redis_client.sismember(keys.worker_queue_owners(MODEL), "w1")
    assert taken(protocol)[:2] == [("own-1", "own"), ("shared-1", "shared")]
    enqueue(redis_client, keys, "shared-2")
    enqueue(redis_client, keys, "own-2", owner="w1")
    delivery = protocol.read_batch(1000, 1).deliveries[0]
    assert (delivery.request.req_id, delivery.stream) == ("own-2", keys.worker_queue(MODEL, "w1"))


def test_admission_of_an_own_entry_counts_only_its_uncached_tokens(redis_client):
    protocol = protocol_of(redis_client, "w1")
    keys = protocol.keys
    enqueue(redis_client, keys, "own", prompt_len=12, owner="w1", cached_tokens=8)
    enqueue(redis_client, keys, "shared", prompt_len=4)
    # 4 uncached tokens of the own entry, then the shared entry's 4: 8 in all
    assert taken(protocol, budget_tokens=8) == [("own", "own"), ("shared", "shared")]
    assert protocol.read_batch(1000, 10).deliveries == []
    enqueue(redis_client, keys, "own-2", prompt_len=12, owner="w1", cached_tokens=8)
    enqueue(redis_client, keys, "shared-2", prompt_len=4)
    assert taken(protocol, budget_tokens=7) == [("own-2", "own")]  # 3 left: shared-2 stays
    assert protocol.read_batch(3, 10).too_large is not None


def test_another_workers_own_entry_is_taken_only_after_the_steal_delay(redis_client):
    owner, thief = protocol_of(redis_client, "owner"), protocol_of(redis_client, "thief", 400)
    beat(owner)
    enqueue(redis_client, owner.keys, "routed", owner="owner")
    assert taken(thief) == []
    time.sleep(0.45)
    delivery = thief.read_batch(1000, 10).deliveries[0]
    assert (delivery.request.req_id, delivery.source) == ("routed", "other")
    assert delivery.cached_tokens == 0  # the thief's cache is not the owner's


def test_another_workers_own_entry_is_taken_at_once_when_its_owner_is_gone(redis_client):
    owner, thief = protocol_of(redis_client, "owner"), protocol_of(redis_client, "thief", 60_000)
    enqueue(redis_client, owner.keys, "routed", owner="owner")  # owner never beat: gone
    assert taken(thief) == [("routed", "other")]


def test_another_workers_own_entry_is_taken_at_once_when_its_owner_cannot_hold_it(redis_client):
    owner = protocol_of(redis_client, "owner")
    beat(owner, blocks_free=2)  # room for 8 tokens
    enqueue(redis_client, owner.keys, "fits", prompt_len=8, owner="owner")
    enqueue(redis_client, owner.keys, "too-large", prompt_len=9, owner="owner")
    # a thief reads one owner's streams at most every half steal delay: a new one each time
    thieves = (protocol_of(redis_client, f"thief-{i}", 60_000) for i in range(2))
    # the head fits its owner and is young: it keeps everything behind it for the owner
    assert taken(next(thieves)) == []
    assert [d.request.req_id for d in owner.read_batch(8, 1).deliveries] == ["fits"]
    assert taken(next(thieves)) == [("too-large", "other")]


def test_a_fill_probes_the_other_owners_at_once_and_reads_only_where_something_waits(
        redis_client):
    """With many owners due a read, one pipelined probe (OWN_STREAMS_WAITING) says whose
    streams hold an undelivered entry, and only those get a READ_IF_FITS: an empty stream, an
    entry already delivered (pending at its owner), a stream without the group and an owner
    without streams are passed over; the entries that wait are taken as before."""
    owners = {name: protocol_of(redis_client, name) for name in
              ("empty", "delivered", "waiting", "gone-waiting")}
    keys = owners["empty"].keys
    for owner in owners.values():
        beat(owner) if owner.worker_id != "gone-waiting" else None
    enqueue(redis_client, keys, "served", owner="delivered")
    owners["delivered"].read_new(keys.worker_queue(MODEL, "delivered"), None)  # pending there
    enqueue(redis_client, keys, "routed", owner="waiting")
    enqueue(redis_client, keys, "orphan", owner="gone-waiting")  # its owner never beat
    redis_client.sadd(keys.worker_queue_owners(MODEL), "no-streams")
    thief = protocol_of(redis_client, "thief", 1)
    thief.owners.refresh()
    probed = thief.owners.with_entries(thief.owners.due_reads())
    assert sorted(read.owner for read in probed) == ["gone-waiting", "waiting"]

    reads = []
    real = thief._read_if_fits
    thief._read_if_fits = lambda **call: reads.append(call["keys"][0]) or real(**call)
    thief.owners._read_at.clear()
    time.sleep(0.01)  # "routed" waited the thief's 1 ms steal delay
    assert sorted(taken(thief)) == [("orphan", "other"), ("routed", "other")]
    foreign = [stream for stream in reads if stream not in thief.streams + thief.own_streams]
    assert sorted(foreign) == sorted([keys.worker_queue(MODEL, "gone-waiting"),
                                      keys.worker_queue(MODEL, "waiting")])
    # a read due alone is not probed (the probe would cost the round trip it saves)
    lone = [read for read in thief.owners.due_reads() if read.owner == "empty"]
    assert thief.owners.with_entries(lone) == lone


def test_the_owners_are_read_with_the_fields_their_rules_need(redis_client):
    """A refresh reads each owner's load and room (HMGET of OWNER_FIELDS, not the whole
    heartbeat); an owner without a heartbeat reads as gone."""
    owner, reader = protocol_of(redis_client, "owner"), protocol_of(redis_client, "reader")
    enqueue(redis_client, owner.keys, "routed", owner="owner")  # its own_queue: 1
    owner.heartbeat(Heartbeat(MODEL, 0.0, blocks_total=50, blocks_free=7, block_size=BS,
                              running=3, waiting=2, metrics_url="http://x"), 30)
    protocol_of(redis_client, "silent")  # listed, never beat
    reader.owners.refresh()
    beat_read = reader.owners.heartbeats["owner"]
    assert (beat_read.model, beat_read.blocks_free, beat_read.block_size, beat_read.running,
            beat_read.waiting, beat_read.own_queue) == (MODEL, 7, BS, 3, 2, 1)
    assert beat_read.ts > 0 and beat_read.metrics_url == ""  # not read: not needed
    assert reader.owners.heartbeats["silent"] is None


def test_a_gone_owners_empty_streams_are_dropped_and_busy_ones_kept(redis_client):
    gone, busy = protocol_of(redis_client, "gone"), protocol_of(redis_client, "busy")
    keys = gone.keys
    enqueue(redis_client, keys, "pending", owner="busy")
    busy.read_new(keys.worker_queue(MODEL, "busy"), None)  # busy dies with it pending
    reader = protocol_of(redis_client, "reader", gone_grace_s=0)
    reader.owners.refresh()  # both gone for the grace (0 here): cleaned up where empty
    assert redis_client.smembers(keys.worker_queue_owners(MODEL)) == {b"busy", b"reader"}
    assert not any(redis_client.exists(s) for s in keys.worker_queues(MODEL, "gone"))
    assert redis_client.exists(keys.worker_queue(MODEL, "busy"))


def test_a_worker_whose_streams_were_dropped_makes_them_again(redis_client):
    """A worker taken for gone (here: it never beat) loses its empty own streams; it makes them
    again when it finds itself unlisted, or when a read finds no group, and an entry routed to
    it in between is served."""
    worker, cleaner = protocol_of(redis_client, "w1"), protocol_of(redis_client, "cleaner", 0, 0)
    owners = worker.keys.worker_queue_owners(MODEL)
    cleaner.owners.refresh()
    assert not redis_client.sismember(owners, "w1")
    enqueue(redis_client, worker.keys, "own-1", owner="w1")  # a stream without group
    [delivery] = worker.read_batch(1000, 10).deliveries
    assert (delivery.request.req_id, delivery.source) == ("own-1", "own")
    assert redis_client.sismember(owners, "w1")

    worker.ack(delivery.stream, delivery.entry_id)  # served: the streams hold nothing again
    cleaner.owners.refresh(force=True)
    assert not redis_client.sismember(owners, "w1")
    assert worker.read_new_any(worker.blocking_reads()[0], None) == []  # NOGROUP: made again
    enqueue(redis_client, worker.keys, "own-2", owner="w1")
    assert [d.request.req_id for d in worker.read_new_any(worker.blocking_reads()[0], None)] \
        == ["own-2"]


def test_an_idle_worker_wakes_for_its_own_stream(redis_client):
    protocol = protocol_of(redis_client, "w1")
    streams = protocol.blocking_reads()[0]
    assert streams[0] == protocol.keys.worker_queue(MODEL, "w1")
    timer = threading.Timer(0.2, enqueue, (redis_client, protocol.keys, "own", 3, "w1"))
    timer.start()
    started = time.monotonic()
    deliveries = protocol.read_new_any(streams, block_ms=5000)
    timer.join()
    assert [(d.request.req_id, d.source) for d in deliveries] == [("own", "own")]
    assert time.monotonic() - started < 4


def test_an_idle_read_survives_its_streams_being_deleted(redis_client):
    """A FLUSHALL (or an operator's DEL) while an idle worker waits: the read ends without a
    request instead of failing the worker, and the streams and groups are there again."""
    protocol = protocol_of(redis_client, "w1")
    streams = protocol.blocking_reads()[0]
    timer = threading.Timer(0.2, redis_client.delete, streams)
    timer.start()
    assert protocol.read_new_any(streams, block_ms=5000) == []
    timer.join()
    enqueue(redis_client, protocol.keys, "after", 3, "w1")
    assert [d.request.req_id for d in protocol.read_new_any(streams, block_ms=1000)] == ["after"]


def test_a_service_counts_where_its_requests_came_from(redis_url, client, tiny):
    worker = make_service(redis_url, tiny, "w1")
    enqueue(client.redis, client.keys, "own", owner="w1")
    enqueue(client.redis, client.keys, "shared")
    enqueue(client.redis, client.keys, "other", owner="gone")
    protocol_of(client.redis, "gone")  # an owner without heartbeat
    worker.protocol.owners.refresh(force=True)
    worker._admit(block=False)
    assert set(worker.inflight) == {"own", "shared", "other"}
    text = worker.metrics.render().decode()
    for source in ("own", "shared", "other"):
        assert f'kvfleet_worker_requests_taken_total{{model="tiny",source="{source}",' \
               f'worker="w1"}} 1.0' in text
    assert 'kvfleet_worker_steal_wait_seconds_count{model="tiny",worker="w1"} 1.0' in text


def test_an_entry_taken_from_another_workers_own_stream_is_claimed_once_its_taker_is_gone(
        redis_client):
    owner = protocol_of(redis_client, "owner")
    beat(owner)
    enqueue(redis_client, owner.keys, "routed", owner="owner")
    assert taken(protocol_of(redis_client, "thief")) == [("routed", "other")]  # steal delay 0
    rescuer = protocol_of(redis_client, "rescuer")
    time.sleep(0.15)  # idle past the claim's minimum; the thief never had a heartbeat
    delivery = rescuer.claim_orphan(100)
    assert (delivery.request.req_id, delivery.source, delivery.times_delivered) == \
        ("routed", "other", 2)


# ---- resume ----------------------------------------------------------------------------------

def test_a_dead_workers_request_is_resumed_first_by_the_worker_holding_its_prefix(
        redis_url, client, tiny):
    settings = dict(heartbeat_ttl_s=1.0, resume_prefer_ms=60_000)
    holder = make_service(redis_url, tiny, "holder", **settings)
    other = make_service(redis_url, tiny, "other", **settings)
    prompt = random_prompt(13, seed=6)
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    first = client.send(prompt, params)
    run_until(holder, lambda: client.final(first))
    assert holder.engine.num_cached_prefix_blocks(prompt) == 3

    dying = protocol_of(connect(redis_url), "dying")
    second = client.send(prompt, params)
    assert [d.request.req_id for d in dying.read_batch(1000, 1).deliveries] == [second]
    for _ in range(11):  # idle past the TTL; "dying" never had a heartbeat
        holder._beat()  # both alive and listed, as their heartbeat threads keep them
        other._beat()
        # a stall of this process past the TTL (a loaded host, a collection of the suite's
        # heap) lets the holder's set expire: its loop would announce the set again, as here
        if holder.announcer.resync:
            holder.announcer.announce()
        time.sleep(0.1)
    assert holder.engine.num_cached_prefix_blocks(prompt) == 3
    other._claim_orphans()
    assert not other.inflight  # it holds none of the prompt: it leaves the entry to the holder
    holder._claim_orphans()
    assert set(holder.inflight) == {second}
    run_until(holder, lambda: client.final(second))
    assert client.text(second) == client.text(first)


# ---- the host tier: a block evicted into it stays announced, as host-tier -------------------

async def test_a_block_evicted_to_the_host_tier_stays_indexed_and_ranks_between_device_and_none(
        redis_url, client, tiny):
    """w1 (with a host tier) and w2 serve one prompt; w1's pool then evicts it into its tier.
    The gateway's index keeps it at w1 as host-tier; the router sends the prompt to w2 (device),
    and with w2 gone to w1 (host tier) rather than w3 (nothing)."""
    keys = client.keys
    block_bytes = tiny.engine(num_blocks=4, block_size=BS).pool.block_bytes
    tier = {"kv_offloading_size": 64 * block_bytes / (1 << 30)}  # GiB: 64 blocks
    w1 = make_service(redis_url, tiny, "w1", heartbeat_ttl_s=30, engine_config=tier)
    w2 = make_service(redis_url, tiny, "w2", heartbeat_ttl_s=30)
    w3 = make_service(redis_url, tiny, "w3", heartbeat_ttl_s=30)
    prompt = random_prompt(21, seed=11)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    for worker in (w1, w2):  # each serves it in turn: both cache its blocks on device
        req_id = client.send(prompt, params)
        run_until(worker, lambda: client.final(req_id))
    ids = [h[:8] for h in block_hashes(prompt, BS, root_hash(MODEL))][:5]  # the router's 5
    host = keys.kv_host_blocks(MODEL, "w1")
    for seed in range(100, 120):  # other prompts through w1 until its pool evicted the prompt
        if set(ids) <= client.redis.smembers(host):
            break
        req_id = client.send(random_prompt(40, seed=seed), SamplingParams(max_tokens=2))
        run_until(w1, lambda: client.final(req_id))
    assert set(ids) <= client.redis.smembers(host)  # moved to the host tier, not removed
    assert set(ids) <= client.redis.smembers(keys.kv_blocks(MODEL, "w1"))
    assert w1.engine.num_cached_prefix_blocks(prompt) == 0  # none of it left in w1's pool
    assert not client.redis.exists(keys.kv_host_blocks(MODEL, "w2"))
    assert 'kvfleet_worker_kv_announced_blocks_total{change="host",model="tiny",worker="w1"}' \
        in w1.metrics.render().decode()
    for worker in (w1, w2, w3):
        worker._snapshot_stats()
        worker._beat()

    engine = RedisEngineClient.from_url(redis_url, keys, shard_shares=False, router=None)
    router = Router(engine.redis, keys, listing_ttl_ms=30_000)  # weight 0.75, the default
    try:
        router.follow(MODEL)
        await router.refresh_loads(MODEL)
        index = router.indexes[MODEL]
        deadline = time.monotonic() + 10
        while not (index.synced and set(ids) <= index.host.get("w1", set())):
            assert time.monotonic() < deadline, "the index never held w1's host-tier blocks"
            await asyncio.sleep(0.02)
        assert set(ids) <= index.sets["w1"] and not index.host.get("w2")
        assert index.leading("w2", ids) == 5 and index.leading("w1", ids) == 5
        route = router.route(MODEL, prompt)
        assert (route.worker, route.reason, route.cached_tokens) == ("w2", "affinity", 5 * BS)
        client.redis.delete(keys.worker("w2"))  # w2 is gone
        await router.refresh_loads(MODEL)
        route = router.route(MODEL, prompt)
        assert (route.worker, route.reason) == ("w1", "affinity")
        assert (route.cached_tokens, route.host_tier_tokens) == (0, 5 * BS)

        # w1 brings the prompt back into its pool: on device again in the index
        req_id = client.send(prompt + [7], SamplingParams(max_tokens=1))
        run_until(w1, lambda: client.final(req_id))
        assert w1.engine.block_manager.tier.num_restored_blocks >= 5
        deadline = time.monotonic() + 10
        while set(ids) & index.host.get("w1", set()):
            assert time.monotonic() < deadline, "w1's restored blocks stayed host-tier"
            await asyncio.sleep(0.02)
        assert set(ids) <= index.sets["w1"]
    finally:
        await router.close()
        await engine.close()
