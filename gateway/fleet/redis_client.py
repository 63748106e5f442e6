"""The EngineClient of a real fleet: enqueue on the model's Redis stream, receive token events in
this gateway's inboxes over the process's pub/sub connections (docs/ARCHITECTURE.md, "Inboxes";
gateway/fleet/inboxes.py)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid

from kvfleet.gateway.fleet.client import (
    EngineClient,
    EngineTimeout,
    EngineUnavailable,
    EventStream,
    QueueLoad,
    RequestSnapshot,
)
from kvfleet.gateway.fleet.affinity import Route, Router
from kvfleet.gateway.fleet.cancels import CancelPublisher
from kvfleet.gateway.fleet.fanout import ConnectionLost, TokenFanout, TokenQueue
from kvfleet.gateway.fleet.homes import GatewayHomes
from kvfleet.gateway.fleet.inboxes import Inboxes
from kvfleet.gateway.fleet.load import queue_undelivered, read_heartbeats
from kvfleet.gateway.fleet.pace import fleet_pace
from kvfleet.gateway.fleet.redis_context import RedisContext
from kvfleet.gateway.fleet.tasks import stop_task
from kvfleet.shared.redis_connect import REDIS_FAILURES
from kvfleet.shared.settings import GatewaySettings
from kvfleet.shared.wire import (
    GenerationRequest,
    Keys,
    RequestRecord,
    TokenEvent,
    decode_checkpoint,
    scripts,
)

log = logging.getLogger(__name__)

RESULT_GRACE_S = 3600  # the request hash outlives the request's deadline by this much
RECONNECT_RETRY_S = 0.2  # between attempts to subscribe a channel again (or read a checkpoint)
CHECKPOINT_READS = 3  # attempts to read a checkpoint that fills a gap in a stream's events


class RedisEventStream(EventStream):
    """Token events of one request, read from its fan-out queue, with the protocol's timeouts.

    When the pub/sub connection carrying its channel breaks (a Redis restart, a cluster primary
    failing over to its replica), the stream subscribes again for up to `reconnect_s` and goes on:
    the next event's tokens that it missed come from the checkpoint (ChoiceStream fills the gap),
    and a request that ended meanwhile ends with an event made from its record. Only a fleet
    that stays unreachable ends the stream with EngineUnavailable (retryable)."""

    def __init__(self, req_id: str, channel: str, queue: TokenQueue, fanout: TokenFanout,
                 first_event_timeout_s: float, deadline: float | None, *,
                 client: RedisEngineClient | None = None, reconnect_s: float = 0.0):
        self.req_id = req_id
        self._channel = channel
        self._queue = queue
        self._fanout = fanout
        self._first_event_timeout_s = first_event_timeout_s
        self._deadline = deadline  # unix time
        self._received_any = False
        self._client = client  # reads the request's record after a reconnect
        self._reconnect_s = reconnect_s if client is not None else 0.0

    def _timeout_s(self) -> float:
        left_s = float("inf") if self._deadline is None else self._deadline - time.time()
        if not self._received_any:
            left_s = min(left_s, self._first_event_timeout_s)
        return max(left_s, 0.0)

    async def __anext__(self) -> TokenEvent:
        while True:
            try:
                item = self._queue.get_nowait()  # the common case under load: no timer, no task
                if self._deadline is not None and time.time() > self._deadline:
                    raise EngineTimeout(f"request {self.req_id} passed its deadline")
            except asyncio.QueueEmpty:
                item = await self._wait()
            if not isinstance(item, ConnectionLost):
                self._received_any = True
                return item
            ended = await self._reconnect()
            if ended is not None:
                return ended

    async def _reconnect(self) -> TokenEvent | None:
        """Subscribe the channel again and read the request's record, retrying for reconnect_s;
        the final event of a request that ended while the channel was down, else None."""
        give_up = time.monotonic() + self._reconnect_s
        failure: BaseException | None = None
        while time.monotonic() < give_up:
            try:
                await self._fanout.resubscribe(self._channel, self.req_id)
                snapshot = await self._client.read_snapshot(self.req_id)
            except (EngineUnavailable, RuntimeError) as exc:
                # RuntimeError: redis-py's cluster client, rebuilding its node map after a
                # failover, was seen to fail a command with one ("... attached to a different
                # loop", from a removed node's disconnect): a failed attempt like any other
                log.debug("request %s: subscribing again failed: %r", self.req_id, exc)
                failure = exc
                await asyncio.sleep(min(RECONNECT_RETRY_S, max(give_up - time.monotonic(), 0)))
                continue
            log.info("request %s: token channel subscribed again after a lost connection",
                     self.req_id)
            if snapshot is None:
                raise EngineUnavailable(f"request {self.req_id} is gone from Redis")
            if not snapshot.status.is_finished:
                return None  # the next event shows what was missed; the checkpoint has it
            self._received_any = True
            return TokenEvent(seq=len(snapshot.token_ids), attempt=snapshot.attempt,
                              finish_reason=snapshot.status.finish_reason)
        detail = f" and could not subscribe again within {self._reconnect_s:g} s" if failure else ""
        raise EngineUnavailable(f"lost the connection to Redis while waiting for tokens{detail}")

    async def _wait(self) -> TokenEvent | ConnectionLost:
        try:
            return await self._queue.get(self._timeout_s())  # one timer, no Timeout context
        except TimeoutError:
            if self._received_any:
                raise EngineTimeout(f"request {self.req_id} passed its deadline") from None
            raise EngineTimeout(
                f"no worker answered request {self.req_id} in time (is a worker running for "
                "this model?)") from None

    async def aclose(self) -> None:
        self._fanout.release(self._channel, self.req_id, self._queue)
        if self._client is not None and self._client.router is not None:
            self._client.router.finished(self.req_id)


def _snapshot(fields: list, ckpt: bytes | None) -> RequestSnapshot | None:
    """A RequestSnapshot from the hash's SNAPSHOT_FIELDS and the checkpoint; None when the request
    is unknown or expired."""
    record = RequestRecord.decode_snapshot(*fields)
    if record is None:
        return None
    return RequestSnapshot(record.request, record.status, record.attempt, decode_checkpoint(ckpt))


class RedisEngineClient(EngineClient):
    """Talks to the fleet through the gateway's Redis context: its command pool plus one pub/sub
    connection."""

    def __init__(self, context: RedisContext, *, stream_maxlen: int = 100_000,
                 request_timeout_s: float = 600.0, first_event_timeout_s: float = 600.0,
                 stream_reconnect_s: float = 15.0, shard_shares: bool = True,
                 owns_context: bool = False, gateway_id: str | None = None,
                 inboxes: bool = True, router: Router | None = None):
        self.context = context
        self.keys = context.keys
        self.redis = context.redis
        self._stream_maxlen = stream_maxlen
        self._request_timeout_s = request_timeout_s
        self._first_event_timeout_s = first_event_timeout_s
        self._stream_reconnect_s = stream_reconnect_s
        self._command_timeout_s = context.command_timeout_s
        self._owns_context = owns_context  # close() closes it too
        self.fanout = TokenFanout(self.redis, subscribe_timeout_s=self._command_timeout_s,
                                  sharded=context.cluster)
        # one task publishes the cancellations, in batches: a burst of clients going away
        # takes one connection, not the pool the requests still in flight need
        self.cancels = CancelPublisher(self.redis, self.keys.cancel(), sharded=context.cluster,
                                       command_timeout_s=self._command_timeout_s,
                                       give_up_s=request_timeout_s)
        self._enqueue = scripts.ENQUEUE.register(self.redis)
        self._attach = scripts.ATTACH.register(self.redis)
        self.gateway_id = gateway_id or f"gw-{uuid.uuid4().hex[:12]}"
        # The requests' reply channels: events come back one message per worker step (None: each
        # request's own channel, one message per event).
        self.inboxes = (Inboxes(self.redis, self.keys, self.gateway_id, cluster=context.cluster)
                        if inboxes else None)
        # With several stream shards: new requests go to this gateway's shares of them.
        self.homes = (GatewayHomes(self.redis, self.keys, self.gateway_id,
                                   command_timeout_s=self._command_timeout_s)
                      if shard_shares and self.keys.queue_shards > 1 else None)
        self._homes_task: asyncio.Task | None = None
        # Prefix-affinity or random routing (None: every request to the shared streams).
        self.router = router

    @classmethod
    def from_settings(cls, settings: GatewaySettings, context: RedisContext) -> RedisEngineClient:
        return cls(context, stream_maxlen=settings.stream_maxlen,
                   request_timeout_s=settings.request_timeout_s,
                   first_event_timeout_s=settings.first_event_timeout_s,
                   stream_reconnect_s=settings.stream_reconnect_s,
                   shard_shares=settings.gateway_shard_shares,
                   inboxes=settings.gateway_inboxes,
                   router=Router(context.redis, context.keys, balance=settings.affinity_balance,
                                 min_blocks=settings.affinity_min_blocks,
                                 host_tier_weight=settings.affinity_host_tier_weight,
                                 policy=settings.routing)
                   if settings.routing != "shared" else None)

    @classmethod
    def from_url(cls, redis_url: str, keys: Keys, *, connect_timeout_s: float = 2.0,
                 command_timeout_s: float = 3.0, **options) -> RedisEngineClient:
        """A client with a Redis context of its own (tests, tools)."""
        context = RedisContext(redis_url, keys, connect_timeout_s=connect_timeout_s,
                               command_timeout_s=command_timeout_s)
        return cls(context, owns_context=True, **options)

    async def start(self) -> None:
        await self.fanout.start()
        if self.homes is not None:
            await self.homes.update()  # a place before the first request, if Redis answers
            self._homes_task = asyncio.create_task(self.homes.run(), name="gateway-roster")

    async def close(self) -> None:
        await self.cancels.close()
        if self.router is not None:
            await self.router.close()
        if self._homes_task is not None:
            await stop_task(self._homes_task)
            self._homes_task = None
            await self.homes.leave()  # the others take its shares at once, not after its TTL
        await self.fanout.close()
        if self._owns_context:
            await self.context.aclose()

    def new_request_hex(self, prefix: str) -> str:
        """A hex whose id `prefix + hex` lives on a stream shard drawn by this gateway's shares
        (gateway/fleet/homes.py), any shard when it has none."""
        if self.homes is None:
            return super().new_request_hex(prefix)
        return self.homes.request_hex(prefix)

    async def submit(self, request: GenerationRequest) -> EventStream:
        if self.inboxes is not None:
            channel = self.inboxes.for_request(request.req_id)
            request = dataclasses.replace(request, reply_to=channel)
        else:
            channel = self.keys.tokens(request.req_id)
        # subscribed before the XADD (pub/sub keeps nothing): at once when the inbox already is
        queue = await self.fanout.subscribe(channel, request.req_id,
                                            pinned=self.inboxes is not None)
        try:
            await self.enqueue(request)
        except BaseException:
            self.fanout.release(channel, request.req_id, queue)
            raise
        return RedisEventStream(request.req_id, channel, queue, self.fanout,
                                self._first_event_timeout_s, request.deadline, client=self,
                                reconnect_s=self._stream_reconnect_s)

    async def enqueue(self, request: GenerationRequest) -> bool:
        """Write the request hash and then the stream entry (on the shard the id picks), once;
        False if the id was enqueued before. When the entry cannot be written after the hash was,
        the marker is removed (best effort) so that a retry under the same id can enqueue."""
        ttl_s = int(self._request_timeout_s + RESULT_GRACE_S)
        call = scripts.enqueue(self.keys, request, ttl_s=ttl_s)
        route = self.route(request)
        stream, fields = scripts.queue_entry(self.keys, request, route.worker or "",
                                             route.cached_tokens)
        try:
            async with asyncio.timeout(self._command_timeout_s * 2):
                if not await self._enqueue(keys=call.keys, args=call.args):
                    self._unroute(request.req_id)
                    return False
        except (*REDIS_FAILURES, OSError, TimeoutError) as exc:
            self._unroute(request.req_id)
            raise EngineUnavailable(f"cannot enqueue the request in Redis: {exc!r}") from exc
        try:
            async with asyncio.timeout(self._command_timeout_s * 2):
                await self.redis.xadd(stream, fields, maxlen=self._stream_maxlen,
                                      approximate=True)
        except (*REDIS_FAILURES, OSError, TimeoutError) as exc:
            self._unroute(request.req_id)
            await self._forget(request.req_id)
            raise EngineUnavailable(f"cannot enqueue the request in Redis: {exc!r}") from exc
        return True

    def _unroute(self, req_id: str) -> None:
        """A routed request that was not enqueued no longer loads its worker."""
        if self.router is not None:
            self.router.finished(req_id)

    def route(self, request: GenerationRequest) -> Route:
        """The worker whose own stream the request goes to (None: the shared streams); the
        router follows a model from its first request on."""
        if self.router is None:
            return Route(None, 0, "shared")
        self.router.follow(request.model)
        return self.router.route(request.model, request.prompt_token_ids, request.req_id,
                                 adapter=request.lora, adapter_path=request.lora_path)

    async def _forget(self, req_id: str) -> None:
        try:
            async with asyncio.timeout(self._command_timeout_s):
                await self.redis.delete(self.keys.enqueued(req_id))
        except (*REDIS_FAILURES, OSError, TimeoutError) as exc:
            log.warning("could not remove the enqueue marker of %s: %r", req_id, exc)

    async def attach(self, req_id: str) -> tuple[RequestSnapshot, EventStream] | None:
        """Events of a request enqueued anywhere: on its own channel, subscribed before ATTACH
        marks the request watched (its events go there too from then on) and reads it."""
        channel = self.keys.tokens(req_id)
        queue = await self.fanout.subscribe(channel, req_id)
        try:
            snapshot = await self._read_attached(req_id)
        except BaseException:
            self.fanout.release(channel, req_id, queue)
            raise
        if snapshot is None:
            self.fanout.release(channel, req_id, queue)
            return None
        stream = RedisEventStream(req_id, channel, queue, self.fanout,
                                  self._first_event_timeout_s, snapshot.request.deadline,
                                  client=self, reconnect_s=self._stream_reconnect_s)
        return snapshot, stream

    async def _read_attached(self, req_id: str) -> RequestSnapshot | None:
        call = scripts.attach(self.keys, req_id)
        try:
            async with asyncio.timeout(self._command_timeout_s * 2):
                *fields, ckpt = await self._attach(keys=call.keys, args=call.args)
        except (*REDIS_FAILURES, OSError, TimeoutError) as exc:
            raise EngineUnavailable(f"cannot read the request from Redis: {exc!r}") from exc
        return _snapshot(fields, ckpt)

    async def read_snapshot(self, req_id: str) -> RequestSnapshot | None:
        try:
            async with asyncio.timeout(self._command_timeout_s * 2):
                pipe = self.redis.pipeline(transaction=True)  # hash and checkpoint of one moment
                pipe.hmget(self.keys.request(req_id), *RequestRecord.SNAPSHOT_FIELDS)
                pipe.get(self.keys.checkpoint(req_id))
                fields, ckpt = await pipe.execute()
        except (*REDIS_FAILURES, OSError, TimeoutError) as exc:
            raise EngineUnavailable(f"cannot read the request from Redis: {exc!r}") from exc
        return _snapshot(fields, ckpt)

    async def read_checkpoint(self, req_id: str) -> list[int]:
        """The checkpoint, read up to CHECKPOINT_READS times; EngineUnavailable when Redis does not
        answer (a gap that cannot be filled ends the stream with a retryable error rather than
        give the client a text with tokens missing)."""
        for attempt in range(CHECKPOINT_READS):
            try:
                async with asyncio.timeout(self._command_timeout_s):
                    return decode_checkpoint(await self.redis.get(self.keys.checkpoint(req_id)))
            except (*REDIS_FAILURES, OSError, TimeoutError) as exc:
                log.warning("could not read the checkpoint of %s: %r", req_id, exc)
                if attempt + 1 == CHECKPOINT_READS:
                    raise EngineUnavailable(
                        f"cannot read the checkpoint of request {req_id} to fill a gap in its "
                        f"token events: {exc!r}") from exc
                await asyncio.sleep(RECONNECT_RETRY_S)
        return []

    async def queue_load(self, model: str) -> QueueLoad | None:
        """Undelivered entries of the model's streams (the group's lag), the summed tokens/s
        of live heartbeats for this model, draining workers left out (expired heartbeats are
        gone by their TTL), and their room at the pace they promise."""
        try:
            async with asyncio.timeout(self._command_timeout_s * 2):
                undelivered = await queue_undelivered(self.redis, self.keys, model)
                beats = await read_heartbeats(self.redis, self.keys)
        except (*REDIS_FAILURES, OSError, TimeoutError) as exc:
            log.warning("could not read the queue load: %r", exc)
            return None
        # A draining worker's speed is no capacity for new work. The others' count, whatever
        # their role, and none twice: each token is generated by one worker (a handed-off
        # stream's by its source before the handoff, by its taker after it).
        mine = [beat.tokens_per_s for beat in beats.values()
                if beat.model == model and not beat.draining]
        pace = fleet_pace((beat for beat in beats.values() if not beat.draining), model)
        return QueueLoad(undelivered, len(mine), sum(max(tps, 0.0) for tps in mine),
                         pace_room=pace.room, pace_promised=pace.promised)

    async def cancel(self, req_id: str) -> None:
        """Publish the cancellation with the next batch (gateway/fleet/cancels.py) and wait until
        Redis took it; a failed batch is sent again until Redis takes it or the request's deadline
        passed."""
        await self.cancels.publish(req_id)

    async def is_ready(self) -> bool:
        try:
            async with asyncio.timeout(self._command_timeout_s):
                return bool(await self.redis.ping())
        except (*REDIS_FAILURES, OSError, TimeoutError):
            return False
