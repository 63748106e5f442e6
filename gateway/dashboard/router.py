"""The fleet dashboard: `GET /dashboard` (a self-contained HTML page) and `GET /dashboard/data`
(JSON read live from Redis: worker heartbeats, queue depth per priority, gateway TTFT)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from fastapi import APIRouter
from fastapi.responses import HTMLResponse, JSONResponse
from redis.asyncio import Redis
from redis.exceptions import RedisError

from gateway.dashboard.metrics import GatewayMetrics
from gateway.dashboard.page import render_page
from gateway.errors import error_body
from gateway.fleet.load import read_heartbeats, stream_depth
from gateway.fleet.redis_context import RedisContext
from shared.wire import PRIORITIES, Heartbeat, Keys


def worker_row(worker_id: str, beat: Heartbeat, now: float) -> dict[str, Any]:
    """One dashboard row from a heartbeat."""
    total = beat.blocks_total
    queried = beat.prefix_queried_tokens
    return {
        "id": worker_id,
        "model": beat.model,
        "kv_blocks_used": beat.blocks_used,
        "kv_blocks_total": total,
        "kv_usage_pct": round(100.0 * beat.blocks_used / total, 1) if total else 0.0,
        "running": beat.running,
        "waiting": beat.waiting,
        "tokens_per_s": round(beat.tokens_per_s, 2),
        "prefix_hit_rate": (round(beat.prefix_hit_tokens / queried, 4) if queried else None),
        "preemptions": beat.preemptions,
        "heartbeat_age_s": round(max(now - beat.ts, 0.0), 2) if beat.ts else None,
        "metrics_url": beat.metrics_url or None,
    }


async def read_workers(client: Redis, keys: Keys, now: float) -> list[dict[str, Any]]:
    """Every live worker's row, sorted by id."""
    return [worker_row(worker_id, beat, now)
            for worker_id, beat in (await read_heartbeats(client, keys)).items()]


async def read_queue(client: Redis, keys: Keys, model: str) -> dict[str, Any]:
    """Depth and pending entries by priority, summed over the stream shards (`stream` names the
    first shard's stream)."""
    by_priority = {}
    for shard in range(keys.queue_shards):
        for priority, stream in zip(PRIORITIES, keys.queues(model, shard)):
            depth, pending = await stream_depth(client, stream, keys.group)
            row = by_priority.setdefault(priority, {"stream": stream, "depth": 0, "pending": 0})
            row["depth"] += depth
            row["pending"] += pending
    return {"depth": sum(p["depth"] for p in by_priority.values()),
            "pending": sum(p["pending"] for p in by_priority.values()),
            "by_priority": by_priority}


def fleet_totals(workers: list[dict[str, Any]], model: str) -> dict[str, Any]:
    """Sums over the workers serving `model` (others may share the Redis)."""
    mine = [w for w in workers if w["model"] == model]
    used = sum(w["kv_blocks_used"] for w in mine)
    total = sum(w["kv_blocks_total"] for w in mine)
    return {"workers": len(mine),
            "tokens_per_s": round(sum(w["tokens_per_s"] for w in mine), 2),
            "running": sum(w["running"] for w in mine),
            "waiting": sum(w["waiting"] for w in mine),
            "kv_usage_pct": round(100.0 * used / total, 1) if total else 0.0}


async def dashboard_data(client: Redis, keys: Keys, model: str,
                         metrics: GatewayMetrics) -> dict[str, Any]:
    """Everything the page shows, read in one go."""
    now = time.time()
    workers = await read_workers(client, keys, now)
    queue = await read_queue(client, keys, model)
    p50, p99 = metrics.ttft_quantiles()
    return {"model": model, "workers": workers, "queue": queue,
            "totals": fleet_totals(workers, model), "ttft_p50_s": p50, "ttft_p99_s": p99,
            "in_flight": metrics.requests_in_flight(), "updated": now}


class SnapshotCache:
    """The last snapshot, reused for `max_age_s`: many open pages cost Redis one read per period."""

    def __init__(self, max_age_s: float):
        self.max_age_s = max_age_s
        self._body: dict[str, Any] | None = None
        self._at = 0.0

    def get(self) -> dict[str, Any] | None:
        if self._body is not None and time.monotonic() - self._at < self.max_age_s:
            return self._body
        return None

    def put(self, body: dict[str, Any]) -> None:
        self._body, self._at = body, time.monotonic()


def dashboard_router(redis: RedisContext, model: str, metrics: GatewayMetrics, *,
                     cache_s: float = 0.5) -> APIRouter:
    """The page and its data, read through the gateway's Redis context."""
    router = APIRouter()
    page_html = render_page(model)
    cache = SnapshotCache(cache_s)

    @router.get("/dashboard", response_class=HTMLResponse, include_in_schema=False)
    async def page() -> HTMLResponse:
        return HTMLResponse(page_html, headers={"Cache-Control": "no-cache"})

    @router.get("/dashboard/data")
    async def data() -> JSONResponse:
        body = cache.get()
        if body is not None:
            return JSONResponse(body, headers={"Cache-Control": "no-cache"})
        try:
            body = await asyncio.wait_for(
                dashboard_data(redis.redis, redis.keys, model, metrics), redis.command_timeout_s)
        except (RedisError, OSError, TimeoutError) as exc:
            message = f"Redis unreachable: {type(exc).__name__}: {exc}".rstrip(": ")
            return JSONResponse(error_body(message, "service_unavailable",
                                           code="redis_unavailable"),
                                status_code=503, headers={"Cache-Control": "no-cache"})
        cache.put(body)
        return JSONResponse(body, headers={"Cache-Control": "no-cache"})

    return router
