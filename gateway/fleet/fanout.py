"""One pub/sub connection per gateway process, drained by one reader task that fans messages out to
per-request queues (DESIGN.md, "The fleet protocol", rule 1)."""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Coroutine

from redis.asyncio import Redis
from redis.exceptions import RedisError

from gateway.fleet.client import EngineUnavailable

log = logging.getLogger(__name__)


class ConnectionLost:
    """Put in every open queue when the pub/sub connection broke: events may have been missed."""


def _wake(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_result(None)


class TokenQueue:
    """The raw messages of one channel, for its one consumer (the request's event stream).

    Cheaper than asyncio.Queue under `asyncio.timeout` (the reader puts ~1,000 messages/s): a
    wait is one future and one timer handle. Unbounded: the reader never waits for a consumer.
    """

    def __init__(self) -> None:
        self._items: deque = deque()
        self._waiter: asyncio.Future | None = None

    def qsize(self) -> int:
        return len(self._items)

    def empty(self) -> bool:
        return not self._items

    def put_nowait(self, item) -> None:
        self._items.append(item)
        if self._waiter is not None:
            _wake(self._waiter)

    def get_nowait(self):
        if not self._items:
            raise asyncio.QueueEmpty
        return self._items.popleft()

    async def get(self, timeout_s: float | None = None):
        """The next message; raises TimeoutError when none came within `timeout_s`."""
        if not self._items:
            if self._waiter is not None:
                raise RuntimeError("TokenQueue has one consumer")
            loop = asyncio.get_running_loop()
            waiter = self._waiter = loop.create_future()
            timer = None if timeout_s is None else loop.call_later(timeout_s, _wake, waiter)
            try:
                await waiter
            finally:
                self._waiter = None
                if timer is not None:
                    timer.cancel()
            if not self._items:
                raise TimeoutError
        return self._items.popleft()


class TokenFanout:
    """Subscribes channels on the process's single pub/sub connection.

    Invariants: the reader task is the only one reading the connection, and it never awaits a
    consumer (queues are unbounded; each request's handler drains its own), so a slow client can
    never make Redis drop this connection for its output buffer. SUBSCRIBEs (and UNSUBSCRIBEs)
    asked for in the same turn of the event loop go out as one command: under a burst of
    admissions that is one write to Redis instead of one per request.
    """

    def __init__(self, redis: Redis, subscribe_timeout_s: float = 5.0, poll_timeout_s: float = 1.0):
        self._redis = redis
        self._subscribe_timeout_s = subscribe_timeout_s
        self._poll_timeout_s = poll_timeout_s  # < redis-py's 5 s socket timeout
        self._pubsub = redis.pubsub()
        self._queues: dict[bytes, TokenQueue] = {}
        self._confirmations: dict[bytes, asyncio.Future] = {}
        self._reader: asyncio.Task | None = None
        self._connect_lock = asyncio.Lock()
        self._closing = False
        self._background: set[asyncio.Task] = set()
        self._to_subscribe: list[bytes] = []  # waiting for the next SUBSCRIBE
        self._to_unsubscribe: set[bytes] = set()  # waiting for the next UNSUBSCRIBE
        self._subscriber: asyncio.Task | None = None  # sends SUBSCRIBEs while some wait
        self._unsubscriber: asyncio.Task | None = None
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

    async def subscribe(self, channel: str) -> TokenQueue:
        """A queue of the channel's raw messages; returns once Redis confirmed the subscription."""
        key = channel.encode()
        queue = TokenQueue()
        confirmed = asyncio.get_running_loop().create_future()
        self._queues[key] = queue
        self._confirmations[key] = confirmed
        self._to_unsubscribe.discard(key)  # released and asked for again before it went out
        try:
            async with asyncio.timeout(self._subscribe_timeout_s):
                await self._ensure_connection()
                self._to_subscribe.append(key)
                if self._subscriber is None:
                    self._subscriber = self._spawn(self._send_subscribes())
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
            self._to_unsubscribe.add(key)
            if self._unsubscriber is None:
                self._unsubscriber = self._spawn(self._send_unsubscribes())

    def _spawn(self, coro: Coroutine) -> asyncio.Task:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    async def _send_subscribes(self) -> None:
        """SUBSCRIBE every channel still waiting for one, in one command per batch; a failure
        reaches every subscriber of the batch."""
        try:
            while self._to_subscribe:
                keys = [k for k in self._to_subscribe if k in self._confirmations]
                self._to_subscribe.clear()
                if not keys:
                    continue
                try:
                    await self._pubsub.subscribe(*keys)
                except (RedisError, OSError) as exc:
                    for key in keys:
                        confirmed = self._confirmations.get(key)
                        if confirmed is not None and not confirmed.done():
                            confirmed.set_exception(exc)
        finally:
            self._subscriber = None

    async def _send_unsubscribes(self) -> None:
        try:
            while self._to_unsubscribe:
                keys = [k for k in self._to_unsubscribe if k not in self._queues]
                self._to_unsubscribe.clear()
                if not keys:
                    continue
                try:
                    await self._pubsub.unsubscribe(*keys)
                except (RedisError, OSError) as exc:  # the connection is gone: nothing to drop
                    log.debug("unsubscribe of %d channels failed: %r", len(keys), exc)
        finally:
            self._unsubscriber = None

    async def _read_loop(self) -> None:
        backoff_s = 0.1
        while not self._closing:
            try:
                await self._ensure_connection()
                response = await self._pubsub.parse_response(block=False,
                                                             timeout=self._poll_timeout_s)
                if response is not None and not self._deliver(response):
                    message = await self._pubsub.handle_message(response)
                    if message is not None:
                        self._dispatch(message)
                backoff_s = 0.1
            except asyncio.CancelledError:
                raise
            except (RedisError, OSError) as exc:
                log.warning("pub/sub connection to Redis failed: %r; retrying in %.1f s", exc,
                            backoff_s)
                self._fail_all()
                await asyncio.sleep(backoff_s)
                backoff_s = min(backoff_s * 2, 2.0)

    def _deliver(self, response) -> bool:
        """The fast path for a published message (`[b"message", channel, data]`, nearly every
        response): straight to its queue. Anything else goes through redis-py's handle_message,
        which keeps its own subscription bookkeeping (used to resubscribe after a reconnect)."""
        if type(response) is list and len(response) == 3 and response[0] == b"message":
            queue = self._queues.get(response[1])
            if queue is not None:
                queue.put_nowait(response[2])
            return True
        return False

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
