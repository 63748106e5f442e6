"""A tiny stand-in for a worker: reads the request stream and publishes scripted token events."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

from redis.asyncio import Redis
from redis.exceptions import ResponseError

from gateway.fleet.fanout import stop_task
from shared.wire import GenerationRequest, Keys, QueueEntry, TokenEvent


class FakeWorker:
    """XREADGROUP on one model's stream; for each request, publishes `script(request)` at once
    (no delay: a gateway that subscribed after its XADD would lose the first events)."""

    def __init__(self, redis_url: str, keys: Keys, model: str,
                 script: Callable[[GenerationRequest], list[TokenEvent]],
                 priority: str = "interactive"):
        self.redis = Redis.from_url(redis_url)
        self.keys = keys
        self.stream = keys.queue(model, priority)
        self.script = script
        self.received: list[GenerationRequest] = []
        self.entries: list[dict[bytes, bytes]] = []
        self._task: asyncio.Task | None = None
        self._stopping = False

    async def __aenter__(self) -> FakeWorker:
        with contextlib.suppress(ResponseError):  # BUSYGROUP: the group exists already
            await self.redis.xgroup_create(self.stream, self.keys.group, id="0", mkstream=True)
        self._task = asyncio.create_task(self._run())
        return self

    async def __aexit__(self, *exc) -> None:
        self._stopping = True
        await asyncio.wait({self._task}, timeout=0.5)  # ends after its current XREADGROUP
        await stop_task(self._task)
        await self.redis.aclose()

    async def _run(self) -> None:
        while not self._stopping:
            batches = await self.redis.xreadgroup(self.keys.group, "fake-worker",
                                                  {self.stream: ">"}, count=16, block=100)
            for _stream, entries in batches or []:
                for entry_id, fields in entries:
                    await self._serve(entry_id, fields)

    async def _serve(self, entry_id: bytes, fields: dict[bytes, bytes]) -> None:
        self.entries.append(fields)
        request = QueueEntry.decode(fields).request
        self.received.append(request)
        pipe = self.redis.pipeline(transaction=False)
        for event in self.script(request):
            pipe.publish(self.keys.tokens(request.req_id), event.pack())
        pipe.xack(self.stream, self.keys.group, entry_id)
        await pipe.execute()
