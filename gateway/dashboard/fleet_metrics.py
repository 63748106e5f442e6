"""The fleet's capacity at the promised pace as Prometheus gauges (`kvfleet_fleet_*`, label
`model`), read from Redis each time `/metrics` is scraped: what an autoscaler (KEDA, docs/DEPLOY.md)
scales the workers on.

They are the fleet's figures, not this gateway's: every gateway reads the same heartbeats and
streams and exports the same values, so a query takes `max` over the gateways, never `sum`. When
Redis cannot be read the series are left out of the scrape (an autoscaler then keeps its replicas)
rather than exported stale.
"""

from __future__ import annotations

import asyncio
import logging

from prometheus_client import CollectorRegistry, Gauge
from redis.exceptions import RedisError

from kvfleet.gateway.fleet.load import queue_undelivered, read_heartbeats
from kvfleet.gateway.fleet.pace import fleet_pace
from kvfleet.gateway.fleet.redis_context import RedisContext

log = logging.getLogger(__name__)


class FleetGauges:
    """`kvfleet_fleet_workers_needed` and `kvfleet_fleet_pace_room` of the default model and of
    every model a live worker serves."""

    def __init__(self, registry: CollectorRegistry, redis: RedisContext, default_model: str):
        self._redis = redis
        self._default_model = default_model
        self.workers_needed = Gauge(
            "kvfleet_fleet_workers_needed", "Workers the model's streams and queue need at the "
            "promised pace: ceil((streams the live workers hold + requests queued undelivered) "
            "/ mean pace_streams of the workers promising a pace, else of their max_running); "
            "at least 1 while anything is queued or running, 0 for none.", ["model"],
            registry=registry)
        self.pace_room = Gauge(
            "kvfleet_fleet_pace_room", "More streams the live workers taking new requests start "
            "now and keep their promised pace (summed heartbeat pace_room; 0 when none promises "
            "a pace).", ["model"], registry=registry)

    async def refresh(self) -> None:
        """Read the fleet and replace every series (a model whose workers left drops out)."""
        try:
            values = await asyncio.wait_for(self._read(), self._redis.command_timeout_s * 2)
        except (RedisError, OSError, TimeoutError) as exc:
            log.debug("fleet gauges not read: %r", exc)
            values = {}
        self.workers_needed.clear()
        self.pace_room.clear()
        for model, (needed, room) in values.items():
            self.workers_needed.labels(model=model).set(needed)
            self.pace_room.labels(model=model).set(room)

    async def _read(self) -> dict[str, tuple[int, int]]:
        """(workers needed, room at pace) per model."""
        client, keys = self._redis.redis, self._redis.keys
        beats = list((await read_heartbeats(client, keys)).values())
        models = sorted({self._default_model} | {beat.model for beat in beats if beat.model})
        values = {}
        for model in models:
            pace = fleet_pace(beats, model)
            undelivered = await queue_undelivered(client, keys, model)
            values[model] = (pace.workers_needed(undelivered), pace.room)
        return values
