"""The operator's routes: `GET /admin/workers` (the live workers, as their heartbeats say) and
`POST /admin/workers/{worker_id}/drain` (ask one worker to drain: it stops taking work, hands its
running streams with their KV to peers, finishes the rest and exits; `kvfleet drain` does the
same). With `--admin-api-key` they need that key; without, the API keys as on `/v1/*`."""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Header
from redis.asyncio import Redis

from kvfleet.gateway.admission.auth import ApiKeyStore, invalid_api_key
from kvfleet.gateway.fleet.load import read_heartbeats
from kvfleet.gateway.fleet.redis_context import RedisContext
from kvfleet.gateway.http.errors import APIError
from kvfleet.shared.redis_connect import REDIS_FAILURES
from kvfleet.shared.settings import GatewaySettings
from kvfleet.shared.wire import Heartbeat, Keys

log = logging.getLogger(__name__)

# A worker sees the request within a heartbeat; the key expires so that a worker started later
# under the same id (`kvfleet up` reuses a slot's id) is not drained by an old request.
DRAIN_REQUEST_TTL_S = 300


async def request_drain(client: Redis, keys: Keys, worker_id: str) -> Heartbeat | None:
    """Ask `worker_id` to drain (`Keys.drain`, with a TTL; its value: when it was asked); the
    worker's heartbeat, or None and nothing asked when it has none."""
    raw = await client.hgetall(keys.worker(worker_id))
    if not raw:
        return None
    await client.set(keys.drain(worker_id), f"{time.time():.3f}", ex=DRAIN_REQUEST_TTL_S)
    return Heartbeat.decode(raw)


async def read_workers(client: Redis, keys: Keys) -> list[dict[str, Any]]:
    """Every live worker, sorted by id, with whether a drain was asked of it (it says
    `draining` only from its next heartbeat on)."""
    beats = await read_heartbeats(client, keys)
    pipe = client.pipeline(transaction=False)
    for worker_id in beats:
        pipe.exists(keys.drain(worker_id))
    asked = await pipe.execute() if beats else []
    return [{"id": worker_id, "model": beat.model, "role": beat.role,
             "draining": bool(beat.draining), "drain_requested": bool(requested),
             "running": beat.running, "waiting": beat.waiting,
             "blocks_free": beat.blocks_free, "blocks_total": beat.blocks_total,
             "handoffs_out": beat.handoffs_out, "handoffs_in": beat.handoffs_in,
             "handoff_addr": beat.handoff_addr or None}
            for (worker_id, beat), requested in zip(beats.items(), asked)]


def admin_router(redis: RedisContext | None, settings: GatewaySettings,
                 api_keys: ApiKeyStore) -> APIRouter:
    """The admin routes on the gateway's Redis context (without one, each is a 503)."""

    async def authorize(authorization: Annotated[str | None, Header()] = None) -> None:
        if not settings.admin_api_key:
            await api_keys.authenticate(authorization)
            return
        scheme, _, key = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise invalid_api_key("Missing admin API key: send `Authorization: Bearer <key>`.")
        if not hmac.compare_digest(key.strip().encode(), settings.admin_api_key.encode()):
            raise APIError(403, "This route needs the admin API key (KVFLEET_ADMIN_API_KEY).",
                           code="admin_key_required")

    @asynccontextmanager
    async def fleet_redis() -> AsyncIterator[Redis]:
        """The async client; Redis missing or silent is a 503."""
        if redis is None:
            raise APIError(503, "The admin routes need Redis (--redis-url).",
                           error_type="service_unavailable")
        try:
            async with asyncio.timeout(redis.command_timeout_s):
                yield redis.redis
        except (*REDIS_FAILURES, OSError, TimeoutError) as exc:
            raise APIError(503, f"Redis does not answer: {exc!r}",
                           error_type="service_unavailable", code="redis_unavailable") from exc

    router = APIRouter(prefix="/admin", dependencies=[Depends(authorize)])

    @router.get("/workers")
    async def list_workers() -> dict[str, Any]:
        async with fleet_redis() as client:
            workers = await read_workers(client, redis.keys)
        return {"object": "list", "data": workers}

    @router.post("/workers/{worker_id}/drain", status_code=202)
    async def drain_worker(worker_id: str) -> dict[str, Any]:
        async with fleet_redis() as client:
            beat = await request_drain(client, redis.keys, worker_id)
        if beat is None:
            raise APIError(404, f"No live worker `{worker_id}`: it has no heartbeat.",
                           param="worker_id", code="worker_not_found")
        log.info("drain of worker %s (%s, %d running) requested", worker_id, beat.model,
                 beat.running)
        return {"worker_id": worker_id, "draining": True, "model": beat.model,
                "running": beat.running}

    return router
