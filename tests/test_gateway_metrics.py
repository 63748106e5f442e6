"""GatewayMetrics: histogram buckets, request counters, recent-TTFT quantiles and `GET /metrics`."""

from __future__ import annotations

import httpx
import pytest
from fastapi import FastAPI
from prometheus_client.parser import text_string_to_metric_families

from kvfleet.gateway.dashboard.metrics import GatewayMetrics, RejectionCounter, metrics_route, quantile


class FakeClock:
    def __init__(self, now: float = 500.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def sample(metrics: GatewayMetrics, name: str, **labels: str) -> float:
    wanted = {"model": "tiny", **labels}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for s in family.samples:
            if s.name == name and s.labels == wanted:
                return s.value
    raise AssertionError(f"no sample {name}{wanted}")


def test_ttft_itl_e2e_land_in_their_buckets():
    metrics = GatewayMetrics("tiny", clock=FakeClock())
    metrics.first_token(0.12)
    metrics.first_token(3.5)
    metrics.tokens(4, 0.08)  # 4 tokens in one chunk: 4 gaps of 20 ms
    metrics.request_started("chat")
    metrics.request_finished("chat", "stop", prompt_tokens=10, completion_tokens=5, e2e_s=7.0)
    ttft = "kvfleet_gateway_time_to_first_token_seconds_bucket"
    assert sample(metrics, ttft, le="0.1") == 0
    assert sample(metrics, ttft, le="0.15") == 1
    assert sample(metrics, ttft, le="3.0") == 1
    assert sample(metrics, ttft, le="5.0") == 2
    assert sample(metrics, "kvfleet_gateway_time_to_first_token_seconds_count") == 2
    itl = "kvfleet_gateway_inter_token_latency_seconds_bucket"
    assert sample(metrics, itl, le="0.015") == 0
    assert sample(metrics, itl, le="0.02") == 4
    assert sample(metrics, "kvfleet_gateway_inter_token_latency_seconds_sum") == \
        pytest.approx(0.08)
    e2e = "kvfleet_gateway_e2e_request_latency_seconds_bucket"
    assert sample(metrics, e2e, le="5.0") == 0
    assert sample(metrics, e2e, le="10.0") == 1
    assert sample(metrics, e2e, le="+Inf") == 1


def test_requests_tokens_and_in_flight():
    metrics = GatewayMetrics("tiny", clock=FakeClock())
    for _ in range(3):
        metrics.request_started("completions")
    assert metrics.requests_in_flight() == 3
    metrics.request_finished("completions", "stop", 10, 20, 1.0)
    metrics.request_finished("completions", "length", 5, 16, 2.0)
    metrics.request_finished("completions", "abort", 7, 1, 0.5)
    metrics.request_rejected("chat", 429)
    assert metrics.requests_in_flight() == 0
    assert sample(metrics, "kvfleet_gateway_requests_in_flight") == 0
    total = "kvfleet_gateway_requests_total"
    assert sample(metrics, total, endpoint="completions", outcome="stop") == 1
    assert sample(metrics, total, endpoint="completions", outcome="length") == 1
    assert sample(metrics, total, endpoint="completions", outcome="abort") == 1
    assert sample(metrics, total, endpoint="chat", outcome="429") == 1
    assert sample(metrics, "kvfleet_gateway_prompt_tokens_total") == 22
    assert sample(metrics, "kvfleet_gateway_output_tokens_total") == 37


def test_tracker_times_a_request():
    clock = FakeClock()
    metrics = GatewayMetrics("tiny", clock=clock)
    tracker = metrics.track("chat")
    assert metrics.requests_in_flight() == 1
    clock.now += 0.4
    tracker.on_tokens(1)  # first token: TTFT 0.4 s
    clock.now += 0.05
    tracker.on_tokens(1)
    clock.now += 0.1
    tracker.on_tokens(2)  # 2 tokens after 100 ms: 2 gaps of 50 ms
    tracker.finish("stop", prompt_tokens=3, completion_tokens=4)
    tracker.finish("abort")  # idempotent: a `finally` fallback does not count twice
    assert tracker.ttft_s == pytest.approx(0.4)
    assert metrics.requests_in_flight() == 0
    assert sample(metrics, "kvfleet_gateway_time_to_first_token_seconds_sum") == \
        pytest.approx(0.4)
    assert sample(metrics, "kvfleet_gateway_inter_token_latency_seconds_count") == 3
    assert sample(metrics, "kvfleet_gateway_e2e_request_latency_seconds_sum") == \
        pytest.approx(0.55)
    # pace after the first token: 3 tokens in 0.15 s = 20 tokens/s
    assert sample(metrics, "kvfleet_gateway_stream_tokens_per_second_sum") == pytest.approx(20.0)
    assert sample(metrics, "kvfleet_gateway_requests_total", endpoint="chat",
                  outcome="stop") == 1
    with pytest.raises(AssertionError):
        sample(metrics, "kvfleet_gateway_requests_total", endpoint="chat", outcome="abort")


def test_ttft_quantiles_over_the_recent_window():
    clock = FakeClock()
    metrics = GatewayMetrics("tiny", recent_ttft_count=1000, recent_ttft_window_s=300.0,
                             clock=clock)
    assert metrics.ttft_quantiles() == (None, None)
    for i in range(1, 101):  # 0.01 .. 1.00 s
        metrics.first_token(i / 100)
    p50, p99 = metrics.ttft_quantiles()
    assert p50 == pytest.approx(0.505)
    assert p99 == pytest.approx(0.9901)
    clock.now += 301.0  # all of them are older than the window now
    metrics.first_token(2.0)
    assert metrics.ttft_quantiles() == (2.0, 2.0)


def test_ttft_quantiles_keep_only_the_last_n():
    metrics = GatewayMetrics("tiny", recent_ttft_count=10, clock=FakeClock())
    for _ in range(50):
        metrics.first_token(5.0)
    for _ in range(10):
        metrics.first_token(0.1)
    assert metrics.ttft_quantiles() == (0.1, 0.1)


def test_quantile_interpolates():
    assert quantile([], 0.5) is None
    assert quantile([3.0], 0.99) == 3.0
    assert quantile([1.0, 2.0, 3.0, 4.0], 0.5) == 2.5


async def test_metrics_route_serves_text_exposition():
    metrics = GatewayMetrics("tiny")
    metrics.first_token(0.2)
    app = FastAPI()
    app.include_router(metrics_route(metrics))
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
        resp = await client.get("/metrics")
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/plain; version=0.0.4")
        families = {f.name for f in text_string_to_metric_families(resp.text)}
        assert {"kvfleet_gateway_time_to_first_token_seconds", "kvfleet_gateway_requests",
                "kvfleet_gateway_requests_in_flight"} <= families
        openmetrics = await client.get(
            "/metrics", headers={"Accept": "application/openmetrics-text; version=1.0.0"})
        assert openmetrics.headers["content-type"].startswith("application/openmetrics-text")
        assert openmetrics.text.rstrip().endswith("# EOF")


def test_discard_leaves_in_flight_without_counting():
    metrics = GatewayMetrics("tiny", clock=FakeClock())
    tracker = metrics.track("chat")
    tracker.discard()
    tracker.finish("stop")  # too late: the first of finish/discard wins
    assert metrics.requests_in_flight() == 0
    with pytest.raises(AssertionError):
        sample(metrics, "kvfleet_gateway_requests_total", endpoint="chat", outcome="stop")


async def test_rejection_counter_counts_error_answers_of_generation_endpoints():
    from fastapi import HTTPException
    from fastapi.responses import PlainTextResponse

    metrics = GatewayMetrics("tiny")
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(status: int = 200):
        if status != 200:
            raise HTTPException(status, "no")
        return PlainTextResponse("ok")

    @app.post("/v1/completions")
    async def completions():
        raise RuntimeError("boom")

    @app.get("/other")
    async def other():
        raise HTTPException(404, "no")

    app.add_middleware(RejectionCounter, metrics=metrics)
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
        assert (await client.post("/v1/chat/completions")).status_code == 200
        assert (await client.post("/v1/chat/completions?status=429")).status_code == 429
        # refused by validation before the handler ran
        assert (await client.post("/v1/chat/completions?status=abc")).status_code == 422
        assert (await client.post("/v1/completions")).status_code == 500
        assert (await client.get("/other")).status_code == 404
    total = "kvfleet_gateway_requests_total"
    assert sample(metrics, total, endpoint="chat", outcome="429") == 1
    assert sample(metrics, total, endpoint="chat", outcome="422") == 1
    assert sample(metrics, total, endpoint="completions", outcome="500") == 1
    families = metrics.render().decode()
    assert 'outcome="200"' not in families and 'outcome="404"' not in families
