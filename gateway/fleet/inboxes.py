"""The channels this gateway's token events come back on (GenerationRequest.reply_to, Keys.inbox).

A worker's step sends each inbox one message with the events of all its requests for it, so the
gateway receives one message per (worker, step) instead of one per request, and subscribes once
per inbox instead of once per request. On a single Redis the gateway has one inbox. On a Redis
Cluster it has one per primary its requests live on, each in a slot of that primary: a request
names the inbox on the primary that holds its own keys (by the gateway's slot map), so the step
script that checkpoints its tokens there publishes to that inbox on the same node. A stale slot
map costs nothing but speed: a node that does not serve an inbox hands the message back and the
worker publishes it through the cluster client."""

from __future__ import annotations

from redis.crc import key_slot
from redis.exceptions import RedisClusterException, RedisError

from kvfleet.shared.wire import Keys

# Parts tried to find an inbox slot on a given primary: each lands there with probability about
# 1/primaries, so with up to 64 primaries 4,096 tries fail together about once in e^64.
MAX_PARTS = 4096


class Inboxes:
    """Picks a request's reply channel; `redis` is the gateway's client (a cluster client when
    `cluster`)."""

    def __init__(self, redis, keys: Keys, gateway_id: str, *, cluster: bool):
        self.keys = keys
        self.gateway_id = gateway_id
        self._redis = redis
        self._cluster = cluster
        self._by_node: dict[str, str] = {}  # primary's name -> this gateway's inbox there

    def for_request(self, req_id: str) -> str:
        """The inbox on the primary that holds the request's keys (the only one on a single
        Redis)."""
        if not self._cluster:
            return self.keys.inbox(self.gateway_id)
        node = self._node_of(self.keys.request(req_id))
        if node is None:  # no slot map right now: any inbox works, the worker forwards
            return self.keys.inbox(self.gateway_id)
        inbox = self._by_node.get(node)
        if inbox is None or self._node_of(inbox) != node:  # new node, or the slot moved
            inbox = self._by_node[node] = self._find(node)
        return inbox

    def _find(self, node: str) -> str:
        for part in range(MAX_PARTS):
            inbox = self.keys.inbox(self.gateway_id, part)
            if self._node_of(inbox) == node:
                return inbox
        return self.keys.inbox(self.gateway_id)

    def _node_of(self, key: str) -> str | None:
        try:
            return self._redis.nodes_manager.get_node_from_slot(key_slot(key.encode())).name
        except (RedisClusterException, RedisError, IndexError, KeyError):
            return None
