"""The Grafana dashboard cannot drift from the metrics: every PromQL expression in
deploy/grafana/dashboards/kvfleet.json names only series a real gateway and a real worker service
export, read from their live `/metrics` after a request (a tiny engine, a real Redis). The
worker's endpoint is found as Prometheus's would be told of it: the `metrics_url` of its
heartbeat, which the gateway's dashboard data shows."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import httpx
import pytest

from kvfleet.gateway.app import create_app
from kvfleet.gateway.models.tokenization import ModelInfo
from kvfleet.shared.models import DEFAULT_MODEL, load_tokenizer, resolve_model_path
from kvfleet.shared.redis_connect import connect
from kvfleet.shared.settings import GatewaySettings, WorkerSettings
from tests.engine.tiny_models import VOCAB, TinyModel, random_prompt
from tests.helpers.promql import dashboard_gaps, dashboard_queries, exported_names, metric_names
from tests.helpers.service_thread import serving
from kvfleet.worker.process.main import worker_protocol
from kvfleet.worker.metrics import WorkerMetrics
from kvfleet.worker.process.service import WorkerService

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy/grafana/dashboards/kvfleet.json"
PREFIX = "kvgraf:"
WORKER_ID = "w-graf"


@pytest.fixture
def worker(redis_url):
    """A worker service with a price (the cost panel's gauge) serving /metrics on a free port,
    its loop in a thread."""
    settings = WorkerSettings(redis_url=redis_url, model="tiny", served_model_name=DEFAULT_MODEL,
                              key_prefix=PREFIX, worker_id=WORKER_ID, heartbeat_interval_s=0.05,
                              read_block_ms=10, cost_per_hour=2.0)
    client = connect(redis_url)
    protocol = worker_protocol(settings, client, WORKER_ID)
    metrics = WorkerMetrics(WORKER_ID, protocol.model, settings.cost_per_hour)
    port = metrics.serve(0, "127.0.0.1")
    service = WorkerService(settings, TinyModel("llama").engine(num_blocks=64, block_size=4),
                            client, protocol, metrics, f"http://127.0.0.1:{port}/metrics")
    with serving(service):
        yield service
    metrics.close()
    client.close()


@pytest.fixture
async def live_names(redis_url, worker) -> set[str]:
    """The series names of the gateway's and the worker's /metrics after one completion."""
    settings = GatewaySettings(redis_url=redis_url, model=DEFAULT_MODEL, key_prefix=PREFIX,
                               request_timeout_s=30, first_event_timeout_s=20)
    tokenizer = load_tokenizer(resolve_model_path(DEFAULT_MODEL))
    info = ModelInfo(served_id=DEFAULT_MODEL, context_length=512, vocab_size=VOCAB)
    app = create_app(settings, None, tokenizer, model_info=info)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw",
                                     timeout=30) as http:
            response = await http.post("/v1/completions", json={
                "model": DEFAULT_MODEL, "prompt": random_prompt(13, seed=3), "max_tokens": 5,
                "temperature": 0, "ignore_eos": True})
            assert response.status_code == 200, response.text
            assert response.json()["usage"]["completion_tokens"] == 5
            data = (await http.get("/dashboard/data")).json()
            (row,) = [w for w in data["workers"] if w["id"] == WORKER_ID]
            gateway_text = (await http.get("/metrics")).text
    async with httpx.AsyncClient(timeout=10) as http:
        worker_text = (await http.get(row["metrics_url"])).text
    assert "kvfleet_gateway_time_to_first_token_seconds_bucket{" in gateway_text
    assert f'worker="{WORKER_ID}"' in worker_text
    return exported_names(gateway_text) | exported_names(worker_text)


def load_dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


async def test_every_dashboard_query_names_metrics_the_fleet_exports(live_names):
    dashboard = load_dashboard()
    assert len(list(dashboard_queries(dashboard))) >= 40
    gaps = dashboard_gaps(dashboard, live_names)
    assert not gaps, "the dashboard reads metrics the fleet does not export:\n" + "\n".join(gaps)


async def test_a_made_up_or_misspelt_metric_is_reported_missing(live_names):
    """The negative control: the same check finds a name no process exports, a histogram named
    without its `_bucket`/`_sum`/`_count`, and a counter without its `_total`."""
    dashboard = load_dashboard()
    broken = copy.deepcopy(dashboard)
    target = broken["panels"][1]["targets"][0]
    target["expr"] = "sum(rate(kvfleet_worker_made_up_tokens_total[5m])) / 2"
    (gap,) = dashboard_gaps(broken, live_names)
    assert "kvfleet_worker_made_up_tokens_total" in gap
    assert target["expr"] in gap and repr(broken["panels"][1]["title"]) in gap
    for wrong, right in [("kvfleet_gateway_time_to_first_token_seconds",
                          "kvfleet_gateway_time_to_first_token_seconds_bucket"),
                         ("kvfleet_worker_output_tokens", "kvfleet_worker_output_tokens_total")]:
        assert wrong not in live_names and right in live_names
        target["expr"] = f"rate({wrong}[5m])"
        (gap,) = dashboard_gaps(broken, live_names)
        assert f"names {wrong}," in gap
    # families with labels and no series yet count by their # TYPE line
    assert {"kvfleet_worker_lora_requests_total", "kvfleet_worker_handoff_seconds_bucket",
            "kvfleet_worker_spec_decode_num_accepted_tokens_per_pos_total"} <= live_names
    assert metric_names(dashboard["panels"][1]["targets"][0]["expr"]) <= live_names
