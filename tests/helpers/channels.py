"""A test's view of the fleet's pub/sub on either topology: classic SUBSCRIBE on a single Redis,
sharded SSUBSCRIBE on a cluster (where the worker SPUBLISHes)."""

from __future__ import annotations

import time

from kvfleet.shared.redis_connect import is_cluster


def subscribe(client, *channels: str):
    """A pub/sub of the blocking `client`, subscribed to `channels` (confirmed)."""
    pubsub = client.pubsub(ignore_subscribe_messages=True)
    if is_cluster(client):
        pubsub.ssubscribe(*channels)
    else:
        pubsub.subscribe(*channels)
    return pubsub


def next_message(pubsub, timeout_s: float = 1.0) -> dict | None:
    """The next published message (its `channel` and `data`), None after `timeout_s`."""
    sharded = bool(getattr(pubsub, "shard_channels", None))
    deadline = time.monotonic() + timeout_s
    while True:
        left = max(deadline - time.monotonic(), 0.0)
        message = (pubsub.get_sharded_message(timeout=min(left, 0.05)) if sharded
                   else pubsub.get_message(timeout=min(left, 0.05)))
        if message is not None and message.get("type") in ("message", "smessage"):
            return message
        if left <= 0:
            return None


def request_id_of(channel: bytes | str) -> str:
    """The request id of a token channel (`prefix` + `tok:{id}`)."""
    name = channel.decode() if isinstance(channel, bytes) else channel
    return name.rsplit(":", 1)[1].strip("{}")


def fleet_keys(client, prefix: str = "kvf:"):
    """The key names a test fleet uses on `client`'s topology: 3 stream shards on a cluster (one
    per primary), 1 on a single Redis."""
    from kvfleet.shared.wire import Keys
    return Keys(prefix, queue_shards=3 if is_cluster(client) else 1)


def cancel(client, keys, req_id: str) -> None:
    """What the gateway does when a client goes away."""
    if is_cluster(client):
        client.spublish(keys.cancel(), req_id)
    else:
        client.publish(keys.cancel(), req_id)
