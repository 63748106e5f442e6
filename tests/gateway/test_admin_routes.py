"""The gateway's admin routes against a real Redis and a real Redis Cluster: a drain sets the
worker's drain key with a TTL and answers from its heartbeat, an unknown worker is a 404 with
nothing set, the listing shows each live worker's role, drain state and handoffs, the admin key
(or, without one, the API keys) guards both routes, and Redis down is a 503."""

from __future__ import annotations

import time
from contextlib import AsyncExitStack

import httpx
import pytest

from kvfleet.gateway.admin import DRAIN_REQUEST_TTL_S
from kvfleet.gateway.app import create_app
from kvfleet.gateway.fleet.redis_context import RedisContext
from kvfleet.shared.redis_server import free_port
from kvfleet.shared.settings import GatewaySettings
from kvfleet.shared.wire import Heartbeat, Keys
from tests.gateway.helpers import MODEL

PREFIX = "kvadmin:"
KEYS = Keys(PREFIX)
pytestmark = pytest.mark.topologies


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture
async def gateways(engine, tokenizer, model_info):
    """make(redis_url, **settings) -> an httpx client on a gateway app with a Redis context of
    its own on `redis_url` (the admin routes need no lifespan)."""
    async with AsyncExitStack() as stack:
        async def make(redis_url: str, **overrides) -> httpx.AsyncClient:
            settings = GatewaySettings(redis_url=redis_url, model=MODEL, key_prefix=PREFIX,
                                       **overrides)
            context = RedisContext(redis_url, KEYS, connect_timeout_s=1, command_timeout_s=2)
            stack.push_async_callback(context.aclose)
            app = create_app(settings, engine, tokenizer, model_info=model_info, redis=context)
            return await stack.enter_async_context(httpx.AsyncClient(
                transport=httpx.ASGITransport(app=app), base_url="http://gw"))
        yield make


def beat(client, worker_id: str, **fields) -> Heartbeat:
    heartbeat = Heartbeat(**{"model": MODEL, "ts": time.time(), **fields})
    client.hset(KEYS.worker(worker_id), mapping=heartbeat.encode())
    client.expire(KEYS.worker(worker_id), 30)
    return heartbeat


async def test_a_drain_sets_the_workers_key_with_a_ttl(gateways, redis_url, redis_client):
    http = await gateways(redis_url)
    beat(redis_client, "w-a", running=3)
    beat(redis_client, "w-b", running=1)
    response = await http.post("/admin/workers/w-a/drain")
    assert response.status_code == 202, response.text
    assert response.json() == {"worker_id": "w-a", "draining": True, "model": MODEL,
                               "running": 3}
    assert float(redis_client.get(KEYS.drain("w-a"))) == pytest.approx(time.time(), abs=30)
    assert 0 < redis_client.ttl(KEYS.drain("w-a")) <= DRAIN_REQUEST_TTL_S
    assert not redis_client.exists(KEYS.drain("w-b"))


async def test_an_unknown_worker_is_a_404_and_nothing_is_asked(gateways, redis_url,
                                                               redis_client):
    http = await gateways(redis_url)
    beat(redis_client, "w-a")
    response = await http.post("/admin/workers/w-gone/drain")
    assert response.status_code == 404, response.text
    error = response.json()["error"]
    assert (error["type"], error["code"], error["param"]) == \
        ("not_found_error", "worker_not_found", "worker_id")
    assert "w-gone" in error["message"]
    assert not redis_client.exists(KEYS.drain("w-gone"))


async def test_the_listing_shows_roles_drains_and_handoffs(gateways, redis_url, redis_client):
    http = await gateways(redis_url)
    assert (await http.get("/admin/workers")).json() == {"object": "list", "data": []}
    beat(redis_client, "w-prefill", role="prefill", running=2, waiting=1, blocks_free=70,
         blocks_total=100, handoffs_out=5, handoff_addr="10.0.0.2:8101")
    beat(redis_client, "w-decode", role="decode", draining=1, running=4, blocks_free=10,
         blocks_total=100, handoffs_in=5, handoff_addr="10.0.0.3:8101")
    beat(redis_client, "w-old", blocks_free=1, blocks_total=2)  # older than the new fields
    redis_client.hdel(KEYS.worker("w-old"), "role", "draining", "handoff_addr")
    assert (await http.post("/admin/workers/w-prefill/drain")).status_code == 202
    body = (await http.get("/admin/workers")).json()
    assert body["object"] == "list"
    assert body["data"] == [
        {"id": "w-decode", "model": MODEL, "role": "decode", "draining": True,
         "drain_requested": False, "running": 4, "waiting": 0, "blocks_free": 10,
         "blocks_total": 100, "handoffs_out": 0, "handoffs_in": 5,
         "handoff_addr": "10.0.0.3:8101"},
        {"id": "w-old", "model": MODEL, "role": "both", "draining": False,
         "drain_requested": False, "running": 0, "waiting": 0, "blocks_free": 1,
         "blocks_total": 2, "handoffs_out": 0, "handoffs_in": 0, "handoff_addr": None},
        # asked to drain; it says `draining` from its next heartbeat on
        {"id": "w-prefill", "model": MODEL, "role": "prefill", "draining": False,
         "drain_requested": True, "running": 2, "waiting": 1, "blocks_free": 70,
         "blocks_total": 100, "handoffs_out": 5, "handoffs_in": 0,
         "handoff_addr": "10.0.0.2:8101"}]


async def test_the_admin_key_guards_the_admin_routes(gateways, redis_url, redis_client):
    http = await gateways(redis_url, admin_api_key="kvf-admin", api_keys="sk-user")
    beat(redis_client, "w-a")
    for method, path in (("GET", "/admin/workers"), ("POST", "/admin/workers/w-a/drain")):
        for headers, status, error_type in (
                ({}, 401, "authentication_error"), ({"Authorization": "kvf-admin"}, 401,
                                                     "authentication_error"),
                (bearer("sk-user"), 403, "permission_error"),  # a valid key, but no admin's
                (bearer("kvf-wrong"), 403, "permission_error")):
            response = await http.request(method, path, headers=headers)
            assert response.status_code == status, (path, headers, response.text)
            assert response.json()["error"]["type"] == error_type
        assert not redis_client.exists(KEYS.drain("w-a"))
    assert (await http.get("/admin/workers", headers=bearer("kvf-admin"))).status_code == 200
    response = await http.post("/admin/workers/w-a/drain", headers=bearer("kvf-admin"))
    assert response.status_code == 202 and redis_client.exists(KEYS.drain("w-a"))
    # the admin key is no API key
    response = await http.get("/v1/models", headers=bearer("kvf-admin"))
    assert response.status_code == 401


async def test_without_an_admin_key_the_api_keys_guard_them(gateways, redis_url, redis_client):
    beat(redis_client, "w-a")
    keyed = await gateways(redis_url, api_keys="sk-user")
    for headers in ({}, bearer("sk-wrong")):
        response = await keyed.get("/admin/workers", headers=headers)
        assert response.status_code == 401, response.text
        assert response.json()["error"]["code"] == "invalid_api_key"
    assert (await keyed.get("/admin/workers", headers=bearer("sk-user"))).status_code == 200
    open_gateway = await gateways(redis_url)  # no key at all: open, as /v1/* is
    assert (await open_gateway.post("/admin/workers/w-a/drain")).status_code == 202


async def test_redis_down_is_a_503(gateways):
    url = f"redis://127.0.0.1:{free_port()}/0"
    for http, headers, code in (
            (await gateways(url), {}, None),  # the API keys' check already needs Redis
            (await gateways(url, admin_api_key="kvf-admin"), bearer("kvf-admin"),
             "redis_unavailable")):
        for response in (await http.get("/admin/workers", headers=headers),
                         await http.post("/admin/workers/w-a/drain", headers=headers)):
            assert response.status_code == 503, response.text
            error = response.json()["error"]
            assert (error["type"], error["code"]) == ("service_unavailable", code)
