"""The EngineClient of a real fleet: enqueue on the model's Redis stream, receive token events over
the process's single pub/sub connection (DESIGN.md, "The fleet protocol")."""

from __future__ import annotations

import array
import asyncio
import logging
import sys
import time

from redis.asyncio import Redis
from redis.exceptions import RedisError

from gateway.dashboard.router import stream_depth
from gateway.fleet.client import (
    EngineClient,
    EngineTimeout,
    EngineUnavailable,
    EventStream,
    QueueLoad,
    RequestSnapshot,
)
from gateway.fleet.fanout import ConnectionLost, TokenFanout, TokenQueue
from shared.keys import PRIORITIES, Keys
from shared.messages import GenerationRequest, TokenEvent
from shared.settings import GatewaySettings
from shared.status import RequestStatus

log = logging.getLogger(__name__)

# Idempotent enqueue: a retried submit of the same id writes nothing twice.
# KEYS: enqueued marker, request hash, request stream.
# ARGV: ttl_s, payload, req_id, stream maxlen, status.
_ENQUEUE_LUA = """
if not redis.call('SET', KEYS[1], '1', 'NX', 'EX', ARGV[1]) then
  return 0
end
redis.call('HSET', KEYS[2], 'payload', ARGV[2], 'attempt', 0, 'status', ARGV[5])
redis.call('EXPIRE', KEYS[2], ARGV[1])
redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[4], '*', 'id', ARGV[3], 'payload', ARGV[2])
return 1
"""

def decode_checkpoint(raw: bytes | None) -> list[int]:
    """The checkpoint string: little-endian uint32 token ids (worker/protocol.py writes it)."""
    data = array.array("I")
    data.frombytes((raw or b"")[:len(raw or b"") // 4 * 4])
    if sys.byteorder == "big":  # pragma: no cover
        data.byteswap()
    return data.tolist()


def _float(raw: bytes | None) -> float:
    try:
        return max(float(raw or 0), 0.0)
    except ValueError:
        return 0.0


RESULT_GRACE_S = 3600  # the request hash outlives the request's deadline by this much


class RedisEventStream(EventStream):
    """Token events of one request, read from its fan-out queue, with the protocol's timeouts."""

    def __init__(self, req_id: str, channel: str, queue: TokenQueue, fanout: TokenFanout,
                 first_event_timeout_s: float, deadline: float | None):
        self.req_id = req_id
        self._channel = channel
        self._queue = queue
        self._fanout = fanout
        self._first_event_timeout_s = first_event_timeout_s
        self._deadline = deadline  # unix time
        self._received_any = False

    def _timeout_s(self) -> float:
        left_s = float("inf") if self._deadline is None else self._deadline - time.time()
        if not self._received_any:
            left_s = min(left_s, self._first_event_timeout_s)
        return max(left_s, 0.0)

    async def __anext__(self) -> TokenEvent:
        try:
            raw = self._queue.get_nowait()  # the common case under load: no timer, no task
            if self._deadline is not None and time.time() > self._deadline:
                raise EngineTimeout(f"request {self.req_id} passed its deadline")
        except asyncio.QueueEmpty:
            raw = await self._wait()
        if isinstance(raw, ConnectionLost):
            raise EngineUnavailable("lost the connection to Redis while waiting for tokens")
        self._received_any = True
        return TokenEvent.unpack(raw)

    async def _wait(self) -> bytes | ConnectionLost:
        try:
            return await self._queue.get(self._timeout_s())  # one timer, no Timeout context
        except TimeoutError:
            if self._received_any:
                raise EngineTimeout(f"request {self.req_id} passed its deadline") from None
            raise EngineTimeout(
                f"no worker answered request {self.req_id} in time (is a worker running for "
                "this model?)") from None

    async def aclose(self) -> None:
        self._fanout.release(self._channel)


class RedisEngineClient(EngineClient):
    """Talks to the fleet through one Redis: one command pool plus one pub/sub connection."""

    def __init__(self, redis_url: str, keys: Keys, *, stream_maxlen: int = 100_000,
                 request_timeout_s: float = 600.0, first_event_timeout_s: float = 600.0,
                 connect_timeout_s: float = 2.0, command_timeout_s: float = 3.0):
        self.keys = keys
        self._stream_maxlen = stream_maxlen
        self._request_timeout_s = request_timeout_s
        self._first_event_timeout_s = first_event_timeout_s
        self._command_timeout_s = command_timeout_s
        # Short timeouts: Redis unreachable must become a 503 quickly, never a hang.
        self.redis = Redis.from_url(redis_url, socket_connect_timeout=connect_timeout_s,
                                    socket_timeout=command_timeout_s)
        self.fanout = TokenFanout(self.redis, subscribe_timeout_s=command_timeout_s)
        self._enqueue = self.redis.register_script(_ENQUEUE_LUA)

    @classmethod
    def from_settings(cls, settings: GatewaySettings) -> RedisEngineClient:
        if not settings.redis_url:
            raise ValueError("the gateway needs --redis-url (or KVFLEET_REDIS_URL)")
        return cls(settings.redis_url, Keys(settings.key_prefix),
                   stream_maxlen=settings.stream_maxlen,
                   request_timeout_s=settings.request_timeout_s,
                   first_event_timeout_s=settings.first_event_timeout_s)

    async def start(self) -> None:
        await self.fanout.start()

    async def close(self) -> None:
        await self.fanout.close()
        await self.redis.aclose()

    async def submit(self, request: GenerationRequest) -> EventStream:
        channel = self.keys.tokens(request.req_id)
        queue = await self.fanout.subscribe(channel)  # before the XADD: pub/sub keeps nothing
        try:
            await self.enqueue(request)
        except BaseException:
            self.fanout.release(channel)
            raise
        return RedisEventStream(request.req_id, channel, queue, self.fanout,
                                self._first_event_timeout_s, request.deadline)

    async def enqueue(self, request: GenerationRequest) -> bool:
        """Write the request hash and the stream entry once; False if the id was enqueued before."""
        ttl_s = int(self._request_timeout_s + RESULT_GRACE_S)
        keys = [self.keys.enqueued(request.req_id), self.keys.request(request.req_id),
                self.keys.queue(request.model, request.priority)]
        args = [ttl_s, request.pack(), request.req_id, self._stream_maxlen,
                RequestStatus.QUEUED.value]
        try:
            async with asyncio.timeout(self._command_timeout_s * 2):
                return bool(await self._enqueue(keys=keys, args=args))
        except (RedisError, OSError, TimeoutError) as exc:
            raise EngineUnavailable(f"cannot enqueue the request in Redis: {exc!r}") from exc

    async def attach(self, req_id: str) -> tuple[RequestSnapshot, EventStream] | None:
        channel = self.keys.tokens(req_id)
        queue = await self.fanout.subscribe(channel)  # before the reads: pub/sub keeps nothing
        try:
            snapshot = await self._read_snapshot(req_id)
        except BaseException:
            self.fanout.release(channel)
            raise
        if snapshot is None:
            self.fanout.release(channel)
            return None
        stream = RedisEventStream(req_id, channel, queue, self.fanout,
                                  self._first_event_timeout_s, snapshot.request.deadline)
        return snapshot, stream

    async def _read_snapshot(self, req_id: str) -> RequestSnapshot | None:
        try:
            async with asyncio.timeout(self._command_timeout_s * 2):
                pipe = self.redis.pipeline(transaction=True)  # hash and checkpoint of one moment
                pipe.hmget(self.keys.request(req_id), "payload", "status", "attempt")
                pipe.get(self.keys.checkpoint(req_id))
                (payload, status, attempt), ckpt = await pipe.execute()
        except (RedisError, OSError, TimeoutError) as exc:
            raise EngineUnavailable(f"cannot read the request from Redis: {exc!r}") from exc
        if payload is None:
            return None
        try:
            request_status = RequestStatus(status.decode() if status else "queued")
        except ValueError:
            request_status = RequestStatus.QUEUED
        return RequestSnapshot(GenerationRequest.unpack(payload), request_status,
                               int(attempt or 0), decode_checkpoint(ckpt))

    async def read_checkpoint(self, req_id: str) -> list[int]:
        try:
            async with asyncio.timeout(self._command_timeout_s):
                return decode_checkpoint(await self.redis.get(self.keys.checkpoint(req_id)))
        except (RedisError, OSError, TimeoutError) as exc:
            log.warning("could not read the checkpoint of %s: %r", req_id, exc)
            return []

    async def queue_load(self, model: str) -> QueueLoad | None:
        """Undelivered entries of the model's streams (the group's lag) and the summed tokens/s
        of live heartbeats for this model (expired heartbeats are gone by their TTL)."""
        try:
            async with asyncio.timeout(self._command_timeout_s * 2):
                undelivered = 0
                for priority in PRIORITIES:
                    depth, _pending = await stream_depth(
                        self.redis, self.keys.queue(model, priority), self.keys.group)
                    undelivered += depth
                names = [k async for k in self.redis.scan_iter(
                    match=self.keys.worker_pattern(), count=1000)]
                pipe = self.redis.pipeline(transaction=False)
                for name in names:
                    pipe.hmget(name, "model", "tokens_per_s")
                beats = await pipe.execute() if names else []
        except (RedisError, OSError, TimeoutError) as exc:
            log.warning("could not read the queue load: %r", exc)
            return None
        mine = [tps for m, tps in beats if m is not None and m.decode() == model]
        return QueueLoad(undelivered, len(mine), sum(_float(tps) for tps in mine))

    async def cancel(self, req_id: str) -> None:
        try:
            await self.redis.publish(self.keys.cancel(), req_id)
        except (RedisError, OSError) as exc:
            log.warning("could not publish the cancellation of %s: %r", req_id, exc)

    async def is_ready(self) -> bool:
        try:
            async with asyncio.timeout(self._command_timeout_s):
                return bool(await self.redis.ping())
        except (RedisError, OSError, TimeoutError):
            return False
