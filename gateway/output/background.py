"""Fire-and-forget cleanup work of the gateway (cancelling a request whose client went away),
held until done and drained at shutdown."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine


class BackgroundTasks:
    """Fire-and-forget tasks held by reference until done. Cleanup after a client went away runs
    here: inside a cancelled request task every await would be cancelled again."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task] = set()

    def spawn(self, coro: Coroutine) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def drain(self) -> None:
        if self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
