"""Test fixtures shared by every layer: a private Redis server and an empty database per test."""

from __future__ import annotations

import os

import pytest
import redis

from shared.redis_server import EmbeddedRedis


@pytest.fixture(scope="session")
def redis_server():
    """A redis-server of the test session's own, on a free port: never the one a user runs."""
    with EmbeddedRedis() as server:
        yield server


@pytest.fixture
def redis_url(redis_server) -> str:
    """URL of an empty database, flushed before and after the test."""
    client = redis.Redis.from_url(redis_server.url)
    client.flushdb()
    yield redis_server.url
    client.flushdb()
    client.close()


@pytest.fixture
def redis_client(redis_url):
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()
