"""API keys and per-key rate limits: keys from settings and from Redis (`kvfleet keys`), 401s in
OpenAI's shape, GCRA limits shared by two gateway replicas on one Redis."""

from __future__ import annotations

import argparse
from contextlib import AsyncExitStack

import httpx
import pytest

from kvfleet.gateway.app import create_app
from kvfleet import keys_cli
from kvfleet.shared.redis_connect import connect
from kvfleet.shared.settings import GatewaySettings
from kvfleet.shared.wire import Keys
from tests.gateway.fake_worker import FakeWorker
from tests.gateway.fakes import token_events
from tests.gateway.helpers import MODEL

PREFIX = "kvauth:"
pytestmark = pytest.mark.topologies
KEYS = Keys(PREFIX)
BODY = {"model": MODEL, "prompt": "Hi", "max_tokens": 4}


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def cli(redis_url: str, capsys, *argv: str) -> tuple[int, str]:
    parser = argparse.ArgumentParser()
    keys_cli.add_arguments(parser)
    code = keys_cli.run(parser.parse_args(["--redis-url", redis_url, "--key-prefix", PREFIX,
                                           *argv]))
    return code, capsys.readouterr().out


# ---- keys from settings, with the fake engine ---------------------------------------------------

@pytest.fixture
def settings() -> GatewaySettings:  # overrides conftest's: two plaintext keys configured
    return GatewaySettings(redis_url="redis://127.0.0.1:1/0", model=MODEL, max_body_bytes=50_000,
                           default_max_tokens=64, request_timeout_s=30, first_event_timeout_s=5,
                           api_keys="sk-one, sk-two")


@pytest.mark.parametrize("headers", [{}, bearer("sk-wrong"), {"Authorization": "sk-one"},
                                     {"Authorization": "Basic c2stb25l"}, bearer("")])
async def test_v1_routes_need_a_valid_key(http, say, headers):
    say("hello")
    for response in [await http.post("/v1/completions", json=BODY, headers=headers),
                     await http.get("/v1/models", headers=headers),
                     await http.get("/v1/requests/x/stream", headers=headers),
                     await http.get("/v1/unknown", headers=headers)]:
        assert response.status_code == 401, response.text
        assert response.json()["error"]["code"] == "invalid_api_key"
        assert response.json()["error"]["type"] == "authentication_error"


async def test_open_routes_and_valid_keys(http, say):
    say("hello")
    for path in ("/health", "/metrics"):
        assert (await http.get(path)).status_code == 200
    for key in ("sk-one", "sk-two"):
        response = await http.post("/v1/completions", json=BODY, headers=bearer(key))
        assert response.status_code == 200, response.text
    assert (await http.get("/v1/models", headers=bearer("sk-two"))).status_code == 200


# ---- keys in Redis, rate limits, two replicas ---------------------------------------------------

@pytest.fixture
async def replicas(redis_url, tokenizer, model_info):
    """make(**settings) -> an httpx client on a new gateway app (its own Redis clients) sharing
    the test's Redis, served by a fake worker."""
    async with AsyncExitStack() as stack:
        await stack.enter_async_context(FakeWorker(
            redis_url, KEYS, MODEL,
            lambda r: token_events([42, 2], prompt_tokens=len(r.prompt_token_ids))))

        async def make(**overrides) -> httpx.AsyncClient:
            settings = GatewaySettings(redis_url=redis_url, model=MODEL, key_prefix=PREFIX,
                                       request_timeout_s=30, first_event_timeout_s=5, **overrides)
            app = create_app(settings, None, tokenizer, model_info=model_info)
            await stack.enter_async_context(app.router.lifespan_context(app))
            return await stack.enter_async_context(httpx.AsyncClient(
                transport=httpx.ASGITransport(app=app), base_url="http://gw", timeout=10))
        yield make


async def test_no_keys_anywhere_means_open(replicas):
    http = await replicas()
    assert (await http.post("/v1/completions", json=BODY)).status_code == 200


async def test_cli_key_works_until_revoked(replicas, redis_url, capsys):
    code, out = cli(redis_url, capsys, "create", "--name", "alice")
    assert code == 0
    key = out.strip()
    assert key.startswith("kvf-")
    raw = connect(redis_url).hgetall(KEYS.api_keys())
    assert key.encode() not in b"".join(list(raw) + list(raw.values()))  # only its hash is kept
    code, listing = cli(redis_url, capsys, "list")
    [row] = listing.splitlines()[1:]
    key_id = row.split()[0]
    assert "alice" in row
    http = await replicas()
    assert (await http.post("/v1/completions", json=BODY)).status_code == 401
    assert (await http.post("/v1/completions", json=BODY, headers=bearer(key))).status_code == 200
    assert cli(redis_url, capsys, "revoke", key_id)[0] == 0
    cli(redis_url, capsys, "create", "--name", "bob")  # keys still exist: auth stays on
    response = await http.post("/v1/completions", json=BODY, headers=bearer(key))
    assert response.status_code == 401
    assert cli(redis_url, capsys, "revoke", key_id)[0] == 1


async def test_rpm_limit_is_a_429_shared_by_two_replicas(replicas, redis_url, capsys):
    key = cli(redis_url, capsys, "create", "--rpm", "3")[1].strip()
    first, second = await replicas(), await replicas()
    statuses = []
    for http in (first, second, first, second):
        statuses.append((await http.post("/v1/completions", json=BODY,
                                          headers=bearer(key))).status_code)
    assert statuses == [200, 200, 200, 429]
    response = await first.post("/v1/completions", json=BODY, headers=bearer(key))
    assert response.status_code == 429
    assert response.json()["error"]["code"] == "rate_limit_exceeded"
    assert 1 <= int(response.headers["Retry-After"]) <= 20  # one request per 20 s comes back
    other = cli(redis_url, capsys, "create")[1].strip()  # another key has its own budget
    assert (await second.post("/v1/completions", json=BODY,
                              headers=bearer(other))).status_code == 200


async def test_tpm_limit_and_settings_defaults(replicas, redis_url, capsys):
    key = cli(redis_url, capsys, "create")[1].strip()  # no own limits: the settings' apply
    http = await replicas(rate_limit_tpm=100)
    body = dict(BODY, max_tokens=40)  # costs 41 tokens: 1 ("Hi") + max_tokens
    assert (await http.post("/v1/completions", json=body, headers=bearer(key))).status_code == 200
    assert (await http.post("/v1/completions", json=body, headers=bearer(key))).status_code == 200
    response = await http.post("/v1/completions", json=body, headers=bearer(key))
    assert response.status_code == 429, response.text
    too_big = await http.post("/v1/completions", json=dict(BODY, max_tokens=200),
                              headers=bearer(key))
    assert too_big.status_code == 429
    assert too_big.json()["error"]["code"] == "request_too_large"


async def test_env_and_redis_keys_together(replicas, redis_url, capsys):
    key = cli(redis_url, capsys, "create")[1].strip()
    http = await replicas(api_keys="sk-env")
    for k in ("sk-env", key):
        assert (await http.post("/v1/completions", json=BODY, headers=bearer(k))).status_code \
            == 200
    assert (await http.get("/health")).status_code == 200
    assert (await http.get("/dashboard")).status_code == 200


def test_keys_cli_needs_a_redis_url(monkeypatch, capsys):
    monkeypatch.delenv("KVFLEET_REDIS_URL", raising=False)
    parser = argparse.ArgumentParser()
    keys_cli.add_arguments(parser)
    assert keys_cli.run(parser.parse_args(["list"])) == 2
    assert "--redis-url" in capsys.readouterr().err


def test_keys_cli_lists_limits(redis_url, capsys):
    cli(redis_url, capsys, "create", "--name", "batch-team", "--rpm", "0", "--tpm", "5000")
    _code, listing = cli(redis_url, capsys, "list")
    [row] = listing.splitlines()[1:]
    assert row.split()[1:4] == ["batch-team", "unlimited", "5000"]
