"""The dashboard's history: samples taken from a real Redis and the gateway's own TTFTs, kept for
the window and no longer, and the four charts as headless Chromium draws them (DOM and pixels)."""

from __future__ import annotations

import asyncio
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis
from PIL import Image

from kvfleet.gateway.dashboard.history import (FleetHistory, HistoryPoint, HistorySampler,
                                       history_router, redis_snapshot_reader)
from kvfleet.gateway.dashboard.metrics import GatewayMetrics
from kvfleet.gateway.fleet.redis_context import RedisContext
from tests.gateway_dashboard.test_dashboard import (CHROMIUM_TIMEOUT_S, KEYS, MODEL, chromium_dom,
                                                    find_chromium, free_port, make_app,
                                                    serve_in_thread, text_of, write_heartbeat)

WINDOW_S = 900.0
SAMPLE_S = 5.0
NOW = 1_800_000_000.0
LINE_COLOURS = {"tps": (0x39, 0xC5, 0xCF), "p50": (0xA3, 0x71, 0xF7), "p99": (0xFF, 0x7B, 0x72),
                "queue": (0xE3, 0xB3, 0x41), "kv": (0x7E, 0xE7, 0x87)}


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_history_keeps_the_window_and_drops_older_samples():
    history = FleetHistory(history_s=60, sample_s=5)
    for i in range(20):
        history.add(HistoryPoint(t=float(i), tokens_per_s=i, kv_usage_pct=0, queue_depth=0,
                                 workers=1, ttft_p50_s=None, ttft_p99_s=None, ttft_count=0))
    assert [p.t for p in history.points()] == [float(i) for i in range(8, 20)]  # 12 = 60 / 5
    body = history.as_json(now=25.0)
    assert (body["history_s"], body["sample_s"], body["now"]) == (60, 5, 25.0)
    assert body["points"][-1]["tokens_per_s"] == 19
    with pytest.raises(ValueError):
        FleetHistory(history_s=1, sample_s=5)


async def test_a_sample_reads_the_fleet_and_the_ttfts_since_the_last_one(redis_client, redis_url):
    write_heartbeat(redis_client, "w-1", total=200, free=50, running=3, tokens_per_s=120.5)
    write_heartbeat(redis_client, "w-2", total=100, free=100, running=0, tokens_per_s=10.0)
    stream = KEYS.queue(MODEL)
    redis_client.xgroup_create(stream, KEYS.group, id="0", mkstream=True)
    for i in range(3):
        redis_client.xadd(stream, {"id": f"r{i}", "payload": b"x"})
    clock = FakeClock()
    metrics = GatewayMetrics(MODEL, clock=clock)
    metrics.first_token(9.0)  # before the sampler existed: not in its first sample
    clock.now += 1
    context = RedisContext(redis_url, KEYS)
    try:
        sampler = HistorySampler(FleetHistory(WINDOW_S, SAMPLE_S),
                                 redis_snapshot_reader(context, MODEL), metrics)
        clock.now += 1
        for ttft_s in (0.1, 0.2, 0.3, 0.4, 2.0):
            metrics.first_token(ttft_s)
        clock.now += 5
        point = await sampler.sample_once()
        assert (point.tokens_per_s, point.workers, point.queue_depth) == (130.5, 2, 3)
        assert point.kv_usage_pct == 50.0  # 150 of 300 blocks
        assert point.ttft_count == 5 and point.ttft_p50_s == pytest.approx(0.3)
        assert point.ttft_p99_s == pytest.approx(0.4 + 0.96 * 1.6)
        clock.now += 5
        quiet = await sampler.sample_once()  # no first token since: no TTFT, fleet still there
        assert quiet.ttft_count == 0 and quiet.ttft_p50_s is None and quiet.ttft_p99_s is None
        assert quiet.tokens_per_s == 130.5
        assert [p.t for p in sampler.history.points()] == [point.t, quiet.t]
    finally:
        await context.aclose()


async def test_a_sample_while_redis_is_down_keeps_the_ttft_and_leaves_a_gap():
    clock = FakeClock()
    metrics = GatewayMetrics(MODEL, clock=clock)
    context = RedisContext(f"redis://127.0.0.1:{free_port()}/0", KEYS, connect_timeout_s=0.5)
    try:
        sampler = HistorySampler(FleetHistory(WINDOW_S, SAMPLE_S),
                                 redis_snapshot_reader(context, MODEL), metrics)
        clock.now += 1
        metrics.first_token(0.25)
        point = await sampler.sample_once()
    finally:
        await context.aclose()
    assert point.tokens_per_s is None and point.queue_depth is None and point.kv_usage_pct is None
    assert point.ttft_p50_s == 0.25 and point.ttft_count == 1


async def test_the_sampler_runs_on_its_own_every_sample_period(redis_url):
    context = RedisContext(redis_url, KEYS)
    history = FleetHistory(history_s=10, sample_s=0.05)
    sampler = HistorySampler(history, redis_snapshot_reader(context, MODEL),
                             GatewayMetrics(MODEL))
    try:
        sampler.start()
        await asyncio.sleep(0.5)
        await sampler.stop()
        taken = len(history.points())
        assert 4 <= taken <= 11
        await asyncio.sleep(0.2)
        assert len(history.points()) == taken  # stopped means stopped
    finally:
        await context.aclose()


# ---- the charts in a real browser -------------------------------------------------------------

def synthetic_history() -> FleetHistory:
    """15 minutes of samples: tokens/s rising 0 -> 300, TTFT p50 0.1 s / p99 0.4 s with a spike,
    queue depth a triangle with a Redis outage (a gap) of one minute, KV usage 10 -> 90 %."""
    history = FleetHistory(WINDOW_S, SAMPLE_S)
    n = int(WINDOW_S / SAMPLE_S)
    for i in range(n):
        t = NOW - WINDOW_S + (i + 1) * SAMPLE_S
        outage = 60 <= i < 72
        history.add(HistoryPoint(
            t=t, tokens_per_s=None if outage else 300.0 * i / (n - 1),
            kv_usage_pct=None if outage else 10 + 80.0 * i / (n - 1),
            queue_depth=None if outage else min(i, n - i) // 3,
            workers=None if outage else 2, ttft_p50_s=0.1, ttft_p99_s=1.6 if i == 150 else 0.4,
            ttft_count=10))
    return history


class FrozenHistory(FleetHistory):
    """The synthetic history, served as if it were `NOW`."""

    def as_json(self, now: float) -> dict:
        return super().as_json(NOW)


@pytest.fixture
def chart_url(redis_url) -> Iterator[str]:
    history = FrozenHistory(WINDOW_S, SAMPLE_S)
    for point in synthetic_history().points():
        history.add(point)
    app = make_app(redis_url, GatewayMetrics(MODEL))  # the dashboard as test_dashboard serves it
    app.include_router(history_router(history))
    yield from serve_in_thread(app)


def test_history_json_over_http(chart_url):
    body = httpx.get(f"{chart_url}/dashboard/history", timeout=10).json()
    assert body["history_s"] == WINDOW_S and body["sample_s"] == SAMPLE_S
    assert len(body["points"]) == 180
    assert set(body["points"][0]) == {"t", "tokens_per_s", "kv_usage_pct", "queue_depth",
                                      "workers", "ttft_p50_s", "ttft_p99_s", "ttft_count"}


def chart_paths(dom: str, chart_id: str) -> dict[str, tuple[int, int]]:
    """{series class: (points drawn, segments)} of one chart's SVG, from the dumped DOM."""
    svg = re.search(rf'<svg id="{chart_id}"[^>]*>(.*?)</svg>', dom, re.S)
    assert svg, f"no chart #{chart_id}"
    paths = re.findall(r'<path class="line (\w+)" d="([^"]*)" data-points="(\d+)"', svg[1])
    return {cls: (int(points), d.count("M")) for cls, d, points in paths}


@pytest.mark.browser
def test_the_page_draws_fifteen_minutes_of_history(chart_url, tmp_path):
    dom = chromium_dom(f"{chart_url}/dashboard", tmp_path / "profile")
    assert chart_paths(dom, "chart-tps") == {"tps": (168, 2)}  # 180 - 12 in the outage, 2 runs
    assert chart_paths(dom, "chart-ttft") == {"p50": (180, 1), "p99": (180, 1)}
    assert chart_paths(dom, "chart-queue") == {"queue": (168, 2)}
    assert chart_paths(dom, "chart-kv") == {"kv": (168, 2)}
    assert 'class="ymax">500<' in dom  # tokens/s axis: 300 -> 500
    assert 'class="ymax">2.00 s<' in dom  # TTFT axis: the 1.6 s spike -> 2 s
    assert 'class="ymax">100%<' in dom
    assert ">-15 min<" in dom and ">now<" in dom
    assert text_of(dom, "latest-tps") == "300.0"
    assert text_of(dom, "latest-ttft") == "100 ms / 400 ms"
    assert text_of(dom, "latest-kv") == "90.0%"


def screenshot(url: str, path: Path, profile: Path) -> Image.Image:
    cmd = [find_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
           "--no-first-run", "--disable-background-networking", "--disable-component-update",
           "--disable-sync", f"--user-data-dir={profile}", "--virtual-time-budget=5000",
           "--window-size=1280,900", f"--screenshot={path}", url]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=CHROMIUM_TIMEOUT_S)
    assert done.returncode == 0 and path.exists(), f"chromium failed: {done.stderr[-2000:]}"
    return Image.open(path).convert("RGB")


def pixels_of(image: Image.Image, colour: tuple[int, int, int],
              tolerance: int = 24) -> list[tuple[int, int]]:
    """(x, y) of the pixels within `tolerance` of `colour` in every channel."""
    width, height = image.size
    data = image.load()
    return [(x, y) for y in range(height) for x in range(width)
            if all(abs(c - want) <= tolerance for c, want in zip(data[x, y], colour))]


@pytest.mark.browser
def test_screenshot_shows_each_series_where_its_data_says(chart_url, tmp_path):
    image = screenshot(f"{chart_url}/dashboard", tmp_path / "dashboard.png", tmp_path / "profile")
    found = {name: pixels_of(image, colour) for name, colour in LINE_COLOURS.items()}
    for name, pixels in found.items():
        assert len(pixels) >= 150, f"{name}: {len(pixels)} pixels of its colour"
    for name in ("tps", "kv"):  # rising series: the right end is drawn higher (smaller y)
        xs = sorted(x for x, _ in found[name])
        left = [y for x, y in found[name] if x < xs[len(xs) // 4]]
        right = [y for x, y in found[name] if x > xs[3 * len(xs) // 4]]
        assert sum(left) / len(left) > sum(right) / len(right) + 20, name
    # Four charts side by side: the series sit in four distinct columns, left to right.
    centres = {name: sum(x for x, _ in px) / len(px) for name, px in found.items()}
    assert centres["tps"] < centres["p50"] < centres["queue"] < centres["kv"]
    # In the TTFT chart p99 (0.4 s) is drawn above p50 (0.1 s).
    p50_y = sum(y for _, y in found["p50"]) / len(found["p50"])
    p99_y = sum(y for _, y in found["p99"]) / len(found["p99"])
    assert p99_y < p50_y - 8
