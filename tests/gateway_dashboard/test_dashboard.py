"""The dashboard against a real Redis: its JSON, its 503 when Redis is down, and the page as
headless Chromium renders it (the JS must have put the data into the DOM)."""

from __future__ import annotations

import html
import re
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import pytest
import redis
import uvicorn
from fastapi import FastAPI
from redis.asyncio import Redis

from kvfleet.gateway.dashboard.metrics import GatewayMetrics, metrics_route
from kvfleet.gateway.dashboard.router import dashboard_router
from kvfleet.gateway.fleet.load import stream_depth
from kvfleet.gateway.fleet.redis_context import RedisContext
from kvfleet.shared.wire import Heartbeat, Keys

MODEL = "tiny-model"
KEYS = Keys("kvft:")
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_TIMEOUT_S = 60


# ---- fixtures ---------------------------------------------------------------------------------

def make_app(redis_url: str, metrics: GatewayMetrics) -> FastAPI:
    """A minimal gateway: a Redis context of its own (closed in the server's loop), our routers."""
    redis_context = RedisContext(redis_url, KEYS, connect_timeout_s=1, command_timeout_s=2)

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        try:
            yield
        finally:
            await redis_context.aclose()

    app = FastAPI(lifespan=lifespan)
    app.include_router(dashboard_router(redis_context, MODEL, metrics))
    app.include_router(metrics_route(metrics))
    return app


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def serve_in_thread(app: FastAPI) -> Iterator[str]:
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           lifespan="on"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


@pytest.fixture
def metrics() -> GatewayMetrics:
    gm = GatewayMetrics(MODEL)
    for ttft_s in (0.1, 0.2, 0.3):
        gm.first_token(ttft_s)
    return gm


@pytest.fixture
def base_url(redis_url: str, metrics: GatewayMetrics) -> Iterator[str]:
    yield from serve_in_thread(make_app(redis_url, metrics))


@pytest.fixture
def down_url(metrics: GatewayMetrics) -> Iterator[str]:
    """The same app pointed at a port where no Redis listens."""
    yield from serve_in_thread(make_app(f"redis://127.0.0.1:{free_port()}/0", metrics))


def write_heartbeat(client: redis.Redis, worker_id: str, *, total: int, free: int,
                    running: int, tokens_per_s: float, model: str = MODEL,
                    metrics_url: str | None = None, spec: tuple[int, int] = (0, 0),
                    **fields) -> None:
    key = KEYS.worker(worker_id)
    beat = Heartbeat(model=model, ts=time.time(), blocks_total=total, blocks_free=free,
                     running=running, waiting=1, preemptions=2, generated_tokens=500,
                     prefix_queried_tokens=400, prefix_hit_tokens=100, tokens_per_s=tokens_per_s,
                     metrics_url=metrics_url or "", spec_draft_tokens=spec[0],
                     spec_accepted_tokens=spec[1], **fields)
    client.hset(key, mapping=beat.encode())
    client.expire(key, 60)


@pytest.fixture
def fleet(redis_client: redis.Redis) -> redis.Redis:
    """Two workers, a prefill one that promises a pace (it keeps its ITL, misses its TTFT) and a
    decode one that promises none and drains (its drain request still in Redis), and an
    interactive stream: 4 entries, 1 delivered (pending), 3 undelivered; plus 2 batch entries in
    a stream no worker has made a group for yet."""
    write_heartbeat(redis_client, "gpu-a-1", total=200, free=50, running=3, tokens_per_s=120.5,
                    spec=(300, 186), role="prefill", handoffs_out=3, target_itl_ms=50,
                    itl_p99_ms=42.44, target_ttft_ms=800, ttft_p99_ms=950, pace_room=6,
                    pace_streams=9, numerics="fp_0123456789")
    write_heartbeat(redis_client, "gpu-b-2", total=80, free=60, running=1, tokens_per_s=40.25,
                    metrics_url="http://10.0.0.2:9100/metrics", role="decode", draining=1,
                    handoffs_in=3)
    redis_client.set(KEYS.drain("gpu-b-2"), "1", ex=60)
    stream = KEYS.queue(MODEL)
    redis_client.xgroup_create(stream, KEYS.group, id="0", mkstream=True)
    for i in range(4):
        redis_client.xadd(stream, {"id": f"req-{i}", "payload": b"x"})
    redis_client.xreadgroup(KEYS.group, "gpu-a-1", {stream: ">"}, count=1)
    for i in range(2):
        redis_client.xadd(KEYS.queue(MODEL, "batch"), {"id": f"batch-{i}", "payload": b"x"})
    return redis_client


# ---- chromium ---------------------------------------------------------------------------------

def find_chromium(preferred: str = CHROMIUM, name: str = "chromium") -> str:
    """Chromium's path; a missing browser fails the test (never skips it) with how to install."""
    if Path(preferred).exists():
        return preferred
    found = shutil.which(name)
    if found is None:
        pytest.fail(f"{preferred} not found: the dashboard test needs headless Chromium. Install "
                    "it with `apt-get install chromium` (Debian/Ubuntu).", pytrace=False)
    return found


def chromium_dom(url: str, user_data_dir: Path) -> str:
    """The DOM after the page's scripts ran, as headless Chromium dumps it."""
    binary = find_chromium()
    cmd = [binary, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
           "--no-first-run", "--disable-background-networking", "--disable-component-update",
           "--disable-sync", f"--user-data-dir={user_data_dir}", "--virtual-time-budget=5000",
           "--dump-dom", url]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=CHROMIUM_TIMEOUT_S)
    assert done.returncode == 0, f"chromium failed ({done.returncode}): {done.stderr[-2000:]}"
    return done.stdout


def text_of(dom: str, element_id: str) -> str:
    match = re.search(rf'id="{element_id}"[^>]*>(.*?)</', dom, re.S)
    assert match, f"no element #{element_id} in the rendered DOM"
    return html.unescape(match.group(1)).strip()


def worker_row(dom: str, worker_id: str) -> str:
    match = re.search(rf'<tr data-worker="{re.escape(worker_id)}">(.*?)</tr>', dom, re.S)
    assert match, f"no row for worker {worker_id} in the rendered DOM"
    return html.unescape(match.group(1))


# ---- tests ------------------------------------------------------------------------------------

@pytest.mark.browser
def test_page_renders_workers_queue_and_kv_usage(fleet, base_url, tmp_path):
    dom = chromium_dom(f"{base_url}/dashboard", tmp_path / "profile")
    assert text_of(dom, "model") == MODEL
    assert text_of(dom, "queue-depth") == "5"  # 3 interactive + 2 batch undelivered
    assert text_of(dom, "queue-pending") == "1"
    assert text_of(dom, "total-tps") == "160.8"
    assert text_of(dom, "total-running") == "4"
    assert text_of(dom, "ttft-p50") == "200 ms"
    assert text_of(dom, "status").startswith("last updated")
    first, second = worker_row(dom, "gpu-a-1"), worker_row(dom, "gpu-b-2")
    assert "75.0% (150/200)" in first and 'style="width: 75%;"' in first
    assert "25.0% (20/80)" in second
    assert '<a href="http://10.0.0.2:9100/metrics"' in second  # worker id links its metrics
    assert "25.0%" in first  # prefix hit rate 100/400
    assert "62.0%" in first and "62.0%" not in second  # speculation accepted 186/300; b: none
    assert '<td class="role">prefill</td>' in first and "3 / 0" in first  # handoffs out / in
    assert '<td class="role draining">decode · draining</td>' in second and "0 / 3" in second
    # the numerics fingerprint (b: an older worker that publishes none)
    assert '<td class="numerics">fp_0123456789</td>' in first
    assert '<td class="numerics">–</td>' in second
    # the pace promised and kept: ITL p99 / target, TTFT p99 / target (missed: red), room
    assert "<td>42 / 50 ms</td>" in first and '<td class="missed">950 / 800 ms</td>' in first
    assert "<td>6</td>" in first
    assert second.count("<td>–</td>") >= 3  # no pace promised: no targets, no room

    write_heartbeat(fleet, "gpu-a-1", total=200, free=10, running=7, tokens_per_s=99.0)
    dom = chromium_dom(f"{base_url}/dashboard", tmp_path / "profile")
    assert "95.0% (190/200)" in worker_row(dom, "gpu-a-1")
    assert text_of(dom, "total-running") == "8"


@pytest.mark.browser
def test_page_says_redis_unreachable(down_url, tmp_path):
    dom = chromium_dom(f"{down_url}/dashboard", tmp_path / "profile")
    assert text_of(dom, "status") == "Redis unreachable"
    assert text_of(dom, "model") == MODEL
    assert 'class="down"' in dom


def test_missing_chromium_fails_with_install_hint():
    with pytest.raises(pytest.fail.Exception, match="apt-get install chromium"):
        find_chromium("/nonexistent/chromium", name="no-such-chromium-binary")


def test_data_json(fleet, base_url):
    body = httpx.get(f"{base_url}/dashboard/data", timeout=10).json()
    assert [w["id"] for w in body["workers"]] == ["gpu-a-1", "gpu-b-2"]
    a = body["workers"][0]
    assert a["model"] == MODEL
    assert [(w["role"], w["draining"], w["handoffs_out"], w["handoffs_in"])
            for w in body["workers"]] == [("prefill", False, 3, 0), ("decode", True, 0, 3)]
    assert [w["numerics"] for w in body["workers"]] == ["fp_0123456789", None]
    assert (a["kv_blocks_used"], a["kv_blocks_total"], a["kv_usage_pct"]) == (150, 200, 75.0)
    assert (a["running"], a["waiting"], a["preemptions"]) == (3, 1, 2)
    assert a["tokens_per_s"] == 120.5 and a["prefix_hit_rate"] == 0.25
    assert a["spec_acceptance_rate"] == 0.62 and body["workers"][1]["spec_acceptance_rate"] is None
    assert 0 <= a["heartbeat_age_s"] < 30
    assert a["metrics_url"] is None
    assert body["workers"][1]["metrics_url"] == "http://10.0.0.2:9100/metrics"
    assert body["queue"]["by_priority"]["interactive"] == {
        "stream": KEYS.queue(MODEL), "depth": 3, "pending": 1}
    assert body["queue"]["by_priority"]["batch"]["depth"] == 2
    assert (body["queue"]["depth"], body["queue"]["pending"]) == (5, 1)
    assert body["totals"] == {"workers": 2, "tokens_per_s": 160.75, "running": 4, "waiting": 2,
                              "kv_usage_pct": round(100 * 170 / 280, 1),
                              "prefix_hit_rate": round((100 + 100) / (400 + 400), 4)}
    # this test's gateway routes every request to the shared streams
    assert body["routing"] == {"mode": "shared", "affinity": None, "least_loaded": None,
                               "random": None, "shared": None}
    assert (a["indexed_blocks"], a["routed"], a["own_queue"]) == (None, None, 0)
    assert [(w["itl_p99_ms"], w["target_itl_ms"], w["ttft_p99_ms"], w["target_ttft_ms"],
             w["pace_room"]) for w in body["workers"]] == [(42.4, 50.0, 950.0, 800.0, 6),
                                                          (None, None, None, None, None)]
    assert body["ttft_p50_s"] == pytest.approx(0.2)
    assert body["ttft_p99_s"] == pytest.approx(0.298)
    assert abs(body["updated"] - time.time()) < 30
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    assert "kvfleet_gateway_time_to_first_token_seconds_count" in text


def test_data_is_reused_for_half_a_second(fleet, base_url):
    first = httpx.get(f"{base_url}/dashboard/data", timeout=10).json()
    write_heartbeat(fleet, "gpu-a-1", total=200, free=0, running=3, tokens_per_s=1.0)
    again = httpx.get(f"{base_url}/dashboard/data", timeout=10).json()
    assert again["updated"] == first["updated"]  # many viewers, one Redis read per period
    time.sleep(0.6)
    fresh = httpx.get(f"{base_url}/dashboard/data", timeout=10).json()
    assert fresh["workers"][0]["kv_usage_pct"] == 100.0


def test_data_of_an_empty_fleet_is_zeros(redis_url, base_url):
    body = httpx.get(f"{base_url}/dashboard/data", timeout=10).json()
    assert body["workers"] == []
    assert (body["queue"]["depth"], body["queue"]["pending"]) == (0, 0)
    assert body["totals"]["tokens_per_s"] == 0


def test_other_models_workers_are_listed_but_not_totalled(fleet, base_url):
    write_heartbeat(fleet, "other-1", total=10, free=0, running=9, tokens_per_s=5.0,
                    model="other")
    body = httpx.get(f"{base_url}/dashboard/data", timeout=10).json()
    assert "other-1" in [w["id"] for w in body["workers"]]
    assert body["totals"]["workers"] == 2 and body["totals"]["running"] == 4


def test_data_is_503_in_openai_shape_when_redis_is_down(down_url):
    resp = httpx.get(f"{down_url}/dashboard/data", timeout=10)
    assert resp.status_code == 503
    error = resp.json()["error"]
    assert error["message"].startswith("Redis unreachable")
    assert error["type"] == "service_unavailable" and error["code"] == "redis_unavailable"


async def test_depth_without_lag_counts_past_last_delivered(redis_url):
    client = Redis.from_url(redis_url)
    try:
        stream = KEYS.queue(MODEL)
        ids = [await client.xadd(stream, {"n": i}) for i in range(5)]
        await client.xgroup_create(stream, KEYS.group, id="0")
        await client.xreadgroup(KEYS.group, "w", {stream: ">"}, count=1)
        await client.xdel(stream, ids[2])  # a deleted entry ahead of the group: lag unknown
        groups = await client.xinfo_groups(stream)
        assert groups[0]["lag"] is None
        assert await stream_depth(client, stream, KEYS.group) == (3, 1)
        assert await stream_depth(client, KEYS.queue("nope"), KEYS.group) == (0, 0)
    finally:
        await client.aclose()
