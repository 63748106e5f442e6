"""The gateway's one door to Redis: the connection settings, the key names and the clients,
built once in `create_app` and handed to everything that talks to Redis (engine client, API keys,
rate limiter, dashboard, batch routes)."""

from __future__ import annotations

import threading

import redis

from kvfleet.shared.redis_connect import AsyncClient, SyncClient, cluster_enabled, connect, connect_async
from kvfleet.shared.settings import CommonSettings, GatewaySettings
from kvfleet.shared.wire import Keys

# the gateway's bound on its Redis connections, where a caller gives none (tests, tools)
MAX_CONNECTIONS = GatewaySettings.model_fields["redis_max_connections"].default


class RedisContext:
    """One Redis (or one Redis Cluster: `cluster`, probed once here), two kinds of client: `redis`
    (asyncio: everything on the event loop) and `sync()` (blocking, made on first use: the batch
    routes, which run in FastAPI's thread pool). Short timeouts: Redis unreachable must become a
    503 quickly, never a hang."""

    def __init__(self, url: str, keys: Keys, *, connect_timeout_s: float = 2.0,
                 command_timeout_s: float = 3.0, sync_timeout_s: float = 5.0,
                 batch_queue_url: str | None = None, max_connections: int = MAX_CONNECTIONS):
        self.url = url
        self.batch_queue_url = batch_queue_url
        self.keys = keys
        self.command_timeout_s = command_timeout_s
        self._connect_timeout_s = connect_timeout_s
        self._sync_timeout_s = sync_timeout_s
        self.cluster = cluster_enabled(url, connect_timeout_s)
        # a command finding every connection busy waits for one, as long as a command may take
        self.redis: AsyncClient = connect_async(url, cluster=self.cluster,
                                                max_connections=max_connections,
                                                pool_timeout_s=command_timeout_s,
                                                socket_connect_timeout=connect_timeout_s,
                                                socket_timeout=command_timeout_s)
        self._sync: SyncClient | None = None
        self._sync_lock = threading.Lock()

    @classmethod
    def from_settings(cls, settings: CommonSettings) -> RedisContext:
        if not settings.redis_url:
            raise ValueError("the gateway needs --redis-url (or KVFLEET_REDIS_URL)")
        return cls(settings.redis_url, settings.keys(),
                   batch_queue_url=getattr(settings, "batch_redis_url", None),
                   max_connections=getattr(settings, "redis_max_connections", MAX_CONNECTIONS))

    def sync(self) -> SyncClient:
        """The blocking client (thread-safe: redis-py pools its connections)."""
        with self._sync_lock:
            if self._sync is None:
                self._sync = connect(self.url, cluster=self.cluster,
                                     socket_connect_timeout=self._connect_timeout_s,
                                     socket_timeout=self._sync_timeout_s)
            return self._sync

    def batch_queue(self) -> redis.Redis:
        """A blocking client for rq's job queue: rq needs a single Redis, so on a cluster the
        fleet must name one (`--batch-redis-url`)."""
        if self.batch_queue_url is None and self.cluster:
            raise redis.RedisError("the batch API on a Redis Cluster needs --batch-redis-url (a "
                                   "single Redis for rq's job queue)")
        return redis.Redis.from_url(self.batch_queue_url or self.url,
                                    socket_connect_timeout=self._connect_timeout_s,
                                    socket_timeout=self._sync_timeout_s)

    async def aclose(self) -> None:
        await self.redis.aclose()
        with self._sync_lock:
            if self._sync is not None:
                self._sync.close()
                self._sync = None
