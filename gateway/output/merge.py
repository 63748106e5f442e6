"""Several choices (n > 1, or several prompts) merged into one stream, each item tagged with its
choice's index."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import TypeVar

T = TypeVar("T")

_DONE = object()


async def merge_choices(choices: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """Items of all iterators as they come, tagged with the iterator's index. The first error ends
    the merge; stopping early cancels the iterators still running (their requests get cancelled).
    """
    if len(choices) == 1:  # no pump task and no queue hop for the common n=1
        try:
            async for item in choices[0]:
                yield 0, item
        finally:
            aclose = getattr(choices[0], "aclose", None)
            if aclose is not None:
                await aclose()  # its own cleanup never blocks (ChoiceStream.close)
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, choice: AsyncIterator[T]) -> None:
        try:
            async for item in choice:
                queue.put_nowait((index, item, None))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer, which re-raises it
            queue.put_nowait((index, _DONE, exc))
            return
        queue.put_nowait((index, _DONE, None))

    tasks = [asyncio.create_task(pump(i, c)) for i, c in enumerate(choices)]
    try:
        running = len(tasks)
        while running:
            index, item, error = await queue.get()
            if error is not None:
                raise error
            if item is _DONE:
                running -= 1
                continue
            yield index, item
    finally:
        for task in tasks:
            task.cancel()  # not awaited: each choice cleans up in its own task
