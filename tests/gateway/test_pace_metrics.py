"""`kvfleet_fleet_workers_needed` and `kvfleet_fleet_pace_room` from heartbeats and request
streams in a real Redis, read at each scrape of `/metrics`."""

from __future__ import annotations

import time

import httpx
import pytest
from fastapi import FastAPI
from prometheus_client.parser import text_string_to_metric_families
from redis.asyncio import Redis

from kvfleet.gateway.dashboard.metrics import GatewayMetrics, metrics_route
from kvfleet.gateway.fleet.redis_context import RedisContext
from kvfleet.shared.wire import Heartbeat, Keys

MODEL = "tiny-model"
KEYS = Keys("kvpm:")


@pytest.fixture
async def redis(redis_url):
    client = Redis.from_url(redis_url)
    yield client
    await client.aclose()


async def scrape(redis_url: str) -> dict[tuple[str, str], float]:
    """{(metric, model): value} of the kvfleet_fleet_* series of one scrape."""
    context = RedisContext(redis_url, KEYS, connect_timeout_s=0.5, command_timeout_s=0.5)
    metrics = GatewayMetrics(MODEL)
    metrics.watch_fleet(context)
    app = FastAPI()
    app.include_router(metrics_route(metrics))
    try:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as http:
            text = (await http.get("/metrics")).text
    finally:
        await context.aclose()
    return {(s.name, s.labels["model"]): s.value
            for family in text_string_to_metric_families(text) for s in family.samples
            if s.name.startswith("kvfleet_fleet_")}


async def beat(redis: Redis, worker_id: str, *, running: int, waiting: int = 0,
               model: str = MODEL, **fields) -> None:
    heartbeat = Heartbeat(model=model, ts=time.time(), running=running, waiting=waiting,
                          **fields)
    await redis.hset(KEYS.worker(worker_id), mapping=heartbeat.encode())
    await redis.expire(KEYS.worker(worker_id), 30)


async def enqueue(redis: Redis, count: int, model: str = MODEL, priority: str = "interactive"):
    for i in range(count):
        await redis.xadd(KEYS.queue(model, priority), {"id": f"{priority}-{i}"})


async def test_workers_needed_at_the_promised_pace(redis_url, redis):
    # Pacers a and b run 10 and 6 streams at their pace: 8 a worker. The fleet holds 8 + 7 + 5
    # streams (c promises no pace: its streams count, its max_running does not) and 13 queued:
    # ceil(33 / 8) = 5 workers. The room at pace: a's 2 (b is full, c has none).
    await beat(redis, "a", running=8, target_itl_ms=50, pace_room=2, pace_streams=10,
               max_running=64)
    await beat(redis, "b", running=6, waiting=1, target_itl_ms=50, pace_room=0, pace_streams=6,
               max_running=64)
    await beat(redis, "c", running=5, max_running=64)
    await enqueue(redis, 10)
    await enqueue(redis, 3, priority="batch")
    await beat(redis, "o", running=3, max_running=4, model="other")  # another model's fleet
    values = await scrape(redis_url)
    assert values[("kvfleet_fleet_workers_needed", MODEL)] == 5
    assert values[("kvfleet_fleet_pace_room", MODEL)] == 2
    assert values[("kvfleet_fleet_workers_needed", "other")] == 1  # ceil(3 / 4)
    assert values[("kvfleet_fleet_pace_room", "other")] == 0


async def test_without_a_pace_the_workers_max_running_counts(redis_url, redis):
    await beat(redis, "a", running=10, max_running=16)
    await beat(redis, "b", running=10, max_running=8)
    await enqueue(redis, 5)  # ceil(25 / 12) = 3
    values = await scrape(redis_url)
    assert values[("kvfleet_fleet_workers_needed", MODEL)] == 3
    assert values[("kvfleet_fleet_pace_room", MODEL)] == 0


async def test_the_draining_workers_room_is_none_but_their_streams_count(redis_url, redis):
    await beat(redis, "a", running=4, target_itl_ms=50, pace_room=4, pace_streams=8)
    await beat(redis, "d", running=6, target_itl_ms=50, pace_room=2, pace_streams=8, draining=1)
    values = await scrape(redis_url)  # ceil(10 / 8) = 2; only a takes new requests
    assert values[("kvfleet_fleet_workers_needed", MODEL)] == 2
    assert values[("kvfleet_fleet_pace_room", MODEL)] == 4


async def test_a_fleet_scaled_to_zero(redis_url, redis):
    assert await scrape(redis_url) == {("kvfleet_fleet_workers_needed", MODEL): 0,
                                       ("kvfleet_fleet_pace_room", MODEL): 0}
    await enqueue(redis, 7)  # no worker to tell its capacity: start one
    assert (await scrape(redis_url))[("kvfleet_fleet_workers_needed", MODEL)] == 1


async def test_no_series_when_redis_is_down():
    assert await scrape("redis://127.0.0.1:1/0") == {}
