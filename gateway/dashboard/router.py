"""The fleet dashboard: `GET /dashboard` (a self-contained HTML page) and `GET /dashboard/data`
(JSON read live from Redis: worker heartbeats, queue depth per priority, gateway TTFT)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter
from fastapi.responses import HTMLResponse, JSONResponse
from redis.asyncio import Redis
from redis.exceptions import RedisError, ResponseError

from gateway.dashboard.metrics import GatewayMetrics
from gateway.dashboard.page import render_page
from gateway.errors import error_body
from shared.keys import PRIORITIES, Keys

UNDELIVERED_SCAN_CAP = 100_000  # entries counted one by one when Redis cannot report the lag


def _s(value: bytes | str | None) -> str:
    if value is None:
        return ""
    return value.decode() if isinstance(value, bytes) else value


def _num(fields: dict[str, str], name: str) -> float:
    try:
        return float(fields.get(name, 0) or 0)
    except ValueError:
        return 0.0


def worker_row(worker_id: str, raw: dict, now: float) -> dict[str, Any]:
    """One dashboard row from a heartbeat hash (values are stored as strings)."""
    fields = {_s(k): _s(v) for k, v in raw.items()}
    total = int(_num(fields, "blocks_total"))
    used = max(total - int(_num(fields, "blocks_free")), 0)
    queried = _num(fields, "prefix_queried_tokens")
    ts = _num(fields, "ts")
    return {
        "id": worker_id,
        "model": fields.get("model", ""),
        "kv_blocks_used": used,
        "kv_blocks_total": total,
        "kv_usage_pct": round(100.0 * used / total, 1) if total else 0.0,
        "running": int(_num(fields, "running")),
        "waiting": int(_num(fields, "waiting")),
        "tokens_per_s": round(_num(fields, "tokens_per_s"), 2),
        "prefix_hit_rate": (round(_num(fields, "prefix_hit_tokens") / queried, 4)
                            if queried else None),
        "preemptions": int(_num(fields, "preemptions")),
        "heartbeat_age_s": round(max(now - ts, 0.0), 2) if ts else None,
        "metrics_url": fields.get("metrics_url") or None,
    }


async def read_workers(client: Redis, keys: Keys, now: float) -> list[dict[str, Any]]:
    """Every live heartbeat (expired ones are gone from Redis by their TTL), sorted by id."""
    names = sorted({_s(k) async for k in client.scan_iter(match=keys.worker_pattern(), count=1000)})
    if not names:
        return []
    pipe = client.pipeline(transaction=False)
    for name in names:
        pipe.hgetall(name)
    hashes = await pipe.execute()
    prefix = keys.worker("")
    # A heartbeat may expire between SCAN and HGETALL: an empty hash is no worker.
    return [worker_row(name.removeprefix(prefix), raw, now)
            for name, raw in zip(names, hashes) if raw]


async def stream_depth(client: Redis, stream: str, group_name: str) -> tuple[int, int]:
    """(undelivered, pending) entries of one request stream; a missing stream or group reads 0
    pending and, for a stream with no group yet, every entry as undelivered."""
    try:
        groups = await client.xinfo_groups(stream)
    except ResponseError:  # no such key: nobody enqueued yet
        return 0, 0
    group = next((g for g in groups if _s(g["name"]) == group_name), None)
    if group is None:
        return int(await client.xlen(stream)), 0
    pending = int(group.get("pending") or 0)
    lag = group.get("lag")
    if lag is not None:
        return int(lag), pending
    # Redis cannot tell the lag (entries deleted or trimmed): count past last-delivered-id.
    last = _s(group.get("last-delivered-id")) or "0-0"
    start = f"({last}" if last != "0-0" else "-"
    entries = await client.xrange(stream, min=start, count=UNDELIVERED_SCAN_CAP)
    return len(entries), pending


async def read_queue(client: Redis, keys: Keys, model: str) -> dict[str, Any]:
    by_priority = {}
    for priority in PRIORITIES:
        stream = keys.queue(model, priority)
        depth, pending = await stream_depth(client, stream, keys.group)
        by_priority[priority] = {"stream": stream, "depth": depth, "pending": pending}
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


def dashboard_router(redis_client_getter: Callable[[], Redis], keys: Keys, model: str,
                     metrics: GatewayMetrics, *, redis_timeout_s: float = 3.0,
                     cache_s: float = 0.5) -> APIRouter:
    """The page and its data. `redis_client_getter` returns the gateway's own `redis.asyncio`
    client when called (it may connect lazily in the app's lifespan)."""
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
                dashboard_data(redis_client_getter(), keys, model, metrics), redis_timeout_s)
        except (RedisError, OSError, TimeoutError) as exc:
            message = f"Redis unreachable: {type(exc).__name__}: {exc}".rstrip(": ")
            return JSONResponse(error_body(message, "service_unavailable",
                                           code="redis_unavailable"),
                                status_code=503, headers={"Cache-Control": "no-cache"})
        cache.put(body)
        return JSONResponse(body, headers={"Cache-Control": "no-cache"})

    return router
