"""A tiny stand-in for a worker: reads the request stream and publishes scripted token events, one
message each, on the request's reply channel (a script that stops an answer as a worker does,
with the final event's stop fields: tests.gateway.fakes.worker_events)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

from redis.exceptions import ResponseError

from kvfleet.gateway.fleet.tasks import stop_task
from kvfleet.shared.redis_connect import connect_async, is_cluster
from kvfleet.shared.wire import GenerationRequest, Keys, QueueEntry, TokenEvent


class FakeWorker:
    """XREADGROUP on one model's streams of one priority (every shard); for each request,
    publishes `script(request)` at once (no delay: a gateway that subscribed after its XADD would
    lose the first events). Sharded pub/sub on a cluster, as a worker."""

    def __init__(self, redis_url: str, keys: Keys, model: str,
                 script: Callable[[GenerationRequest], list[TokenEvent]],
                 priority: str = "interactive"):
        self.redis = connect_async(redis_url)
        self.sharded = is_cluster(self.redis)
        self.keys = keys
        self.streams = [keys.queue(model, priority, shard) for shard in range(keys.queue_shards)]
        self.stream = self.streams[0]
        self.script = script
        self.received: list[GenerationRequest] = []
        self.entries: list[dict[bytes, bytes]] = []
        self._task: asyncio.Task | None = None
        self._stopping = False

    async def __aenter__(self) -> FakeWorker:
        for stream in self.streams:
            with contextlib.suppress(ResponseError):  # BUSYGROUP: the group exists already
                await self.redis.xgroup_create(stream, self.keys.group, id="0", mkstream=True)
        self._task = asyncio.create_task(self._run())
        return self

    async def __aexit__(self, *exc) -> None:
        self._stopping = True
        await asyncio.wait({self._task}, timeout=0.5)  # ends after its current XREADGROUP
        await stop_task(self._task)
        await self.redis.aclose()

    async def _run(self) -> None:
        block_ms = max(1, 100 // len(self.streams))
        while not self._stopping:
            for stream in self.streams:  # a blocking read spans one slot
                batches = await self.redis.xreadgroup(self.keys.group, "fake-worker",
                                                      {stream: ">"}, count=16, block=block_ms)
                for _stream, entries in batches or []:
                    for entry_id, fields in entries:
                        await self._serve(stream, entry_id, fields)

    async def _serve(self, stream: str, entry_id: bytes, fields: dict[bytes, bytes]) -> None:
        self.entries.append(fields)
        request = QueueEntry.decode(fields).request
        self.received.append(request)
        # the reply channel as a worker picks it: the gateway's inbox, else the request's own
        channel = request.reply_to or self.keys.tokens(request.req_id)
        for event in self.script(request):  # in order, each on the channel's node
            if self.sharded:
                await self.redis.spublish(channel, event.pack(request.req_id))
            else:
                await self.redis.publish(channel, event.pack(request.req_id))
        await self.redis.xack(stream, self.keys.group, entry_id)
