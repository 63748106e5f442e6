"""Stopping the gateway's background tasks: a cancel must be able to land more than once."""

from __future__ import annotations

import asyncio
import logging

log = logging.getLogger(__name__)


async def stop_task(task: asyncio.Task, attempts: int = 5, wait_s: float = 1.0) -> None:
    """Cancel `task` and wait for it; cancel again while it still runs. redis-py can swallow a
    cancel that lands as a reply arrives (the command returns its reply, or a read timeout turns
    it into a TimeoutError that the caller retries), and a task waiting on one cancel would then
    be awaited for ever."""
    for _ in range(attempts):
        task.cancel()
        done, _pending = await asyncio.wait({task}, timeout=wait_s)
        if done:
            return
    log.warning("task %s did not stop", task.get_name())


def cancel_requested() -> bool:
    """Whether the running task has been asked to stop: a loop that calls Redis checks this after
    each call, so a cancel the client swallowed still ends it (see `stop_task`)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0
