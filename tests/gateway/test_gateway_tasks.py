"""The gateway's background tasks stop even when a cancel is swallowed: redis-py can return a
reply (or a retried timeout) instead of raising the CancelledError that landed during the call, and
a close that waited on one cancel then hung for ever (gateway/fleet/tasks.py)."""

from __future__ import annotations

import asyncio

from redis.asyncio import Redis

from kvfleet.gateway.dashboard.history import FleetHistory, HistorySampler
from kvfleet.gateway.dashboard.metrics import GatewayMetrics
from kvfleet.gateway.fleet.homes import GatewayHomes
from kvfleet.gateway.fleet.tasks import stop_task
from kvfleet.shared.redis_server import free_port
from kvfleet.shared.wire import Keys


async def swallowing_call(started: asyncio.Event, result):
    """A Redis call that eats the cancel landing while it waits and returns its reply anyway."""
    started.set()
    try:
        await asyncio.sleep(0.5)
    except asyncio.CancelledError:
        pass
    return result


async def test_stop_task_cancels_again_a_task_that_swallowed_the_first_cancel():
    swallowed = []

    async def stubborn():
        while True:
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                if swallowed:
                    raise
                swallowed.append(True)

    task = asyncio.create_task(stubborn())
    await asyncio.sleep(0)
    await asyncio.wait_for(stop_task(task, wait_s=0.1), timeout=2)
    assert task.cancelled()
    assert swallowed == [True]


async def test_stop_task_gives_up_on_a_task_that_never_stops():
    async def immortal():
        while True:
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                pass

    task = asyncio.create_task(immortal())
    await asyncio.sleep(0)
    await asyncio.wait_for(stop_task(task, attempts=3, wait_s=0.05), timeout=2)
    assert not task.done()  # it returned, and said so in the log, rather than hang
    task.get_coro().close()


async def test_the_roster_loop_ends_on_a_cancel_its_update_swallowed():
    homes = GatewayHomes(Redis(port=free_port()), Keys("kvs:", queue_shards=3), ttl_s=40.0)
    started = asyncio.Event()
    homes.update = lambda join=True: swallowing_call(started, True)
    task = asyncio.create_task(homes.run())
    await started.wait()
    task.cancel()  # once, as a close without stop_task did
    done, _ = await asyncio.wait({task}, timeout=2)  # the loop would sleep 10 s otherwise
    assert task in done and task.cancelled()


async def test_the_history_sampler_ends_on_a_cancel_its_sample_swallowed():
    history = FleetHistory(sample_s=0.001)  # the first sample at once
    sampler = HistorySampler(history, read_fleet=None, metrics=GatewayMetrics("m"))
    started = asyncio.Event()
    sampler.sample_once = lambda: swallowing_call(started, None)
    sampler.start()
    task = sampler._task
    await started.wait()
    history.sample_s = 30.0  # the loop would sleep this long before it saw another cancel
    task.cancel()
    done, _ = await asyncio.wait({task}, timeout=2)
    assert task in done and task.cancelled()
