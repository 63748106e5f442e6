"""The gateway's Redis connections are bounded (`--redis-max-connections`), and a command that
finds them all busy waits for one: redis-py's default pool (100 connections) fails it at once, and
hundreds of requests cancelled in one instant got 503s."""

from __future__ import annotations

import asyncio

import redis
import redis.asyncio

from kvfleet.gateway.fleet.redis_context import RedisContext
from kvfleet.shared.settings import GatewaySettings
from kvfleet.shared.wire import Keys

BUSY = 40  # commands at once, each holding its connection for a while
NAME = "pool-test"


async def hold_connections(client, n: int) -> list:
    """`n` commands at once, each holding its connection 0.2 s (BLPOP on an empty list)."""
    return await asyncio.gather(*(client.blpop([f"empty:{i}"], timeout=0.2) for i in range(n)),
                                return_exceptions=True)


def connections_named(redis_client, name: str) -> int:
    return sum(1 for c in redis_client.client_list() if c.get("name") == name)


async def test_commands_beyond_the_bound_wait_for_a_connection(redis_server):
    redis_server.flush()
    settings = GatewaySettings(redis_url=redis_server.url, redis_max_connections=4)
    context = RedisContext.from_settings(settings)
    context.redis.connection_pool.connection_kwargs["client_name"] = NAME
    try:
        results = await hold_connections(context.redis, BUSY)
        assert [r for r in results if isinstance(r, Exception)] == []
        assert results == [None] * BUSY
        with redis.Redis.from_url(redis_server.url) as probe:
            assert 1 <= connections_named(probe, NAME) <= 4  # the bound held
    finally:
        await context.aclose()


async def test_a_pool_that_does_not_wait_fails_them(redis_server):
    """Negative control: redis-py's default kind of pool at the same bound fails the commands
    beyond it, which is what the gateway's pool waits through."""
    client = redis.asyncio.Redis.from_url(redis_server.url, max_connections=4)
    try:
        results = await hold_connections(client, BUSY)
        failed = [r for r in results if isinstance(r, Exception)]
        assert failed and all(isinstance(r, redis.ConnectionError) for r in failed)
    finally:
        await client.aclose()


def test_the_gateway_default():
    assert GatewaySettings().redis_max_connections == 256
