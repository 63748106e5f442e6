"""The wire contract's request scripts against a real Redis and a real Redis Cluster: the
one-round-trip admission (READ_IF_FITS), the enqueue's stream entry, the checkpoint's TTL from its
first tokens, and a finished request that a claimer only acks."""

from __future__ import annotations

import dataclasses
import time

import pytest
import redis

from kvfleet.shared.redis_connect import is_cluster
from kvfleet.shared.wire import (
    GenerationRequest,
    Keys,
    QueueEntry,
    RequestStatus,
    SamplingParams,
    TokenEvent,
    decode_checkpoint,
    encode_checkpoint,
    scripts,
)

pytestmark = pytest.mark.topologies

MODEL = "m"
KEYS = Keys("ws:")


def request(req_id: str, prompt_len: int, priority: str = "interactive") -> GenerationRequest:
    return GenerationRequest(req_id, MODEL, list(range(prompt_len)),
                             SamplingParams(max_tokens=4), priority=priority)


def enqueue(client: redis.Redis, req: GenerationRequest) -> None:
    script = scripts.ENQUEUE.register(client)
    call = scripts.enqueue(KEYS, req, ttl_s=60)
    assert script(keys=call.keys, args=call.args) == 1
    assert script(keys=call.keys, args=call.args) == 0  # once per id
    stream, fields = scripts.queue_entry(KEYS, req)
    client.xadd(stream, fields)


def groups(client: redis.Redis) -> None:
    for stream in KEYS.queues(MODEL):
        client.xgroup_create(stream, KEYS.group, id="0", mkstream=True)


def read_if_fits(client: redis.Redis, budget: int, consumer: str = "w1", count: int = 1):
    script = scripts.READ_IF_FITS.register(client)
    call = scripts.read_if_fits(KEYS.queues(MODEL), KEYS.group, consumer, budget, count)
    return script(keys=call.keys, args=call.args)


def delivered(reply) -> list[tuple[int, str]]:
    """(stream index, request id) of each entry a READ_IF_FITS reply delivered."""
    return [(int(reply[i]), QueueEntry.decode(dict(zip(reply[i + 2][::2],
                                                       reply[i + 2][1::2]))).request.req_id)
            for i in range(2, len(reply), 3)]


def pending(client: redis.Redis, stream: str) -> int:
    return client.xpending(stream, KEYS.group)["pending"]


def test_the_next_entry_is_delivered_only_if_it_fits(redis_client):
    groups(redis_client)
    enqueue(redis_client, request("big", 40))
    enqueue(redis_client, request("small", 5))
    assert read_if_fits(redis_client, budget=39) == [1, 40]  # head of line: stays, in order
    assert pending(redis_client, KEYS.queue(MODEL)) == 0
    reply = read_if_fits(redis_client, budget=40)
    assert reply[:2] == [0, 0] and delivered(reply) == [(1, "big")]
    owner = redis_client.xpending_range(KEYS.queue(MODEL), KEYS.group, "-", "+", 1)[0]
    assert (owner["message_id"], owner["consumer"]) == (reply[3], b"w1")
    assert delivered(read_if_fits(redis_client, budget=5)) == [(1, "small")]
    assert read_if_fits(redis_client, budget=1000) == [0, 0]


def test_several_entries_are_delivered_while_their_prompts_fit_the_budget(redis_client):
    groups(redis_client)
    for name, size in (("a", 10), ("b", 20), ("c", 30), ("d", 1)):
        enqueue(redis_client, request(name, size))
    enqueue(redis_client, request("batch-1", 1, priority="batch"))
    reply = read_if_fits(redis_client, budget=59, count=10)
    # a and b fit (30 of 59), c (30 more) does not: it stays and ends the read, d waits behind
    assert reply[:2] == [1, 30] and delivered(reply) == [(1, "a"), (1, "b")]
    assert pending(redis_client, KEYS.queue(MODEL)) == 2
    reply = read_if_fits(redis_client, budget=100, count=2)  # the count ends the read too
    assert reply[:2] == [0, 0] and delivered(reply) == [(1, "c"), (1, "d")]
    reply = read_if_fits(redis_client, budget=100, count=5)  # interactive empty: batch next
    assert reply[:2] == [0, 0] and delivered(reply) == [(2, "batch-1")]
    assert read_if_fits(redis_client, budget=100, count=5) == [0, 0]


def test_interactive_comes_first_and_blocks_batch_when_it_does_not_fit(redis_client):
    groups(redis_client)
    enqueue(redis_client, request("batch-1", 2, priority="batch"))
    enqueue(redis_client, request("chat-1", 50))
    assert read_if_fits(redis_client, budget=10, count=5) == [1, 50]
    assert delivered(read_if_fits(redis_client, budget=50)) == [(1, "chat-1")]
    assert delivered(read_if_fits(redis_client, budget=10)) == [(2, "batch-1")]


def test_an_entry_without_a_prompt_length_counts_as_fitting(redis_client):
    groups(redis_client)
    req = request("old-writer", 30)
    redis_client.xadd(KEYS.queue(MODEL), {QueueEntry.ID: req.req_id,
                                          QueueEntry.PAYLOAD: req.pack()})
    assert delivered(read_if_fits(redis_client, budget=0)) == [(1, "old-writer")]


def test_streams_without_a_group_or_entries_deliver_nothing(redis_client):
    assert read_if_fits(redis_client, budget=100) == [0, 0]  # no streams at all
    redis_client.xadd(KEYS.queue(MODEL), QueueEntry(request("r", 1)).encode())
    assert read_if_fits(redis_client, budget=100) == [0, 0]  # a stream but no consumer group


def test_entries_read_before_stay_with_their_reader(redis_client):
    """What XREADGROUP delivered to another worker is not delivered again."""
    groups(redis_client)
    enqueue(redis_client, request("a", 1))
    enqueue(redis_client, request("b", 1))
    redis_client.xreadgroup(KEYS.group, "other", {KEYS.queue(MODEL): ">"}, count=1)
    assert delivered(read_if_fits(redis_client, budget=10, count=5)) == [(1, "b")]


def test_the_checkpoint_gets_its_ttl_with_its_first_tokens(redis_client):
    req_id = "r"
    redis_client.hset(KEYS.request(req_id), "attempt", 1)
    publish = scripts.PUBLISH.register(redis_client)
    for seq, final in ((0, None), (2, RequestStatus.FINISHED_LENGTH)):
        event = TokenEvent(seq=seq, attempt=1, token_ids=[seq, seq + 1],
                           finish_reason="length" if final else None)
        call = scripts.publish(KEYS, req_id, 1, event, final, ttl_s=30,
                               sharded=is_cluster(redis_client))
        assert publish(keys=call.keys, args=call.args) == [1, []]
        assert 0 < redis_client.ttl(KEYS.checkpoint(req_id)) <= 30  # before the final event too
    assert decode_checkpoint(redis_client.get(KEYS.checkpoint(req_id))) == [0, 1, 2, 3]
    assert redis_client.hget(KEYS.request(req_id), "status") == b"finished_length"
    stale = scripts.publish(KEYS, req_id, 0, TokenEvent(seq=4, attempt=0, token_ids=[9]), None,
                            ttl_s=30, sharded=is_cluster(redis_client))
    assert publish(keys=stale.keys, args=stale.args) == [0, []]
    assert decode_checkpoint(redis_client.get(KEYS.checkpoint(req_id))) == [0, 1, 2, 3]


def test_publish_reaches_a_subscriber_of_the_requests_channel(redis_client):
    """PUBLISH on a single Redis, SPUBLISH inside the script on a cluster: either way the event
    reaches the channel's subscriber."""
    req_id, sharded = "sub-1", is_cluster(redis_client)
    redis_client.hset(KEYS.request(req_id), "attempt", 1)
    pubsub = redis_client.pubsub()
    if sharded:
        pubsub.ssubscribe(KEYS.tokens(req_id))
    else:
        pubsub.subscribe(KEYS.tokens(req_id))
    event = TokenEvent(seq=0, attempt=1, token_ids=[7])
    call = scripts.publish(KEYS, req_id, 1, event, None, ttl_s=30, sharded=sharded)
    assert scripts.PUBLISH.register(redis_client)(keys=call.keys, args=call.args) == [1, []]
    received = None
    for _ in range(50):
        message = (pubsub.get_sharded_message(timeout=0.1) if sharded
                   else pubsub.get_message(timeout=0.1))
        if message and message["type"] in ("message", "smessage"):
            received = TokenEvent.unpack(message["data"])
            break
    pubsub.close()
    assert received == dataclasses.replace(event, req_id=req_id)


def test_a_finished_request_is_not_started_again(redis_client):
    req_id = "done"
    start = scripts.START_ATTEMPT.register(redis_client)
    call = scripts.start_attempt(KEYS, req_id, "w1")
    assert start(keys=call.keys, args=call.args)[0] == 1
    redis_client.hset(KEYS.request(req_id), "status", RequestStatus.FINISHED_STOPPED.value)
    assert start(keys=call.keys, args=call.args) == [0, b"", b"finished_stopped"]
    assert redis_client.hget(KEYS.request(req_id), "attempt") == b"1"  # nothing written


def test_each_start_records_the_numerics_the_stream_continues_on(redis_client):
    """START_ATTEMPT keeps the request's numerics chain: the first worker's fingerprint; a
    restart before any token replaces it; a resume with tokens on the same numerics keeps it
    (not flagged), on other numerics appends its own and is flagged; an unknown ('') records
    nothing."""
    req_id = "numerics"
    start = scripts.START_ATTEMPT.register(redis_client)

    def started(worker: str, numerics: str) -> scripts.Started:
        call = scripts.start_attempt(KEYS, req_id, worker, numerics)
        return scripts.Started.decode(start(keys=call.keys, args=call.args))

    assert started("w1", "fp_a") == scripts.Started(1, [], "fp_a", False)
    assert started("w2", "fp_b") == scripts.Started(2, [], "fp_b", False)  # no token yet
    redis_client.set(KEYS.checkpoint(req_id), encode_checkpoint([7, 8]))
    assert started("w3", "fp_b") == scripts.Started(3, [7, 8], "fp_b", False)
    assert started("w4", "fp_a") == scripts.Started(4, [7, 8], "fp_b+fp_a", True)
    assert started("w5", "") == scripts.Started(5, [7, 8], "", False)
    assert started("w6", "fp_a") == scripts.Started(6, [7, 8], "fp_b+fp_a", False)
    assert redis_client.hget(KEYS.request(req_id), "numerics") == b"fp_b+fp_a"


def test_a_retried_publication_appends_its_tokens_once(redis_client):
    """A step's pipeline that failed half-way (one node down) is published again whole: tokens
    already in the checkpoint are not appended twice."""
    req_id, sharded = "retry", is_cluster(redis_client)
    redis_client.hset(KEYS.request(req_id), "attempt", 1)
    publish = scripts.PUBLISH.register(redis_client)
    first = scripts.publish(KEYS, req_id, 1, TokenEvent(seq=0, attempt=1, token_ids=[1, 2]),
                            None, ttl_s=30, sharded=sharded)
    second = scripts.publish(KEYS, req_id, 1, TokenEvent(seq=2, attempt=1, token_ids=[3, 4]),
                             None, ttl_s=30, sharded=sharded)
    for call in (first, first, second, second):
        assert publish(keys=call.keys, args=call.args) == [1, []]
    assert decode_checkpoint(redis_client.get(KEYS.checkpoint(req_id))) == [1, 2, 3, 4]
    overlap = scripts.publish(KEYS, req_id, 1, TokenEvent(seq=3, attempt=1, token_ids=[4, 5]),
                              None, ttl_s=30, sharded=sharded)
    assert publish(keys=overlap.keys, args=overlap.args) == [1, []]
    assert decode_checkpoint(redis_client.get(KEYS.checkpoint(req_id))) == [1, 2, 3, 4, 5]


def test_entries_younger_than_the_minimum_age_are_left_for_later(redis_client):
    groups(redis_client)
    enqueue(redis_client, request("young", 1))
    script = scripts.READ_IF_FITS.register(redis_client)
    aged = scripts.read_if_fits(KEYS.queues(MODEL), KEYS.group, "w1", 10, 5, min_age_ms=1000)
    assert delivered(script(keys=aged.keys, args=aged.args)) == []
    assert pending(redis_client, KEYS.queue(MODEL)) == 0
    time.sleep(1.05)
    assert delivered(script(keys=aged.keys, args=aged.args)) == [(1, "young")]
    enqueue(redis_client, request("fresh", 1))
    assert delivered(read_if_fits(redis_client, budget=10, count=5)) == [(1, "fresh")]  # age 0
