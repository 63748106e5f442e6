"""Test fixtures shared by every layer: a private Redis server and an empty database per test."""

from __future__ import annotations

import os

import pytest
import redis
import torch

if not torch.cuda.is_available():
    # Triton kernels run under Triton's interpreter on CPU tensors; it reads this at import.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from shared.redis_server import EmbeddedRedis  # noqa: E402


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


def pytest_collection_modifyitems(config, items):
    """Tests marked `cuda` need a GPU: left out unless the -m expression names them, so a
    CPU-only run neither fails nor reports them as skipped (gpu_check.sh runs `-m cuda`)."""
    if "cuda" in (config.getoption("markexpr") or ""):
        return
    kept = [item for item in items if item.get_closest_marker("cuda") is None]
    if len(kept) < len(items):
        config.hook.pytest_deselected(items=[i for i in items if i.get_closest_marker("cuda")])
        items[:] = kept
