"""One way to open Redis for the whole fleet: a URL naming a single Redis or any node of a Redis
Cluster. `INFO cluster` tells which; on a cluster the client is redis-py's cluster client (sync or
asyncio), which routes each command to the node owning its key's slot. Callers do not branch on
the topology except where the protocol itself differs (`is_cluster`): sharded pub/sub and where a
multi-slot operation must be split.
"""

from __future__ import annotations

import logging
from typing import Any

import redis
import redis.asyncio
from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster
from redis.cluster import RedisCluster
from redis.exceptions import ClusterDownError, RedisClusterException, TryAgainError

log = logging.getLogger(__name__)

SyncClient = redis.Redis | RedisCluster
AsyncClient = redis.asyncio.Redis | AsyncRedisCluster

# What Redis can raise while it is away or failing over, for `except` clauses: redis-py's cluster
# client raises some errors (no node covers a slot yet, no node answers) outside RedisError.
REDIS_FAILURES = (redis.RedisError, RedisClusterException)
# The same, for a worker's loop: worth a backoff and a reconnect, not an exit.
TRANSIENT_FAILURES = (redis.ConnectionError, redis.TimeoutError, ClusterDownError, TryAgainError,
                      RedisClusterException)


def cluster_enabled(url: str, connect_timeout_s: float = 2.0) -> bool:
    """Whether the Redis at `url` runs in cluster mode; False when it cannot be reached (a single
    Redis that is down now: the caller's first command reports it)."""
    probe = redis.Redis.from_url(url, socket_connect_timeout=connect_timeout_s,
                                 socket_timeout=connect_timeout_s)
    try:
        return str(probe.info("cluster").get("cluster_enabled", 0)) == "1"
    except (redis.ConnectionError, redis.TimeoutError) as exc:
        log.warning("could not probe %s for cluster mode (%r): assuming a single Redis",
                    _redact(url), exc)
        return False
    finally:
        probe.close()


def connect(url: str, *, cluster: bool | None = None, **options: Any) -> SyncClient:
    """A blocking client for `url`; `options` are redis-py connection options (timeouts).
    `cluster` skips the probe when the caller already knows."""
    if cluster is None:
        cluster = cluster_enabled(url)
    if cluster:
        return RedisCluster.from_url(_without_db(url), **options)
    return redis.Redis.from_url(url, **options)


def connect_async(url: str, *, cluster: bool | None = None, max_connections: int | None = None,
                  pool_timeout_s: float | None = None, **options: Any) -> AsyncClient:
    """The asyncio client for `url` (the gateway's).

    With `max_connections`, a single Redis's pool holds at most that many connections and a
    command that finds them all busy waits up to `pool_timeout_s` for one to come back (redis-py's
    default pool holds 100 and fails the command at once: hundreds of requests cancelled in the
    same instant then got 503s). A cluster client's pools are per node and have no waiting form:
    there `max_connections` is each node's bound."""
    if cluster is None:
        cluster = cluster_enabled(url)
    if cluster:
        if max_connections is not None:
            options["max_connections"] = max_connections
        return AsyncRedisCluster.from_url(_without_db(url), **options)
    if max_connections is None:
        return redis.asyncio.Redis.from_url(url, **options)
    pool = redis.asyncio.BlockingConnectionPool.from_url(
        url, max_connections=max_connections, timeout=pool_timeout_s, **options)
    return redis.asyncio.Redis(connection_pool=pool)


def is_cluster(client: Any) -> bool:
    """Whether `client` (sync or asyncio, or one of their pipelines) talks to a cluster."""
    from redis.asyncio.cluster import ClusterPipeline as AsyncClusterPipeline
    from redis.cluster import ClusterPipeline
    return isinstance(client, (RedisCluster, AsyncRedisCluster, ClusterPipeline,
                               AsyncClusterPipeline))


def _without_db(url: str) -> str:
    """A cluster has database 0 only; redis-py's cluster client refuses a `/0` path."""
    head, sep, tail = url.rpartition("/")
    if sep and tail.isdigit() and head.count("/") >= 2:
        return head
    return url


def _redact(url: str) -> str:
    if "@" not in url:
        return url
    scheme, _, rest = url.partition("://")
    return f"{scheme}://***@{rest.rpartition('@')[2]}"
