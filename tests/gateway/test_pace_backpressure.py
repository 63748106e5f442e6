"""Backpressure at the promised pace, against a real Redis: requests queued ahead that fit in the
fleet's room at the pace (the heartbeats' `pace_room`) wait ~0; only those beyond it count."""

from __future__ import annotations

from kvfleet.gateway.fleet.redis_client import RedisEngineClient
from kvfleet.gateway.fleet.redis_context import RedisContext
from tests.gateway.helpers import MODEL
from tests.gateway.test_gateway_backpressure import (  # noqa: F401 - fixtures
    KEYS, gateway, heartbeat, post, queue_requests, redis, settings_for)

# 100 tokens a request ÷ (0 + 10 tokens/s floor) = 10 s per request ahead; the limit is 10 s.
SLOW = dict(min_fleet_tokens_per_s=10)


async def pace_fleet(redis, room_a: int, room_b: int) -> None:
    """Two workers taking new requests with `room_a` + `room_b` streams of room at the pace, and
    two whose room is no room for new requests: a decode worker and a draining one."""
    await heartbeat(redis, "a", 0, target_itl_ms=50, pace_room=room_a, pace_streams=30)
    await heartbeat(redis, "b", 0, role="prefill", target_itl_ms=50, pace_room=room_b)
    await heartbeat(redis, "dec", 0, role="decode", target_itl_ms=50, pace_room=100)
    await heartbeat(redis, "leaving", 0, draining=1, target_itl_ms=50, pace_room=100)


async def test_a_queue_within_the_room_at_pace_is_admitted(gateway, redis):
    await pace_fleet(redis, 13, 6)  # 19 of the 20 ahead start at once: 1 × 10 s waits
    await queue_requests(redis, 20)
    response = await post(await gateway(first_event_timeout_s=0.2, **SLOW))
    assert response.status_code == 200, response.text
    assert await redis.xlen(KEYS.queue(MODEL)) == 21


async def test_a_queue_beyond_the_room_at_pace_is_a_429(gateway, redis):
    await pace_fleet(redis, 12, 6)  # 2 of the 20 ahead wait: 20 s > 10 s
    await queue_requests(redis, 20)
    response = await post(await gateway(**SLOW))
    assert response.status_code == 429
    assert response.json()["error"]["code"] == "queue_wait_too_long"
    assert int(response.headers["Retry-After"]) == 10
    assert await redis.xlen(KEYS.queue(MODEL)) == 20


async def test_a_full_pace_or_no_promise_counts_every_request_ahead(gateway, redis):
    await heartbeat(redis, "full", 0, target_itl_ms=50, pace_room=0)  # promised, no room
    await heartbeat(redis, "plain", 0)  # no pace promised: pace_room -1, no room of its own
    await queue_requests(redis, 2)  # 2 × 10 s
    response = await post(await gateway(**SLOW))
    assert response.status_code == 429
    assert int(response.headers["Retry-After"]) == 10


async def test_queue_load_reads_the_room_from_the_heartbeats(redis_url, redis):
    context = RedisContext(redis_url, KEYS, connect_timeout_s=1, command_timeout_s=2)
    client = RedisEngineClient.from_settings(settings_for(redis_url), context)
    try:
        await heartbeat(redis, "plain", 5)
        load = await client.queue_load(MODEL)
        assert (load.pace_promised, load.pace_room) == (False, 0)
        await pace_fleet(redis, 4, 3)
        await heartbeat(redis, "other", 5, model="another-model", pace_room=50)
        await queue_requests(redis, 3)
        load = await client.queue_load(MODEL)
        assert (load.undelivered, load.pace_promised, load.pace_room) == (3, True, 7)
        assert load.live_workers == 4  # a, b, dec, plain: the draining one is left out
    finally:
        await context.aclose()
