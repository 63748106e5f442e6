"""One pub/sub connection per gateway process, drained by one reader task that fans messages out to
per-request queues (DESIGN.md, "The fleet protocol", rule 1)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine

from redis.asyncio import Redis
from redis.exceptions import RedisError

from gateway.client import EngineUnavailable

log = logging.getLogger(__name__)


class ConnectionLost:
    """Put in every open queue when the pub/sub connection broke: events may have been missed."""


class TokenFanout:
    """Subscribes channels on the process's single pub/sub connection.

    Invariants: the reader task is the only one reading the connection, and it never awaits a
    consumer (queues are unbounded; each request's handler drains its own), so a slow client can
    never make Redis drop this connection for its output buffer.
    """

    def __init__(self, redis: Redis, subscribe_timeout_s: float = 5.0, poll_timeout_s: float = 1.0):
        self._redis = redis
        self._subscribe_timeout_s = subscribe_timeout_s
        self._poll_timeout_s = poll_timeout_s  # < redis-py's 5 s socket timeout
        self._pubsub = redis.pubsub()
        self._queues: dict[bytes, asyncio.Queue] = {}
        self._confirmations: dict[bytes, asyncio.Future] = {}
        self._reader: asyncio.Task | None = None
        self._connect_lock = asyncio.Lock()
        self._closing = False
        self._background: set[asyncio.Task] = set()
        self.connections_opened = 0  # pub/sub connections made (1 unless Redis restarted)

    async def start(self) -> None:
        if self._reader is None:
            self._reader = asyncio.create_task(self._read_loop(), name="kvfleet-token-fanout")

    async def close(self) -> None:
        if self._reader is not None:
            self._closing = True
            await stop_task(self._reader)
            self._reader = None
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
        await self._pubsub.aclose()

    @property
    def num_subscribed(self) -> int:
        return len(self._queues)

    async def subscribe(self, channel: str) -> asyncio.Queue:
        """A queue of the channel's raw messages; returns once Redis confirmed the subscription."""
        key = channel.encode()
        queue: asyncio.Queue = asyncio.Queue()
        confirmed = asyncio.get_running_loop().create_future()
        self._queues[key] = queue
        self._confirmations[key] = confirmed
        try:
            async with asyncio.timeout(self._subscribe_timeout_s):
                await self._ensure_connection()
                await self._pubsub.subscribe(key)
                await confirmed
        except (RedisError, OSError, TimeoutError) as exc:
            self.release(channel)
            raise EngineUnavailable(
                f"cannot subscribe to the fleet's token channel: {exc!r}") from exc
        finally:
            self._confirmations.pop(key, None)
        return queue

    def release(self, channel: str) -> None:
        """Forget the channel's queue now; UNSUBSCRIBE in the background (safe inside a cancelled
        task: nothing here awaits)."""
        key = channel.encode()
        if self._queues.pop(key, None) is not None:
            self._spawn(self._unsubscribe(key))

    def _spawn(self, coro: Coroutine) -> None:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _unsubscribe(self, key: bytes) -> None:
        try:
            await self._pubsub.unsubscribe(key)
        except (RedisError, OSError) as exc:  # the connection is gone: nothing left to unsubscribe
            log.debug("unsubscribe %r failed: %r", key, exc)

    async def _read_loop(self) -> None:
        backoff_s = 0.1
        while not self._closing:
            try:
                await self._ensure_connection()
                message = await self._pubsub.get_message(timeout=self._poll_timeout_s)
                backoff_s = 0.1
            except asyncio.CancelledError:
                raise
            except (RedisError, OSError) as exc:
                log.warning("pub/sub connection to Redis failed: %r; retrying in %.1f s", exc,
                            backoff_s)
                self._fail_all()
                await asyncio.sleep(backoff_s)
                backoff_s = min(backoff_s * 2, 2.0)
                continue
            if message is not None:
                self._dispatch(message)

    async def _ensure_connection(self) -> None:
        """Open the pub/sub connection once; the lock keeps the reader and a first subscribe from
        opening one each (redis-py would then read one and subscribe on the other)."""
        if self._pubsub.connection is not None:
            return
        async with self._connect_lock:
            if self._pubsub.connection is None:
                await self._pubsub.connect()
                self.connections_opened += 1

    def _dispatch(self, message: dict) -> None:
        channel = message["channel"]
        if message["type"] == "message":
            queue = self._queues.get(channel)
            if queue is not None:
                queue.put_nowait(message["data"])
        elif message["type"] == "subscribe":
            confirmed = self._confirmations.get(channel)
            if confirmed is not None and not confirmed.done():
                confirmed.set_result(None)

    def _fail_all(self) -> None:
        """Events published while the connection was down are lost: end every open request."""
        for queue in self._queues.values():
            queue.put_nowait(ConnectionLost())


async def stop_task(task: asyncio.Task, attempts: int = 5, wait_s: float = 1.0) -> None:
    """Cancel `task` and wait for it. Cancels again if it is still running: a cancellation that
    lands as a redis-py read times out can be turned into a timeout and retried."""
    for _ in range(attempts):
        task.cancel()
        done, _pending = await asyncio.wait({task}, timeout=wait_s)
        if done:
            break
    else:
        log.warning("task %s did not stop", task.get_name())
