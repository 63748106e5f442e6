"""TokenQueue: the per-request queue the pub/sub reader fills (no Redis needed)."""

from __future__ import annotations

import asyncio
import time

import pytest

from kvfleet.gateway.fleet.fanout import TokenQueue


async def test_get_returns_items_in_order_and_waits_for_the_next():
    queue = TokenQueue()
    queue.put_nowait(b"a")
    queue.put_nowait(b"b")
    assert queue.qsize() == 2
    assert await queue.get(1.0) == b"a"
    assert queue.get_nowait() == b"b"
    assert queue.empty()
    waiting = asyncio.create_task(queue.get(5.0))
    await asyncio.sleep(0)
    queue.put_nowait(b"c")
    assert await waiting == b"c"


async def test_get_times_out_without_an_item():
    queue = TokenQueue()
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        await queue.get(0.05)
    assert 0.04 <= time.monotonic() - started < 1.0
    with pytest.raises(asyncio.QueueEmpty):
        queue.get_nowait()
    queue.put_nowait(b"late")  # a timed-out wait leaves the queue usable
    assert await queue.get(0.0) == b"late"


async def test_a_cancelled_get_leaves_no_waiter_behind():
    queue = TokenQueue()
    waiting = asyncio.create_task(queue.get(None))
    await asyncio.sleep(0)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    queue.put_nowait(b"x")
    assert await queue.get(1.0) == b"x"
