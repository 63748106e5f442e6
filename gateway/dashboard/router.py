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

from kvfleet.gateway.dashboard.metrics import GatewayMetrics
from kvfleet.gateway.dashboard.page import render_page
from kvfleet.gateway.fleet.load import read_heartbeats, stream_depth
from kvfleet.gateway.fleet.redis_context import RedisContext
from kvfleet.gateway.http.errors import error_body
from kvfleet.shared.wire import PRIORITIES, Heartbeat, Keys
from kvfleet.shared.wire.records import text


def worker_row(worker_id: str, beat: Heartbeat, now: float) -> dict[str, Any]:
    """One dashboard row from a heartbeat."""
    total = beat.blocks_total
    queried = beat.prefix_queried_tokens
    return {
        "id": worker_id,
        "model": beat.model,
        "role": beat.role,
        "draining": bool(beat.draining),
        # its numerics fingerprint: workers with the same one continue each other's streams bit
        # for bit (null: a worker older than the field)
        "numerics": beat.numerics or None,
        "kv_blocks_used": beat.blocks_used,
        "kv_blocks_total": total,
        "kv_usage_pct": round(100.0 * beat.blocks_used / total, 1) if total else 0.0,
        "running": beat.running,
        "waiting": beat.waiting,
        "tokens_per_s": round(beat.tokens_per_s, 2),
        "prefix_hit_rate": (round(beat.prefix_hit_tokens / queried, 4) if queried else None),
        # speculative decoding: accepted / proposed tokens since start (null: none proposed)
        "spec_acceptance_rate": (round(beat.spec_accepted_tokens / beat.spec_draft_tokens, 4)
                                 if beat.spec_draft_tokens else None),
        "preemptions": beat.preemptions,
        "heartbeat_age_s": round(max(now - beat.ts, 0.0), 2) if beat.ts else None,
        "metrics_url": beat.metrics_url or None,
        "own_queue": beat.own_queue,
        # streams handed to peers / taken from peers with their KV, since the worker started
        "handoffs_out": beat.handoffs_out,
        "handoffs_in": beat.handoffs_in,
        **pace_fields(beat),
        "prefix_queried_tokens": queried,
        "prefix_hit_tokens": beat.prefix_hit_tokens,
        "spec_draft_tokens": beat.spec_draft_tokens,
        "spec_accepted_tokens": beat.spec_accepted_tokens,
    }


def pace_fields(beat: Heartbeat) -> dict[str, Any]:
    """The pace the worker promises (ms, p99; null: none) beside the one it keeps (its measured
    p99 over the recent window; null: no sample yet), and the streams it still takes at that
    pace (null: it promises none)."""
    def ms(value: float) -> float | None:
        return round(value, 1) if value > 0 else None

    return {"target_itl_ms": ms(beat.target_itl_ms), "itl_p99_ms": ms(beat.itl_p99_ms),
            "target_ttft_ms": ms(beat.target_ttft_ms), "ttft_p99_ms": ms(beat.ttft_p99_ms),
            "pace_room": beat.pace_room if beat.pace_room >= 0 else None}


def add_routing(workers: list[dict[str, Any]], router, model: str) -> None:
    """Each row's blocks in this gateway's prefix index and the requests it routed there (null
    for both without affinity routing)."""
    index = router.indexes.get(model) if router is not None else None
    for row in workers:
        held = index.sets.get(row["id"]) if index is not None else None
        row["indexed_blocks"] = None if index is None else len(held or ())
        row["routed"] = None if router is None else router.stats.by_worker.get(row["id"], 0)


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
    own = {"depth": 0, "pending": 0}  # the workers' own streams (prefix-affinity routing)
    owners = sorted(text(w) for w in await client.smembers(keys.worker_queue_owners(model)))
    for stream in [q for w in owners for q in keys.worker_queues(model, w)]:
        depth, pending = await stream_depth(client, stream, keys.group)
        own["depth"] += depth
        own["pending"] += pending
    return {"depth": sum(p["depth"] for p in by_priority.values()) + own["depth"],
            "pending": sum(p["pending"] for p in by_priority.values()) + own["pending"],
            "by_priority": by_priority, "own_streams": own}


def fleet_totals(workers: list[dict[str, Any]], model: str) -> dict[str, Any]:
    """Sums over the workers serving `model` (others may share the Redis)."""
    mine = [w for w in workers if w["model"] == model]
    used = sum(w["kv_blocks_used"] for w in mine)
    total = sum(w["kv_blocks_total"] for w in mine)
    queried = sum(w["prefix_queried_tokens"] for w in mine)
    return {"workers": len(mine),
            "tokens_per_s": round(sum(w["tokens_per_s"] for w in mine), 2),
            "running": sum(w["running"] for w in mine),
            "waiting": sum(w["waiting"] for w in mine),
            "kv_usage_pct": round(100.0 * used / total, 1) if total else 0.0,
            # the fleet-wide cached share of prompt tokens, since the workers started
            "prefix_hit_rate": (round(sum(w["prefix_hit_tokens"] for w in mine) / queried, 4)
                                if queried else None)}


def routing_summary(router) -> dict[str, Any]:
    """This gateway's routing mode and what its router decided since it started."""
    if router is None:
        return {"mode": "shared", "affinity": None, "least_loaded": None, "random": None,
                "shared": None}
    random_policy = router.policy == "random"
    return {"mode": router.policy,
            "affinity": None if random_policy else router.stats.routed.get("affinity", 0),
            "least_loaded": None if random_policy else router.stats.routed.get("least_loaded", 0),
            "random": router.stats.routed.get("random", 0) if random_policy else None,
            "shared": router.stats.routed.get("shared", 0)}


async def dashboard_data(client: Redis, keys: Keys, model: str, metrics: GatewayMetrics,
                         router=None) -> dict[str, Any]:
    """Everything the page shows, read in one go (`router`: the gateway's prefix-affinity
    router, None with `--routing shared`)."""
    now = time.time()
    workers = await read_workers(client, keys, now)
    add_routing(workers, router, model)
    queue = await read_queue(client, keys, model)
    p50, p99 = metrics.ttft_quantiles()
    return {"model": model, "workers": workers, "queue": queue,
            "totals": fleet_totals(workers, model), "routing": routing_summary(router),
            "ttft_p50_s": p50, "ttft_p99_s": p99,
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
                     cache_s: float = 0.5, prefix_router=None) -> APIRouter:
    """The page and its data, read through the gateway's Redis context (`prefix_router`: the
    gateway's prefix-affinity router, if any)."""
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
                dashboard_data(redis.redis, redis.keys, model, metrics, prefix_router),
                redis.command_timeout_s)
        except (RedisError, OSError, TimeoutError) as exc:
            message = f"Redis unreachable: {type(exc).__name__}: {exc}".rstrip(": ")
            return JSONResponse(error_body(message, "service_unavailable",
                                           code="redis_unavailable"),
                                status_code=503, headers={"Cache-Control": "no-cache"})
        cache.put(body)
        return JSONResponse(body, headers={"Cache-Control": "no-cache"})

    return router
