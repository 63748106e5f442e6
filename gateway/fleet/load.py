"""How busy the fleet is, read from Redis: the undelivered and pending entries of a request
stream, and the live workers' heartbeats. Backpressure and the dashboard read it the same way."""

from __future__ import annotations

from redis.asyncio import Redis
from redis.exceptions import ResponseError

from kvfleet.shared.wire import Heartbeat, Keys
from kvfleet.shared.wire.records import text

UNDELIVERED_SCAN_CAP = 100_000  # entries counted one by one when Redis cannot report the lag


async def stream_depth(client: Redis, stream: str, group_name: str) -> tuple[int, int]:
    """(undelivered, pending) entries of one request stream; a missing stream or group reads 0
    pending and, for a stream with no group yet, every entry as undelivered."""
    try:
        groups = await client.xinfo_groups(stream)
    except ResponseError:  # no such key: nobody enqueued yet
        return 0, 0
    group = next((g for g in groups if text(g["name"]) == group_name), None)
    if group is None:
        return int(await client.xlen(stream)), 0
    pending = int(group.get("pending") or 0)
    lag = group.get("lag")
    if lag is not None:
        return int(lag), pending
    # Redis cannot tell the lag (entries deleted or trimmed): count past last-delivered-id.
    last = text(group.get("last-delivered-id")) or "0-0"
    start = f"({last}" if last != "0-0" else "-"
    entries = await client.xrange(stream, min=start, count=UNDELIVERED_SCAN_CAP)
    return len(entries), pending


async def queue_undelivered(client: Redis, keys: Keys, model: str) -> int:
    """Entries of `model`'s request streams no worker took yet: the shared streams of every
    shard and priority, and the workers' own streams (prefix-affinity routing)."""
    owners = await client.smembers(keys.worker_queue_owners(model))
    own = [q for w in sorted(text(o) for o in owners) for q in keys.worker_queues(model, w)]
    undelivered = 0
    for stream in keys.all_queues(model) + own:
        depth, _pending = await stream_depth(client, stream, keys.group)
        undelivered += depth
    return undelivered


def takes_new_requests(beat: Heartbeat) -> bool:
    """Whether the worker reads new requests: not while it drains, never with role `decode` (it
    takes only streams handed over with their KV, and orphans)."""
    return not beat.draining and beat.role != "decode"


async def read_heartbeats(client: Redis, keys: Keys) -> dict[str, Heartbeat]:
    """Every live worker's heartbeat by worker id, sorted by id (expired heartbeats are gone from
    Redis by their TTL)."""
    names = sorted({text(k) async for k in client.scan_iter(match=keys.worker_pattern(),
                                                              count=1000)})
    if not names:
        return {}
    pipe = client.pipeline(transaction=False)
    for name in names:
        pipe.hgetall(name)
    hashes = await pipe.execute()
    # A heartbeat may expire between SCAN and HGETALL: an empty hash is no worker.
    return {keys.worker_id(name): Heartbeat.decode(raw) for name, raw in zip(names, hashes) if raw}
