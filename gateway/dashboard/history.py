"""The dashboard's recent past: one sample of the fleet every `sample_s` seconds, kept for
`history_s` (15 minutes by default), served as `GET /dashboard/history` for the page's charts.

A sample holds what the gateway already measures: fleet tokens/s and KV usage (the workers'
heartbeats), queue depth (the request streams) and TTFT p50/p99 of the first tokens this gateway
sent since the previous sample (its own clients'; each gateway keeps its own history). A sample
taken while Redis is unreachable keeps its TTFT and leaves the fleet's figures empty (a gap in the
charts), so the time axis never lies.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from redis.exceptions import RedisError

from kvfleet.gateway.dashboard.metrics import GatewayMetrics, quantile
from kvfleet.gateway.dashboard.router import fleet_totals, read_queue, read_workers
from kvfleet.gateway.fleet.redis_context import RedisContext
from kvfleet.gateway.fleet.tasks import cancel_requested, stop_task

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HistoryPoint:
    """One sample; fleet figures are None when Redis could not be read."""

    t: float  # unix time of the sample
    tokens_per_s: float | None  # sum of the model's workers' heartbeat rates
    kv_usage_pct: float | None  # KV blocks used / total over those workers
    queue_depth: int | None  # undelivered requests, all priorities
    workers: int | None
    ttft_p50_s: float | None  # of the first tokens sent since the previous sample; None if none
    ttft_p99_s: float | None
    ttft_count: int


@dataclass(frozen=True)
class FleetSnapshot:
    tokens_per_s: float
    kv_usage_pct: float
    queue_depth: int
    workers: int


class FleetHistory:
    """The last `history_s` seconds of samples, oldest first."""

    def __init__(self, history_s: float = 900.0, sample_s: float = 5.0):
        if sample_s <= 0 or history_s < sample_s:
            raise ValueError("need 0 < sample_s <= history_s")
        self.history_s = history_s
        self.sample_s = sample_s
        self._points: deque[HistoryPoint] = deque(maxlen=math.ceil(history_s / sample_s))

    def add(self, point: HistoryPoint) -> None:
        self._points.append(point)

    def points(self) -> list[HistoryPoint]:
        return list(self._points)

    def as_json(self, now: float) -> dict[str, Any]:
        return {"history_s": self.history_s, "sample_s": self.sample_s, "now": now,
                "points": [asdict(p) for p in self._points]}


def redis_snapshot_reader(redis: RedisContext, model: str
                          ) -> Callable[[], Awaitable[FleetSnapshot]]:
    """Reads the fleet's figures the way `/dashboard/data` does."""

    async def read() -> FleetSnapshot:
        workers = await read_workers(redis.redis, redis.keys, time.time())
        queue = await read_queue(redis.redis, redis.keys, model)
        totals = fleet_totals(workers, model)
        return FleetSnapshot(totals["tokens_per_s"], totals["kv_usage_pct"], queue["depth"],
                             totals["workers"])

    return read


class HistorySampler:
    """Adds one point to `history` every `history.sample_s`, in a task of the gateway's loop."""

    def __init__(self, history: FleetHistory, read_fleet: Callable[[], Awaitable[FleetSnapshot]],
                 metrics: GatewayMetrics, *, redis_timeout_s: float = 3.0):
        self.history = history
        self._read_fleet = read_fleet
        self._metrics = metrics
        self._redis_timeout_s = redis_timeout_s
        self._last_sample = metrics.clock()
        self._task: asyncio.Task | None = None

    async def sample_once(self) -> HistoryPoint:
        """Take one sample now and add it."""
        since, self._last_sample = self._last_sample, self._metrics.clock()
        ttfts = self._metrics.ttft_since(since)
        fleet: FleetSnapshot | None = None
        try:
            fleet = await asyncio.wait_for(self._read_fleet(), self._redis_timeout_s)
        except (RedisError, OSError, TimeoutError) as exc:
            log.debug("dashboard history: fleet not read (%s)", exc)
        point = HistoryPoint(
            t=time.time(),
            tokens_per_s=fleet.tokens_per_s if fleet else None,
            kv_usage_pct=fleet.kv_usage_pct if fleet else None,
            queue_depth=fleet.queue_depth if fleet else None,
            workers=fleet.workers if fleet else None,
            ttft_p50_s=quantile(ttfts, 0.5), ttft_p99_s=quantile(ttfts, 0.99),
            ttft_count=len(ttfts))
        self.history.add(point)
        return point

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.history.sample_s)
            try:
                await self.sample_once()
            except Exception:  # never let one bad sample end the history
                log.exception("dashboard history sample failed")
            if cancel_requested():  # a cancel redis-py swallowed (gateway/fleet/tasks.py)
                raise asyncio.CancelledError

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            await stop_task(self._task)
            self._task = None


def history_router(history: FleetHistory) -> APIRouter:
    """`GET /dashboard/history`: the samples as JSON, oldest first."""
    router = APIRouter()

    @router.get("/dashboard/history")
    async def get_history() -> JSONResponse:
        return JSONResponse(history.as_json(time.time()), headers={"Cache-Control": "no-cache"})

    return router
