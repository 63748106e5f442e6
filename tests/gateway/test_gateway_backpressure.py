"""Backpressure against a real Redis: fake heartbeats and a request stream decide whether a new
request is admitted or refused with 429 + Retry-After."""

from __future__ import annotations

import httpx
import pytest
from redis.asyncio import Redis

from kvfleet.gateway.admission.admission import QueueWaitEstimator
from kvfleet.gateway.app import create_app
from kvfleet.gateway.fleet.client import QueueLoad
from kvfleet.gateway.http.errors import TooManyRequests
from kvfleet.shared.settings import GatewaySettings
from kvfleet.shared.wire import GenerationRequest, Heartbeat, Keys, QueueEntry, SamplingParams
from tests.gateway.helpers import MODEL

PREFIX = "kvbp:"
KEYS = Keys(PREFIX)


def settings_for(redis_url: str, **overrides) -> GatewaySettings:
    values = dict(redis_url=redis_url, model=MODEL, key_prefix=PREFIX, request_timeout_s=30,
                  first_event_timeout_s=5, max_queue_wait_s=10, max_queue_depth=50,
                  queue_tokens_per_request=100, min_fleet_tokens_per_s=10,
                  queue_estimate_cache_s=0.0)
    values.update(overrides)
    return GatewaySettings(**values)


@pytest.fixture
async def redis(redis_url):
    client = Redis.from_url(redis_url)
    yield client
    await client.aclose()


async def heartbeat(redis: Redis, wid: str, tokens_per_s: float, model: str = MODEL,
                    **fields) -> None:
    beat = Heartbeat(model=model, ts=0, tokens_per_s=tokens_per_s, blocks_total=100,
                     blocks_free=50, running=1, waiting=0, **fields)
    await redis.hset(KEYS.worker(wid), mapping=beat.encode())
    await redis.expire(KEYS.worker(wid), 30)


async def queue_requests(redis: Redis, count: int, group: bool = True) -> None:
    stream = KEYS.queue(MODEL)
    if group:
        await redis.xgroup_create(stream, KEYS.group, id="0", mkstream=True)
    for i in range(count):
        request = GenerationRequest(f"q{i}", MODEL, [1, 2], SamplingParams())
        await redis.xadd(stream, QueueEntry(request).encode())


@pytest.fixture
async def gateway(redis_url, tokenizer, model_info):
    async def make(**overrides):
        app = create_app(settings_for(redis_url, **overrides), None, tokenizer,
                         model_info=model_info)
        return app
    return make


async def post(app, prompt: str = "Hi", n: int = 1) -> httpx.Response:
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as http:
            return await http.post("/v1/completions", json={
                "model": MODEL, "prompt": prompt, "max_tokens": 1, "stream": True, "n": n})


async def test_long_expected_wait_is_a_429_with_retry_after(gateway, redis):
    # 20 queued × 100 tokens ÷ (30 + 10 tokens/s) = 50 s > 10 s.
    await heartbeat(redis, "w1", 30, role="prefill")
    await heartbeat(redis, "w2", 10, role="decode")  # it decodes the fleet's streams: counted
    await heartbeat(redis, "other", 10_000, model="another-model")  # not ours: ignored
    # a draining worker takes no new work: ignored (its drain request, a string, is no
    # heartbeat)
    await heartbeat(redis, "leaving", 10_000, draining=1)
    await redis.set(KEYS.drain("leaving"), "1")
    await queue_requests(redis, 20)
    response = await post(await gateway())
    assert response.status_code == 429
    assert response.json()["error"]["code"] == "queue_wait_too_long"
    assert response.json()["error"]["type"] == "rate_limit_error"
    assert int(response.headers["Retry-After"]) == 40  # 20 ahead × 2.5 s - 10 s


async def test_an_idle_fleet_takes_a_request_with_many_choices(gateway, redis):
    # The defaults: 256 tokens per queued request, a 200 tokens/s floor, 60 s. Counting a
    # request's own 50 choices as ahead of it would make an idle fleet's wait 64 s: a 429.
    await heartbeat(redis, "idle", 0)
    defaults = GatewaySettings()
    settings = dict(max_queue_wait_s=defaults.max_queue_wait_s,
                    max_queue_depth=defaults.max_queue_depth,
                    queue_tokens_per_request=defaults.queue_tokens_per_request,
                    min_fleet_tokens_per_s=defaults.min_fleet_tokens_per_s)
    assert 50 * defaults.queue_tokens_per_request / defaults.min_fleet_tokens_per_s > 60
    response = await post(await gateway(first_event_timeout_s=0.2, **settings), n=50)
    assert response.status_code == 200
    assert await redis.xlen(KEYS.queue(MODEL)) == 50
    # ... and they are ahead of the next request: 50 × 1.28 s > 60 s
    response = await post(await gateway(**settings))
    assert response.status_code == 429
    assert response.json()["error"]["code"] == "queue_wait_too_long"


async def test_an_empty_queue_takes_more_choices_than_the_depth_limit(gateway, redis):
    await heartbeat(redis, "w1", 1000)
    app = await gateway(max_queue_depth=10, first_event_timeout_s=0.2)
    assert (await post(app, n=12)).status_code == 200
    response = await post(await gateway(max_queue_depth=10), n=1)
    assert response.status_code == 429
    assert response.json()["error"]["code"] == "queue_full"


async def test_short_wait_is_admitted_and_enqueued(gateway, redis):
    await heartbeat(redis, "w1", 1000)  # 20 × 100 ÷ 1000 = 2 s
    await queue_requests(redis, 20)
    app = await gateway(first_event_timeout_s=0.2)
    response = await post(app)
    assert response.status_code == 200  # the stream then times out: nobody serves it
    assert await redis.xlen(KEYS.queue(MODEL)) == 21


async def test_no_live_worker_only_the_depth_limit_applies(gateway, redis):
    await queue_requests(redis, 20, group=False)  # no group yet: XLEN counts
    app = await gateway(first_event_timeout_s=0.2)
    assert (await post(app)).status_code == 200  # 2,100 s of work, but nobody to measure
    await queue_requests(redis, 30, group=False)
    response = await post(await gateway())
    assert response.status_code == 429
    assert response.json()["error"]["code"] == "queue_full"
    assert int(response.headers["Retry-After"]) >= 1


async def test_zero_throughput_uses_the_floor(gateway, redis):
    await heartbeat(redis, "idle", 0)  # 10 × 100 ÷ 10 (floor) = 100 s
    await queue_requests(redis, 10)
    response = await post(await gateway())
    assert response.status_code == 429


async def test_off_when_both_limits_are_zero(gateway, redis):
    await heartbeat(redis, "w1", 1)
    await queue_requests(redis, 60)
    app = await gateway(max_queue_wait_s=0, max_queue_depth=0, first_event_timeout_s=0.2)
    assert (await post(app)).status_code == 200


class CountingClient:
    def __init__(self, load: QueueLoad):
        self.load = load
        self.reads = 0

    async def queue_load(self, model: str) -> QueueLoad:
        self.reads += 1
        return self.load


async def test_estimate_is_cached_and_counts_what_it_admitted():
    now = [0.0]
    client = CountingClient(QueueLoad(undelivered=0, live_workers=1, tokens_per_s=100))
    settings = GatewaySettings(max_queue_wait_s=10, max_queue_depth=0,
                               queue_tokens_per_request=100, queue_estimate_cache_s=0.5,
                               min_fleet_tokens_per_s=10)
    estimator = QueueWaitEstimator(client, MODEL, settings, clock=lambda: now[0])
    for _ in range(11):  # each takes 1 s of the fleet: the 11th waits 10 s, the 12th 11 s
        await estimator.check(1)
    with pytest.raises(TooManyRequests):
        await estimator.check(1)
    assert client.reads == 1
    now[0] = 0.6
    client.load = QueueLoad(undelivered=2, live_workers=1, tokens_per_s=100)
    await estimator.check(1)
    assert client.reads == 2
