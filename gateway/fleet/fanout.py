"""One pub/sub connection per gateway process (per cluster node on a Redis Cluster), each drained by
one reader task that fans messages out to per-request queues (docs/ARCHITECTURE.md, "Token
events")."""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Coroutine

from redis.asyncio import Redis
from redis.crc import key_slot

from kvfleet.gateway.fleet.client import EngineUnavailable
from kvfleet.gateway.fleet.tasks import stop_task
from kvfleet.shared.redis_connect import REDIS_FAILURES
from kvfleet.shared.wire import TokenEvent
from kvfleet.shared.wire.messages import unpack_stream

log = logging.getLogger(__name__)


class ConnectionLost:
    """Put in every open queue when the pub/sub connection broke: events may have been missed."""


def _wake(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_result(None)


class TokenQueue:
    """The token events of one request stream (and ConnectionLost markers), for its one consumer.

    Cheaper than asyncio.Queue under `asyncio.timeout` (the reader puts into some queue for
    every event it receives): a wait is one future and one timer handle. Unbounded: the reader
    never waits for a consumer.
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
        """The next item; raises TimeoutError when none came within `timeout_s`."""
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
    """Subscribes channels on the process's pub/sub connections: one to a single Redis, or one
    per cluster primary that owns a subscribed channel's slot (sharded pub/sub: SSUBSCRIBE on
    that node; an event is published on one node and travels nowhere else).

    A message carries one or more token events (TokenEvent.unpack_many), each routed by its
    request id to the queues of the streams waiting on that request on that channel: a gateway's
    inbox (GenerationRequest.reply_to) carries the events of all its requests whose keys live on
    one node, a request's own channel (Keys.tokens) those of one request. Inboxes are pinned:
    subscribed once, on first use, and kept while the gateway lives, so a new request on a
    subscribed inbox waits for no SUBSCRIBE at all; other channels are left when their last
    stream is released.

    Invariants: each connection's reader task is the only one reading it, and it never awaits a
    consumer (queues are unbounded; each request's handler drains its own), so a slow client can
    never make Redis drop a connection for its output buffer. SUBSCRIBEs (and UNSUBSCRIBEs)
    asked for in the same turn of the event loop go out as one command per connection: under a
    burst of admissions that is one write per node instead of one per request. One channel has at
    most one subscription in flight, whatever number of streams wait on it.
    """

    def __init__(self, redis: Redis, subscribe_timeout_s: float = 5.0, poll_timeout_s: float = 1.0,
                 sharded: bool = False):
        self._redis = redis
        self._sharded = sharded
        self._subscribe_timeout_s = subscribe_timeout_s
        self._poll_timeout_s = poll_timeout_s  # < redis-py's 5 s socket timeout
        # channel -> request id -> the queues of the streams waiting on it there
        self._routes: dict[bytes, dict[str, list[TokenQueue]]] = {}
        self._pinned: set[bytes] = set()  # inboxes: kept subscribed with no stream waiting
        # channel -> its subscription: pending while in flight, done once Redis confirmed it;
        # dropped when it failed or its connection broke
        self._subscriptions: dict[bytes, asyncio.Future] = {}
        self._links: dict[str, PubSubLink] = {}  # by node name ("" for a single Redis)
        self._link_of: dict[bytes, PubSubLink] = {}
        self._closing = False
        self.connections_opened = 0  # pub/sub connections made (1 per node unless one failed)
        self.messages_received = 0  # token messages on subscribed channels
        self.events_received = 0  # token events in them (events / messages: the coalescing)
        self.undecodable_messages = 0  # messages dropped because they were not token events

    async def start(self) -> None:
        if self._sharded:
            await self._redis.initialize()  # the slot map
        else:
            self._link("")

    async def close(self) -> None:
        self._closing = True
        for link in list(self._links.values()):
            await link.close()
        self._links.clear()

    @property
    def poll_timeout_s(self) -> float:
        """How long one read of a pub/sub connection waits (below redis-py's socket timeout)."""
        return self._poll_timeout_s

    @property
    def num_subscribed(self) -> int:
        """Streams waiting on events (one per request stream, on whichever channel)."""
        return sum(len(queues) for routes in self._routes.values() for queues in routes.values())

    @property
    def num_channels(self) -> int:
        """Channels subscribed or being subscribed (inboxes included)."""
        return len(self._subscriptions)

    @property
    def num_connections(self) -> int:
        """Pub/sub connections open now (one per node with subscribed channels)."""
        return len(self._links)

    async def subscribe(self, channel: str, req_id: str, *, pinned: bool = False) -> TokenQueue:
        """A queue of request `req_id`'s events on `channel`; returns once Redis confirmed the
        channel's subscription (at once when it already had). `pinned`: an inbox, kept
        subscribed when no stream waits on it."""
        key = channel.encode()
        queue = TokenQueue()
        self._routes.setdefault(key, {}).setdefault(req_id, []).append(queue)
        if pinned:
            self._pinned.add(key)
        try:
            await self._subscribed(key)
        except EngineUnavailable:
            self.release(channel, req_id, queue)
            raise
        return queue

    async def resubscribe(self, channel: str, req_id: str) -> None:
        """After its connection broke (a ConnectionLost in the stream's queue), subscribe a channel
        that a stream still holds again: on a cluster, on whichever node owns its slot now (one
        subscription for all the streams on the channel). Their queues go on; events published
        while it was unsubscribed are not in them (the checkpoint has their tokens). Raises
        EngineUnavailable when Redis does not confirm in time (retry later) or the stream was
        released."""
        key = channel.encode()
        if req_id not in self._routes.get(key, {}):
            raise EngineUnavailable(f"the token channel {channel} was released")
        await self._subscribed(key)

    async def _subscribed(self, key: bytes) -> None:
        subscription = self._subscriptions.get(key)
        if subscription is None:
            subscription = self._subscriptions[key] = asyncio.get_running_loop().create_future()
            subscription.add_done_callback(_retrieve)
            link = self._link_of[key] = self._link(self._node_name(key))
            link.ask_subscribe(key)
        if subscription.done() and subscription.exception() is None:
            return
        try:
            async with asyncio.timeout(self._subscribe_timeout_s):
                await asyncio.shield(subscription)
        except (*REDIS_FAILURES, OSError, TimeoutError) as exc:
            self._forget_subscription(key, subscription)
            raise EngineUnavailable(
                f"cannot subscribe to the fleet's token channel: {exc!r}") from exc

    def _forget_subscription(self, key: bytes, subscription: asyncio.Future) -> None:
        """A failed subscription: the next stream to ask starts a new one (on a cluster, on the
        node the slot map names then)."""
        if self._subscriptions.get(key) is subscription:
            del self._subscriptions[key]
            if self._sharded:
                self._link_of.pop(key, None)

    def release(self, channel: str, req_id: str, queue: TokenQueue | None = None) -> None:
        """Forget a stream's queue (the request's only one unless given) now; UNSUBSCRIBE a
        channel no stream waits on any more (not an inbox) in the background (safe inside a
        cancelled task: nothing here awaits)."""
        key = channel.encode()
        routes = self._routes.get(key)
        if routes is None or req_id not in routes:
            return
        queues = routes[req_id]
        if queue is None or queue not in queues:
            queues.clear()
        else:
            queues.remove(queue)
        if not queues:
            del routes[req_id]
        if routes or key in self._pinned:
            return
        del self._routes[key]
        self._subscriptions.pop(key, None)
        link = self._link_of.pop(key, None)
        if link is not None:
            link.ask_unsubscribe(key)

    def _node_name(self, channel: bytes) -> str:
        if not self._sharded:
            return ""
        return self._redis.get_node_from_key(channel).name

    def _link(self, name: str) -> PubSubLink:
        link = self._links.get(name)
        if link is None:
            if self._sharded:
                host, _, port = name.rpartition(":")
                options = {k: v for k, v in self._redis.get_connection_kwargs().items()
                           if k in _NODE_OPTIONS}
                client, owns = Redis(host=host, port=int(port), **options), True
            else:
                client, owns = self._redis, False
            link = self._links[name] = PubSubLink(self, client, name, sharded=self._sharded,
                                                  owns_client=owns)
        return link

    # Called by the links.

    def deliver(self, channel: bytes, data: bytes) -> None:
        routes = self._routes.get(channel)
        if not routes:
            return
        self.messages_received += 1
        try:
            for fields in unpack_stream(data):
                event = TokenEvent.from_dict(fields)
                self.events_received += 1
                for queue in routes.get(event.req_id, ()):
                    queue.put_nowait(event)
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            # msgpack's errors are ValueErrors; a value that is not an event's map fails in
            # from_dict. The events before it were delivered; the streams of any lost one fill
            # the gap from the checkpoint at their next event.
            self.undecodable_messages += 1
            log.warning("dropped (part of) a message on %r that is not token events: %r",
                        channel, exc)

    def wanted(self, channel: bytes) -> bool:
        return channel in self._routes

    def confirm(self, channel: bytes, error: BaseException | None = None) -> None:
        subscription = self._subscriptions.get(channel)
        if subscription is None:
            return
        if error is not None:
            self._forget_subscription(channel, subscription)
        if not subscription.done():
            if error is None:
                subscription.set_result(None)
            else:
                subscription.set_exception(error)

    def link_reconnected(self, link: PubSubLink) -> None:
        """The link's connection was made anew (and its channels subscribed again by redis-py):
        its streams may have missed events, as after a failure."""
        for key, owner in list(self._link_of.items()):
            if owner is link:
                self.channel_lost(link, key)

    def channel_lost(self, link: PubSubLink, key: bytes) -> None:
        """One channel's confirmed subscription ended without being asked (its connection was made
        anew, or its slot migrated): its streams hear of it as of a broken connection. A
        subscription still in flight is left alone: its confirmation comes on the new
        connection, and no stream waiting for it has missed anything yet."""
        if self._link_of.get(key) is not link:
            return
        subscription = self._subscriptions.get(key)
        if subscription is None or not subscription.done():
            return
        self._forget_subscription(key, subscription)
        self._tell_streams_lost(key)

    def _tell_streams_lost(self, key: bytes) -> None:
        """Every stream on the channel may have missed events: it subscribes again and fills the
        gap from the checkpoint."""
        for queues in self._routes.get(key, {}).values():
            for queue in queues:
                queue.put_nowait(ConnectionLost())

    def link_failed(self, link: PubSubLink, error: BaseException) -> None:
        """Events published while a connection was down are lost: every stream on a channel it
        carried hears of it (and pending subscriptions fail); each subscribes again and fills the
        gap from the checkpoint. A cluster node's link is dropped and the slot map refreshed: the
        next subscription of those slots goes to whichever node owns them now."""
        for key, owner in list(self._link_of.items()):
            if owner is link:
                self.confirm(key, error)  # a pending subscription fails (and is forgotten)
                subscription = self._subscriptions.get(key)
                if subscription is not None:  # confirmed before: it is gone with the link
                    self._forget_subscription(key, subscription)
                self._tell_streams_lost(key)
                if self._sharded:
                    self._link_of.pop(key, None)
        if self._sharded and self._links.get(link.name) is link:
            del self._links[link.name]
            link.spawn(self._refresh_slots())

    async def _refresh_slots(self) -> None:
        try:
            await self._redis.nodes_manager.initialize()
        except (*REDIS_FAILURES, OSError) as exc:
            log.debug("slot map refresh failed: %r", exc)


def _retrieve(future: asyncio.Future) -> None:
    """Mark a subscription's failure as seen: its waiters may have timed out already."""
    if not future.cancelled():
        future.exception()


_NODE_OPTIONS = ("username", "password", "socket_connect_timeout", "socket_timeout")


class PubSubLink:
    """One pub/sub connection (to a single Redis, or to one cluster node) and its reader task."""

    def __init__(self, fanout: TokenFanout, client: Redis, name: str, *, sharded: bool,
                 owns_client: bool):
        self.fanout = fanout
        self.name = name
        self._client = client
        self._owns_client = owns_client
        self._sharded = sharded
        self._pubsub = client.pubsub()
        self._message_type = b"smessage" if sharded else b"message"
        self._confirm_type = "ssubscribe" if sharded else "subscribe"
        self._connect_lock = asyncio.Lock()
        self._background: set[asyncio.Task] = set()
        self._to_subscribe: list[bytes] = []  # waiting for the next SUBSCRIBE
        self._to_unsubscribe: set[bytes] = set()  # waiting for the next UNSUBSCRIBE
        self._subscriber: asyncio.Task | None = None  # sends SUBSCRIBEs while some wait
        self._unsubscriber: asyncio.Task | None = None
        self._closed = False
        self._reader = asyncio.create_task(self._read_loop(), name=f"kvfleet-fanout-{name}")

    async def close(self) -> None:
        self._closed = True
        await stop_task(self._reader)
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
        await self._pubsub.aclose()
        if self._owns_client:
            await self._client.aclose()

    def ask_subscribe(self, key: bytes) -> None:
        self._to_unsubscribe.discard(key)  # released and asked for again before it went out
        self._to_subscribe.append(key)
        if self._subscriber is None:
            self._subscriber = self.spawn(self._send_subscribes())

    def ask_unsubscribe(self, key: bytes) -> None:
        self._to_unsubscribe.add(key)
        if self._unsubscriber is None:
            self._unsubscriber = self.spawn(self._send_unsubscribes())

    def spawn(self, coro: Coroutine) -> asyncio.Task:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    async def _send_subscribes(self) -> None:
        """SUBSCRIBE every channel still waiting for one, in one command per batch; a failure
        reaches every subscriber of the batch."""
        try:
            while self._to_subscribe:
                keys = [k for k in self._to_subscribe if self.fanout.wanted(k)]
                self._to_subscribe.clear()
                if not keys:
                    continue
                try:
                    await self.ensure_connection()
                    if self._sharded:  # one SSUBSCRIBE names channels of one slot
                        await self._send_sharded("SSUBSCRIBE", keys)
                    else:
                        await self._pubsub.subscribe(*keys)
                except Exception as exc:  # noqa: BLE001 - see _torn_down; every waiter hears of it
                    failure = exc if _redis_failure(exc) else _torn_down(exc)
                    for key in keys:
                        self.fanout.confirm(key, failure)
        finally:
            self._subscriber = None

    async def _send_unsubscribes(self) -> None:
        try:
            while self._to_unsubscribe:
                keys = [k for k in self._to_unsubscribe if not self.fanout.wanted(k)]
                self._to_unsubscribe.clear()
                if not keys:
                    continue
                try:
                    if self._sharded:
                        await self._send_sharded("SUNSUBSCRIBE", keys)
                    else:
                        await self._pubsub.unsubscribe(*keys)
                except Exception as exc:  # noqa: BLE001 - connection gone: nothing to drop
                    log.debug("unsubscribe of %d channels failed: %r", len(keys), exc)
        finally:
            self._unsubscriber = None

    async def _send_sharded(self, command: str, keys: list[bytes]) -> None:
        """SSUBSCRIBE or SUNSUBSCRIBE `keys`: one command per slot (the server refuses a sharded
        (un)subscription that spans slots), all of them in one write, so a burst costs the node
        one read however many slots it names. redis-py's own bookkeeping (what to subscribe
        again after a reconnect, what is being left) is kept as its ssubscribe/sunsubscribe
        would."""
        pubsub = self._pubsub
        connection = pubsub.connection
        if connection is None:  # never connected or closed: nothing is subscribed there
            raise ConnectionError(f"pub/sub connection {self.name} is not open")
        check_health = not pubsub.subscribed
        if command == "SSUBSCRIBE":
            pubsub.shard_channels.update(dict.fromkeys(keys))
            pubsub.pending_unsubscribe_shard_channels.difference_update(keys)
        else:
            pubsub.pending_unsubscribe_shard_channels.update(keys)
        packed = connection.pack_commands([(command, *group) for group in by_slot(keys)])
        await connection.send_packed_command(packed, check_health=check_health)

    async def _read_loop(self) -> None:
        backoff_s = 0.1
        while not self._closed:
            try:
                await self.ensure_connection()
                response = await self._pubsub.parse_response(
                    block=False, timeout=self.fanout.poll_timeout_s)
                if response is not None and not self._deliver(response):
                    message = await self._pubsub.handle_message(response)
                    if message is not None:
                        self._dispatch(message)
                backoff_s = 0.1
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - a Redis failure, or see _torn_down
                if not _redis_failure(exc):
                    exc = _torn_down(exc)
                    await self._drop_connection()
                log.warning("pub/sub connection %s failed: %r%s", self.name or "to Redis", exc,
                            "" if self._sharded else f"; retrying in {backoff_s:.1f} s")
                self.fanout.link_failed(self, exc)
                if self._sharded:  # this node may be gone: new subscriptions find its successor
                    self._closed = True
                    self.spawn(self._pubsub.aclose())
                    return
                await asyncio.sleep(backoff_s)
                backoff_s = min(backoff_s * 2, 2.0)

    async def _drop_connection(self) -> None:
        """Close the pub/sub connection so that the next read opens it again (and redis-py
        subscribes its channels again there)."""
        connection = self._pubsub.connection
        if connection is not None:
            try:
                await connection.disconnect(nowait=True)
            except Exception as exc:  # noqa: BLE001 - it is being dropped either way
                log.debug("closing pub/sub connection %s: %r", self.name, exc)

    def _deliver(self, response) -> bool:
        """The fast path for a published message (`[b"message", channel, data]`, nearly every
        response): straight to its queue. Anything else goes through redis-py's handle_message,
        which keeps its own subscription bookkeeping (used to resubscribe after a reconnect)."""
        if type(response) is list and len(response) == 3 and response[0] == self._message_type:
            self.fanout.deliver(response[1], response[2])
            return True
        return False

    async def ensure_connection(self) -> None:
        """Open the pub/sub connection once; the lock keeps the reader and a first subscribe from
        opening one each (redis-py would then read one and subscribe on the other)."""
        if self._pubsub.connection is not None:
            return
        async with self._connect_lock:
            if self._pubsub.connection is None:
                await self._pubsub.connect()
                self._pubsub.connection.register_connect_callback(self._reconnected)
                self.fanout.connections_opened += 1

    def _reconnected(self, _connection) -> None:
        """redis-py made this connection anew by itself (its retry of a failed read) and
        subscribed its channels again there: events published in between are lost, so every
        stream on it hears of it as of a failure (it subscribes again and reads the
        checkpoint)."""
        log.warning("pub/sub connection %s was made anew: its streams check for lost events",
                    self.name or "to Redis")
        self.fanout.connections_opened += 1
        self.fanout.link_reconnected(self)

    def _dispatch(self, message: dict) -> None:
        if message["type"] in ("message", "smessage"):
            self.fanout.deliver(message["channel"], message["data"])
        elif message["type"] == self._confirm_type:
            self.fanout.confirm(message["channel"])
        elif message["type"] == "sunsubscribe" and self.fanout.wanted(message["channel"]):
            # not asked for: the channel's slot moved to another node (Redis drops its shard
            # channels' subscribers), so its streams subscribe again there
            self.fanout.channel_lost(self, message["channel"])


def _redis_failure(exc: BaseException) -> bool:
    return isinstance(exc, (*REDIS_FAILURES, OSError))


def _torn_down(exc: Exception) -> ConnectionError:
    """redis-py's asyncio connection can fail with its own errors when it is torn down under a
    command in flight (a Redis restart seen by the reader while a subscribe writes:
    AttributeError on a writer already gone). Such a failure is the connection's, like a
    ConnectionError: the link reconnects and the subscribers hear of it, instead of a reader or
    subscriber task dying with the link left for good."""
    failure = ConnectionError(f"pub/sub connection torn down under a command: {exc!r}")
    failure.__cause__ = exc
    return failure


def by_slot(keys: list[bytes]) -> list[list[bytes]]:
    """`keys` grouped by cluster slot, in first-seen order."""
    groups: dict[int, list[bytes]] = {}
    for key in keys:
        groups.setdefault(key_slot(key), []).append(key)
    return list(groups.values())
