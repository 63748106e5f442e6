"""The worker's Redis protocol against a real Redis and a real Redis Cluster: fencing,
checkpoints, claims, dead letters, stream shards."""

from __future__ import annotations

import time

import pytest
import redis

from kvfleet.shared.wire import (
    GenerationRequest,
    Heartbeat,
    Keys,
    QueueEntry,
    RequestRecord,
    RequestStatus,
    SamplingParams,
    TokenEvent,
    decode_checkpoint,
    encode_checkpoint,
)
from tests.helpers.channels import next_message, subscribe
from kvfleet.worker.protocol import Publication, TooLarge, WorkerProtocol

pytestmark = pytest.mark.topologies

MODEL = "m"
BEAT = Heartbeat(model=MODEL, ts=0.0)  # what a worker writes; only its existence matters here


def enqueue(client: redis.Redis, keys: Keys, req_id: str, prompt=(1, 2, 3), priority="interactive"):
    request = GenerationRequest(req_id, MODEL, list(prompt), SamplingParams(max_tokens=4),
                                priority=priority)
    client.hset(keys.request(req_id), mapping=RequestRecord(request).encode())
    client.xadd(keys.queue(MODEL, priority, keys.shard_of(req_id)), QueueEntry(request).encode())
    return request


def make(client, worker_id="w1", keys: Keys | None = None) -> WorkerProtocol:
    protocol = WorkerProtocol(client, keys or Keys(), MODEL, worker_id, result_ttl_s=60)
    protocol.ensure_groups()
    return protocol


def test_checkpoint_encoding_round_trips():
    tokens = [0, 1, 49151, 2**32 - 1]
    assert decode_checkpoint(encode_checkpoint(tokens)) == tokens
    assert decode_checkpoint(encode_checkpoint([1, 2]) + encode_checkpoint([3])) == [1, 2, 3]


def test_a_request_too_large_is_not_taken_and_one_that_fits_is(redis_client):
    protocol = make(redis_client)
    enqueue(redis_client, protocol.keys, "a", prompt=range(8))
    enqueue(redis_client, protocol.keys, "b")
    assert protocol.read_if_fits(7) == TooLarge(protocol.keys.queue(MODEL), 8)
    assert protocol.read_if_fits(7) == TooLarge(protocol.keys.queue(MODEL), 8)  # still there
    delivery = protocol.read_if_fits(8)
    assert delivery.request.req_id == "a" and delivery.stream == protocol.keys.queue(MODEL)
    assert protocol.read_if_fits(8).request.req_id == "b"
    assert protocol.read_if_fits(8) is None


def test_interactive_is_served_before_batch(redis_client):
    protocol = make(redis_client)
    enqueue(redis_client, protocol.keys, "batch-1", priority="batch")
    enqueue(redis_client, protocol.keys, "chat-1")
    assert protocol.read_if_fits(100).request.req_id == "chat-1"
    assert protocol.read_if_fits(100).request.req_id == "batch-1"


def test_a_stale_attempt_is_fenced_off(redis_client):
    keys = Keys()
    old, new = make(redis_client, "old"), make(redis_client, "new")
    enqueue(redis_client, keys, "r")
    delivery = old.read_new(keys.queue(MODEL), None)
    started = old.start_attempt("r")
    attempt_old = started.attempt
    assert (attempt_old, started.checkpoint) == (1, [])
    ok = old.publish([Publication("r", attempt_old, TokenEvent(0, attempt_old, [5, 6]), None,
                                  delivery.stream, delivery.entry_id)])
    assert ok == [True]
    started = new.start_attempt("r")  # a claimer resumes from the checkpoint
    assert (started.attempt, started.checkpoint) == (2, [5, 6])
    ok = old.publish([Publication("r", attempt_old, TokenEvent(2, attempt_old, [7]), None,
                                  delivery.stream, delivery.entry_id)])
    assert ok == [False]
    assert decode_checkpoint(redis_client.get(keys.checkpoint("r"))) == [5, 6]


def test_final_event_records_status_acks_and_expires(redis_client):
    keys = Keys()
    protocol = make(redis_client)
    enqueue(redis_client, keys, "r")
    delivery = protocol.read_new(keys.queue(MODEL), None)
    attempt = protocol.start_attempt("r").attempt
    pubsub = subscribe(redis_client, keys.tokens("r"))
    event = TokenEvent(0, attempt, [9], finish_reason="length")
    assert protocol.publish([Publication("r", attempt, event, RequestStatus.FINISHED_LENGTH,
                                         delivery.stream, delivery.entry_id)]) == [True]
    message = next_message(pubsub)
    assert TokenEvent.unpack(message["data"]).token_ids == [9]
    assert redis_client.hget(keys.request("r"), "status") == b"finished_length"
    assert redis_client.xpending(keys.queue(MODEL), keys.group)["pending"] == 0
    assert 0 < redis_client.ttl(keys.request("r")) <= 60
    assert 0 < redis_client.ttl(keys.checkpoint("r")) <= 60


def test_orphans_are_claimed_only_once_their_worker_is_gone(redis_client):
    keys = Keys()
    dead, live = make(redis_client, "dead"), make(redis_client, "live")
    dead.heartbeat(BEAT, ttl_s=0.3)
    enqueue(redis_client, keys, "r")
    dead.read_new(keys.queue(MODEL), None)
    time.sleep(0.05)
    # Idle, but its worker still beats: not an orphan.
    assert live.claim_orphan(min_idle_ms=10) is None
    time.sleep(0.3)  # the heartbeat key expires
    assert live.claim_orphan(min_idle_ms=60_000) is None  # gone, but not idle long enough
    delivery = live.claim_orphan(min_idle_ms=10)
    assert delivery.request.req_id == "r"
    assert delivery.times_delivered == 2
    owner = redis_client.xpending_range(keys.queue(MODEL), keys.group, "-", "+", 1)[0]
    assert owner["consumer"] == b"live"
    assert owner["times_delivered"] == 2
    live.heartbeat(BEAT, ttl_s=5)
    time.sleep(0.05)
    assert make(redis_client, "third").claim_orphan(min_idle_ms=10) is None


def test_an_earlier_process_under_the_same_id_leaves_orphans_to_its_successor(redis_client):
    keys = Keys()
    before = make(redis_client, "w-fixed")
    enqueue(redis_client, keys, "r1")
    enqueue(redis_client, keys, "r2")
    first = before.read_new(keys.queue(MODEL), None)
    before.read_new(keys.queue(MODEL), None)
    after = make(redis_client, "w-fixed")  # restarted: its heartbeat key is back at once
    after.heartbeat(BEAT, ttl_s=5)
    time.sleep(0.05)
    assert make(redis_client, "other").claim_orphan(min_idle_ms=10) is None  # w-fixed is alive
    # The successor holds r1 (say it was delivered to it); r2 is nobody's: it takes r2 over.
    delivery = after.claim_orphan(min_idle_ms=10, held=frozenset({first.entry_id}))
    assert delivery.request.req_id == "r2"
    assert after.claim_orphan(min_idle_ms=10, held=frozenset({first.entry_id})) is None


def test_refreshing_pending_entries_keeps_them_from_being_claimed(redis_client):
    keys = Keys()
    busy, other = make(redis_client, "busy"), make(redis_client, "other")
    enqueue(redis_client, keys, "r")
    delivery = busy.read_new(keys.queue(MODEL), None)  # no heartbeat: only the idle time guards
    time.sleep(0.3)
    busy.refresh_pending({delivery.stream: [delivery.entry_id]})
    assert other.claim_orphan(min_idle_ms=200) is None
    time.sleep(0.25)
    assert other.claim_orphan(min_idle_ms=200).request.req_id == "r"


def test_a_trimmed_orphan_is_acked_not_resumed(redis_client):
    keys = Keys()
    dead, live = make(redis_client, "dead"), make(redis_client, "live")
    enqueue(redis_client, keys, "r")
    delivery = dead.read_new(keys.queue(MODEL), None)
    redis_client.xdel(keys.queue(MODEL), delivery.entry_id)
    time.sleep(0.05)
    assert live.claim_orphan(min_idle_ms=10) is None
    assert redis_client.xpending(keys.queue(MODEL), keys.group)["pending"] == 0


def test_fail_dead_letters_and_tells_the_client(redis_client):
    keys = Keys()
    protocol = make(redis_client)
    enqueue(redis_client, keys, "poison")
    delivery = protocol.read_new(keys.queue(MODEL), None)
    attempt = protocol.start_attempt("poison").attempt
    pubsub = subscribe(redis_client, keys.tokens("poison"))
    protocol.fail(delivery, attempt, 0, "boom", dead_letter=True)
    event = TokenEvent.unpack(next_message(pubsub)["data"])
    assert event.finish_reason == "error" and event.error == "boom"
    dead = redis_client.xrange(keys.dead_letter(MODEL))
    assert dead[0][1][b"id"] == b"poison"
    assert redis_client.xpending(keys.queue(MODEL), keys.group)["pending"] == 0


def test_heartbeat_expires(redis_client):
    protocol = make(redis_client)
    protocol.heartbeat(Heartbeat(model="", ts=0.0, blocks_free=3), ttl_s=0.2)
    key = protocol.keys.worker("w1")
    beat = Heartbeat.decode(redis_client.hgetall(key))
    assert (beat.model, beat.blocks_free) == ("m", 3) and abs(beat.ts - time.time()) < 5
    time.sleep(0.35)
    assert not redis_client.exists(key)


def test_a_worker_reads_every_stream_shard(redis_client):
    keys = Keys(queue_shards=3)
    protocol = make(redis_client, keys=keys)
    ids = [f"s-{i}" for i in range(12)]
    for req_id in ids:
        enqueue(redis_client, keys, req_id)
    assert {keys.shard_of(req_id) for req_id in ids} == {0, 1, 2}
    taken = []
    while (delivery := protocol.read_if_fits(100)) is not None:
        taken.append(delivery.request.req_id)
        assert delivery.stream == keys.queue(MODEL, "interactive", keys.shard_of(taken[-1]))
        attempt = protocol.start_attempt(taken[-1]).attempt
        event = TokenEvent(seq=0, attempt=attempt, token_ids=[1], finish_reason="stop")
        assert protocol.publish([Publication(taken[-1], attempt, event,
                                             RequestStatus.FINISHED_STOPPED, delivery.stream,
                                             delivery.entry_id)]) == [True]
    assert sorted(taken) == sorted(ids)
    assert all(redis_client.xpending(stream, keys.group)["pending"] == 0
               for stream in keys.all_queues(MODEL))


def test_one_read_takes_several_requests_from_every_shard_within_count_and_budget(redis_client):
    keys = Keys(queue_shards=3)
    protocol = make(redis_client, keys=keys)
    ids = [f"s-{i}" for i in range(12)]
    for req_id in ids:
        enqueue(redis_client, keys, req_id)  # 3 prompt tokens each
    admission = protocol.read_batch(100, 5)  # the count ends it
    assert len(admission.deliveries) == 5 and admission.too_large is None
    admission2 = protocol.read_batch(3 * 4, 100)  # the budget ends it: 4 prompts of 3
    assert len(admission2.deliveries) == 4
    rest = protocol.read_batch(100, 100).deliveries
    taken = [d.request.req_id for d in admission.deliveries + admission2.deliveries + rest]
    assert sorted(taken) == sorted(ids)  # each exactly once, from every shard
    for delivery in admission.deliveries + admission2.deliveries + rest:
        req_id = delivery.request.req_id
        assert delivery.stream == keys.queue(MODEL, "interactive", keys.shard_of(req_id))
    assert protocol.read_batch(100, 100).deliveries == []
    started = protocol.start_attempts(taken)
    assert [(s.attempt, s.checkpoint) for s in started] == [(1, [])] * len(taken)
    assert all(redis_client.hget(keys.request(r), "attempt") == b"1" for r in taken)


def test_a_batch_read_leaves_a_request_that_does_not_fit_at_the_head(redis_client):
    protocol = make(redis_client)
    enqueue(redis_client, protocol.keys, "a", prompt=range(4))
    enqueue(redis_client, protocol.keys, "big", prompt=range(10))
    enqueue(redis_client, protocol.keys, "c", prompt=range(1))
    admission = protocol.read_batch(8, 10)
    assert [d.request.req_id for d in admission.deliveries] == ["a"]
    assert protocol.read_batch(8, 10).too_large == TooLarge(protocol.keys.queue(MODEL), 10)
    assert [d.request.req_id for d in protocol.read_batch(11, 10).deliveries] == ["big", "c"]


def test_workers_read_their_home_shards_first_and_others_only_once_entries_waited(redis_client):
    keys = Keys(queue_shards=3)
    workers = [make(redis_client, f"w{i}", keys) for i in range(2)]
    for worker in workers:
        worker.steal_after_ms = 1000  # far above any pause of a slow machine between two calls
    assert [w.update_roster(5) for w in workers] == [(0, 1, 2), (1,)]  # w0 was alone at first
    assert [w.update_roster(5) for w in workers] == [(0, 2), (1,)]  # fewer workers than shards
    ids = [f"h-{i}" for i in range(30)]
    for req_id in ids:
        enqueue(redis_client, keys, req_id)
    first = workers[0].read_batch(1000, 100).deliveries
    assert sorted(d.request.req_id for d in first) == sorted(
        r for r in ids if keys.shard_of(r) in (0, 2))
    assert all(workers[0].from_home(d) for d in first)
    assert workers[1].read_batch(1000, 100).deliveries != []  # its home shard: at once
    enqueue(redis_client, keys, "late", prompt=(1,))
    late_shard = keys.shard_of("late")
    stranger = workers[1] if late_shard in (0, 2) else workers[0]
    assert stranger.read_batch(1000, 100).deliveries == []  # a young entry of another's shard
    time.sleep(1.05)
    taken = stranger.read_batch(1000, 100).deliveries  # it waited: any worker with room takes it
    assert [d.request.req_id for d in taken] == ["late"] and not stranger.from_home(taken[0])


def test_the_roster_places_workers_in_order_of_joining_and_drops_the_silent(redis_client):
    keys = Keys(queue_shards=3)
    workers = [make(redis_client, f"r{i}", keys) for i in range(4)]
    for worker in workers:
        worker.update_roster(5)
    homes = [w.update_roster(5) for w in workers]
    assert homes == [(0,), (1,), (2,), (0,)]  # every shard has a home worker
    assert workers[0].update_roster(5) == (0,)  # staying keeps the place
    workers[0].steal_after_ms = 50
    workers[0].remove_heartbeat()  # a worker that stops leaves the roster
    assert [w.update_roster(5) for w in workers[1:]] == [(0,), (1,), (2,)]
    time.sleep(0.3)
    assert workers[3].update_roster(0.2) == (0, 1, 2)  # the others fell silent: dropped
    assert redis_client.zcard(keys.roster(MODEL)) == 1


def test_a_busy_worker_reads_other_shards_at_most_every_half_steal_delay(redis_server):
    """Entries of a shard that is not home are taken only once they waited steal_after_ms, so a
    fill reads such a shard only if no fill did in the last half of that: back-to-back fills
    read the home shard alone."""
    redis_server.flush()
    client = redis.Redis.from_url(redis_server.url)
    try:
        protocol = make(client, keys=Keys(queue_shards=3))
        protocol.steal_after_ms, protocol.home_shards = 1000, (0,)
        # This protocol's own READ_IF_FITS calls, by the shard read: the server's command
        # counts would also hold any other client's.
        script, shards_read = protocol._read_if_fits, []

        def recording(keys, args):
            if keys == protocol.own_streams:
                shards_read.append("own")
            else:
                shards_read.append(next(shard for shard in range(3)
                                        if keys[0] in protocol.keys.queues(MODEL, shard)))
            return script(keys=keys, args=args)

        def shared_read():
            return [shard for shard in shards_read if shard != "own"]

        protocol._read_if_fits = recording
        for _ in range(3):
            assert protocol.read_batch(100, 10).deliveries == []
        assert sorted(shared_read()[:3]) == [0, 1, 2] and shared_read()[0] == 0
        assert shared_read()[3:] == [0, 0]  # then the home shard alone
        time.sleep(0.55)
        protocol.read_batch(100, 10)
        assert shared_read()[5] == 0 and sorted(shared_read()[5:]) == [0, 1, 2]
        assert shards_read.count("own") == 4 and shards_read[0] == "own"  # once per fill, first
    finally:
        client.close()
        redis_server.flush()
