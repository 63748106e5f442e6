"""Many clients going away at once: the gateway publishes every cancellation, and the requests
still in flight are not failed by the burst, even with a small Redis connection pool (a client
that closed its ~608 connections at once got four 503s: the pool ran out publishing the
cancellations; docs/BENCHMARKS.md, "The promised pace at 1.5x ...")."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from kvfleet.gateway.fleet.client import EngineUnavailable
from kvfleet.gateway.fleet.redis_client import RedisEngineClient
from kvfleet.gateway.fleet.redis_context import RedisContext
from kvfleet.shared.redis_connect import connect
from kvfleet.shared.wire import GenerationRequest, Keys, SamplingParams
from tests.helpers.channels import next_message, subscribe

pytestmark = pytest.mark.topologies

MODEL = "tiny-model"
KEYS = Keys("kvburst:")
POOL = 4  # the gateway's Redis connections at most (on a cluster: to each node)
BURST = 600  # clients cancelling in the same instant
IN_FLIGHT = 40  # requests submitted while the cancellations go out


def make_request(req_id: str) -> GenerationRequest:
    return GenerationRequest(req_id=req_id, model=MODEL, prompt_token_ids=[1, 2, 3],
                             params=SamplingParams(max_tokens=4, seed=7),
                             deadline=time.time() + 30, created=time.time())


class CancelListener:
    """Collects the ids published on the cancel channel (classic or sharded pub/sub), in a
    thread of its own (the blocking client's reads do not hold the test's event loop)."""

    def __init__(self, redis_url: str):
        self._redis = connect(redis_url)
        self._pubsub = subscribe(self._redis, KEYS.cancel())
        self.ids: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            message = next_message(self._pubsub, 0.1)
            if message is not None:
                self.ids.append(message["data"].decode())

    async def wait_for(self, count: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while len(self.ids) < count and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.2)  # and nothing more than expected arrives

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._pubsub.close()
        self._redis.close()


@pytest.fixture
async def small_pool_client(redis_url):
    """The gateway's engine client on a Redis context whose pool holds POOL connections."""
    context = RedisContext(redis_url, KEYS, max_connections=POOL)
    engine = RedisEngineClient(context, owns_context=True, first_event_timeout_s=5.0)
    await engine.start()
    yield engine
    await engine.close()


async def submit_one_by_one(client: RedisEngineClient, req_ids: list[str]) -> list:
    """Requests that keep coming while the burst goes out, one at a time (on a cluster a pool
    that is full fails a command at once, whatever takes its connections: these stay within it)."""
    results = []
    for req_id in req_ids:
        try:
            results.append(await client.enqueue(make_request(req_id)))
        except EngineUnavailable as exc:  # the 503 of a request in flight
            results.append(exc)
        await asyncio.sleep(0)
    return results


async def test_a_burst_of_cancellations_all_reach_redis_and_fail_no_request(
        small_pool_client, redis_url):
    listener = CancelListener(redis_url)
    try:
        gone = [f"cmpl-gone-{i}" for i in range(BURST)]
        staying = [f"cmpl-stay-{i}" for i in range(IN_FLIGHT)]
        # every client closes its connection in the same instant while others still submit
        cancels = [asyncio.ensure_future(small_pool_client.cancel(req_id)) for req_id in gone]
        submitted = await asyncio.gather(submit_one_by_one(small_pool_client, staying[::2]),
                                         submit_one_by_one(small_pool_client, staying[1::2]))
        await asyncio.wait_for(asyncio.gather(*cancels), 30)
        await listener.wait_for(BURST, 10.0)
    finally:
        listener.close()
    failed = [r for r in submitted[0] + submitted[1] if r is not True]
    assert failed == [], f"{len(failed)} requests in flight failed, e.g. {failed[0]!r}"
    missing = set(gone) - set(listener.ids)
    assert not missing, f"{len(missing)} of {BURST} cancellations never reached Redis"
    assert sorted(listener.ids) == sorted(gone)  # each once


async def test_cancellations_wait_out_a_redis_that_does_not_answer(redis_server):
    """Redis taking no writes for longer than the command timeout (as in a failover; shown on the
    single Redis, which CLIENT PAUSE holds whole): the cancellations made meanwhile are published
    once it answers again, not dropped."""
    redis_server.flush()
    redis_url = redis_server.url
    context = RedisContext(redis_url, KEYS, max_connections=POOL, command_timeout_s=0.3)
    client = RedisEngineClient(context, owns_context=True)
    admin = connect(redis_url)
    listener = CancelListener(redis_url)
    try:
        admin.execute_command("CLIENT", "PAUSE", 1500, "WRITE")  # PUBLISH waits, then times out
        gone = [f"cmpl-paused-{i}" for i in range(BURST)]
        cancels = asyncio.gather(*(client.cancel(req_id) for req_id in gone))
        await asyncio.wait_for(cancels, 30)
        await listener.wait_for(BURST, 10.0)
    finally:
        admin.execute_command("CLIENT", "UNPAUSE")
        admin.close()
        listener.close()
        await client.close()
    missing = set(gone) - set(listener.ids)
    assert not missing, f"{len(missing)} of {BURST} cancellations were lost"
