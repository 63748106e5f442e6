"""Prometheus metrics of one gateway process: latency as clients see it (TTFT, inter-token
latency, end to end), tokens and requests by outcome, on a registry of its own, plus `/metrics`.

Names start with `kvfleet_gateway_`; every series carries a `model` label: the model (or LoRA
adapter) a request named, for the per-request series; the default model, for this gateway's own
connections and shard shares. The fleet's own figures (`kvfleet_fleet_*`, read from Redis at each
scrape) come from gateway/dashboard/fleet_metrics.py.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import choose_encoder, generate_latest

from kvfleet.gateway.dashboard.fleet_metrics import FleetGauges
from kvfleet.gateway.fleet.redis_context import RedisContext

# Buckets suited to LLM serving (seconds). TTFT: 5 ms (cached prompt, idle fleet) .. 2 min (queued).
TTFT_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0,
                  3.0, 5.0, 7.5, 10.0, 20.0, 30.0, 60.0, 120.0)
# Inter-token latency: 1 ms .. 10 s per token; a reader needs ~50 ms (20 tokens/s).
ITL_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1,
                 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
E2E_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 15.0, 20.0, 30.0, 45.0, 60.0, 90.0,
                 120.0, 180.0, 300.0, 600.0)
# Routing one request (prefix-affinity): 10 us .. 50 ms.
ROUTING_BUCKETS_S = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 7.5e-4, 1e-3, 2.5e-3, 5e-3, 0.01,
                     0.05)
# Paths whose answers count as requests, and their `endpoint` label.
GENERATION_ENDPOINTS = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}
# Pace of one stream after its first token, tokens/s (the seed's "tokens/s per stream").
PACE_BUCKETS = (1.0, 2.0, 5.0, 10.0, 15.0, 20.0, 25.0, 30.0, 40.0, 50.0, 75.0, 100.0, 150.0,
                200.0, 300.0, 500.0, 1000.0)


class RecentValues:
    """The last `max_count` values observed within `window_s`, for quantiles a dashboard shows."""

    def __init__(self, max_count: int, window_s: float, clock: Callable[[], float]):
        self.window_s = window_s
        self._clock = clock
        self._values: deque[tuple[float, float]] = deque(maxlen=max_count)  # (time, value)
        self._lock = threading.Lock()

    def add(self, value: float) -> None:
        with self._lock:
            self._values.append((self._clock(), value))

    def snapshot(self) -> list[float]:
        horizon = self._clock() - self.window_s
        with self._lock:
            while self._values and self._values[0][0] < horizon:
                self._values.popleft()
            return [v for _, v in self._values]

    def since(self, t: float) -> list[float]:
        """Values observed after clock time `t` (at most the last `max_count`)."""
        with self._lock:
            return [v for at, v in self._values if at > t]


def quantile(values: list[float], q: float) -> float | None:
    """Linear-interpolated quantile (numpy's default method); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    low, high = math.floor(pos), math.ceil(pos)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


class _ShardSharesCollector:
    """Reads a GatewayHomes (gateway/fleet/homes.py) when scraped."""

    def __init__(self, model: str, homes):
        self._model = model
        self._homes = homes

    def collect(self):
        share = GaugeMetricFamily(
            "kvfleet_gateway_shard_share", "This gateway's share of its new requests per stream "
            "shard (KVFLEET_GATEWAY_SHARD_SHARES; by its place among the live gateways).",
            labels=["model", "shard"])
        for shard, value in self._homes.shares:
            share.add_metric([self._model, str(shard)], value)
        _, count = self._homes.place
        live = GaugeMetricFamily(
            "kvfleet_gateway_live_gateways", "Live gateways on the gateway roster as this gateway "
            "last read it (0: no place yet, every shard alike).", labels=["model"])
        live.add_metric([self._model], count)
        return [share, live]


class _FanoutCollector:
    """Reads the gateway's TokenFanout (gateway/fleet/fanout.py) when scraped."""

    def __init__(self, model: str, fanout):
        self._model = model
        self._fanout = fanout

    def collect(self):
        fanout, labels = self._fanout, [self._model]
        families = [
            (GaugeMetricFamily, "kvfleet_gateway_pubsub_channels", "Pub/sub channels this gateway "
             "subscribes: its inboxes (one per Redis primary its requests live on) and the own "
             "channels of requests attached by id.", fanout.num_channels),
            (GaugeMetricFamily, "kvfleet_gateway_pubsub_connections", "Pub/sub connections open "
             "(one per Redis node with subscribed channels).", fanout.num_connections),
            (CounterMetricFamily, "kvfleet_gateway_pubsub_connections_opened", "Pub/sub "
             "connections made, first ones included: more than one per node means a connection "
             "broke (its streams subscribed again and read their checkpoints).",
             fanout.connections_opened),
            (CounterMetricFamily, "kvfleet_gateway_token_messages", "Token messages received; "
             "token_events / token_messages is the events a worker step sent in one message.",
             fanout.messages_received),
            (CounterMetricFamily, "kvfleet_gateway_token_events", "Token events received.",
             fanout.events_received),
            (CounterMetricFamily, "kvfleet_gateway_undecodable_messages", "Messages on a token "
             "channel that were not token events (dropped).", fanout.undecodable_messages),
        ]
        out = []
        for kind, name, doc, value in families:
            family = kind(name, doc, labels=["model"])
            family.add_metric(labels, value)
            out.append(family)
        return out


# the routes each routing policy takes (Route.reason), every one exported from the start
ROUTES = {"affinity": ("affinity", "least_loaded", "shared"), "random": ("random", "shared")}


class _RouterCollector:
    """Reads a Router's stats per model and its prefix indexes (gateway/fleet/affinity.py) when
    scraped."""

    def __init__(self, router):
        self._router = router

    def collect(self):
        router = self._router
        routed = CounterMetricFamily(
            "kvfleet_gateway_routed", "Requests by where the router sent them: `affinity` (the "
            "own stream of the worker holding most of the prompt), `least_loaded` (no worker "
            "the load allows holds enough of it: the least loaded one's own stream), `random` "
            "(`--routing random`: a uniformly random worker's own stream), `shared` (the shared "
            "streams: no index or live worker yet).", labels=["model", "route"])
        by_worker = CounterMetricFamily(
            "kvfleet_gateway_routed_to_worker", "Requests this gateway routed to a worker's own "
            "stream, by worker.", labels=["model", "worker"])
        prompt = CounterMetricFamily(
            "kvfleet_gateway_routed_prompt_tokens", "Prompt tokens of the requests routed.",
            labels=["model"])
        cached = CounterMetricFamily(
            "kvfleet_gateway_routed_cached_tokens", "Of those, the tokens the router expected "
            "the chosen worker to find in its prefix cache on its device.", labels=["model"])
        host_tier = CounterMetricFamily(
            "kvfleet_gateway_routed_host_tier_tokens", "Of those, the tokens the router expected "
            "the chosen worker to bring back from its host tier (`--kv-offloading-size`).",
            labels=["model"])
        for model, stats in sorted(router.model_stats.items()):
            for reason in ROUTES[getattr(router, "policy", "affinity")]:
                routed.add_metric([model, reason], stats.routed.get(reason, 0))
            for worker_id, count in sorted(stats.by_worker.items()):
                by_worker.add_metric([model, worker_id], count)
            prompt.add_metric([model], stats.prompt_tokens)
            cached.add_metric([model], stats.cached_tokens)
            host_tier.add_metric([model], getattr(stats, "host_tier_tokens", 0))
        blocks = GaugeMetricFamily(
            "kvfleet_gateway_prefix_index_blocks", "Blocks in this gateway's prefix index (summed "
            "over the workers holding them, in either tier), per model followed.",
            labels=["model", "index"])
        host_blocks = GaugeMetricFamily(
            "kvfleet_gateway_prefix_index_host_blocks", "Of those, the blocks held in a worker's "
            "host tier (`--kv-offloading-size`).", labels=["model", "index"])
        events = CounterMetricFamily(
            "kvfleet_gateway_prefix_index_events", "Announcement events applied to the prefix "
            "index; its rate is the fleet's announcements per second.", labels=["model", "index"])
        snapshots = CounterMetricFamily(
            "kvfleet_gateway_prefix_index_snapshots", "Snapshots the prefix index took: one at "
            "start, more after a Redis failure or when it fell behind the trimmed event stream.",
            labels=["model", "index"])
        for followed, index in sorted(router.indexes.items()):
            blocks.add_metric([followed, followed], index.num_blocks)
            host_blocks.add_metric([followed, followed], getattr(index, "num_host_blocks", 0))
            events.add_metric([followed, followed], index.events_applied)
            snapshots.add_metric([followed, followed], index.snapshots)
        return [routed, by_worker, prompt, cached, host_tier, blocks, host_blocks, events,
                snapshots]


@dataclass
class _ModelSeries:
    """One model label's children of the per-model families (made once: `labels()` takes a
    lock and a dict lookup, too much for every token)."""

    ttft: Any
    itl: Any
    e2e: Any
    pace: Any
    prompt_tokens: Any
    output_tokens: Any
    in_flight: Any


class GatewayMetrics:
    """Client-side latency and traffic of one gateway; one instance per app. Series carry the
    `model` label the client named: a served model, or an adapter (its requests and tokens are
    the adapter's own). The dashboard's recent TTFTs and in-flight count are the default
    model's (`model`), the model the dashboard shows."""

    def __init__(self, model: str, *, recent_ttft_count: int = 1000,
                 recent_ttft_window_s: float = 300.0, clock: Callable[[], float] = time.monotonic):
        self.model = model
        self.registry = CollectorRegistry(auto_describe=True)
        self.clock = clock
        self._clock = clock
        self._recent_ttft = RecentValues(recent_ttft_count, recent_ttft_window_s, clock)
        self._series: dict[str, _ModelSeries] = {}
        p = "kvfleet_gateway_"
        self._ttft = Histogram(
            p + "time_to_first_token_seconds", "Request received -> first output token sent.",
            ["model"], buckets=TTFT_BUCKETS_S, registry=self.registry)
        self._itl = Histogram(
            p + "inter_token_latency_seconds", "Gap between consecutive output tokens of a stream "
            "(a chunk of n tokens counts n gaps of gap/n).", ["model"], buckets=ITL_BUCKETS_S,
            registry=self.registry)
        self._e2e = Histogram(
            p + "e2e_request_latency_seconds", "Request received -> last byte of the response.",
            ["model"], buckets=E2E_BUCKETS_S, registry=self.registry)
        self._pace = Histogram(
            p + "stream_tokens_per_second", "Output tokens/s of one stream after its first token.",
            ["model"], buckets=PACE_BUCKETS, registry=self.registry)
        self._prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens of finished requests.",
                                      ["model"], registry=self.registry)
        self._output_tokens = Counter(p + "output_tokens", "Output tokens of finished requests.",
                                      ["model"], registry=self.registry)
        self.requests = Counter(
            p + "requests", "Requests by endpoint and outcome: a finish reason (stop, length, "
            "abort, error) or the HTTP status of a rejected request (400, 429, 503 ...).",
            ["model", "endpoint", "outcome"], registry=self.registry)
        self._in_flight = Gauge(p + "requests_in_flight", "Requests being answered right now.",
                                ["model"], registry=self.registry)
        self.routing = Histogram(
            p + "routing_seconds", "Time the router spent choosing a request's stream (hashing "
            "its prompt's blocks, reading the prefix index and the loads), by base model.",
            ["model"], buckets=ROUTING_BUCKETS_S, registry=self.registry)
        self.series(model)  # the default model's series exist before its first request
        self._refreshers: list[Callable[[], Awaitable[None]]] = []  # run before each scrape

    def series(self, model: str | None = None) -> _ModelSeries:
        """The children of `model`'s label (default: the default model's)."""
        model = model or self.model
        found = self._series.get(model)
        if found is None:
            found = self._series[model] = _ModelSeries(
                *(family.labels(model=model) for family in (
                    self._ttft, self._itl, self._e2e, self._pace, self._prompt_tokens,
                    self._output_tokens, self._in_flight)))
        return found

    def knows(self, model: str | None) -> bool:
        """Whether `model` has series: a label a request resolved to (not any client text)."""
        return model in self._series

    def watch_shard_shares(self, homes) -> None:
        """Export a GatewayHomes' place and shares at each scrape: this gateway's share of new
        requests per stream shard, and the live gateways it counted (0 while it has no place)."""
        self.registry.register(_ShardSharesCollector(self.model, homes))

    def watch_router(self, router) -> None:
        """Export a Router's decisions and prefix indexes at each scrape, and time its routes."""
        self.registry.register(_RouterCollector(router))
        router.observe = lambda model, seconds: self.routing.labels(model=model).observe(seconds)

    def watch_fanout(self, fanout) -> None:
        """Export a TokenFanout's channels, connections and message counts at each scrape."""
        self.registry.register(_FanoutCollector(self.model, fanout))

    def watch_fleet(self, redis: RedisContext) -> None:
        """Export the fleet's capacity at the promised pace (`kvfleet_fleet_*`), read from
        Redis at each scrape of `/metrics`."""
        self._refreshers.append(FleetGauges(self.registry, redis, self.model).refresh)

    async def refresh(self) -> None:
        """Bring the series read at scrape time up to date (`/metrics` calls it first)."""
        for refresh in self._refreshers:
            await refresh()

    # ---- what the request handlers call --------------------------------------------------

    def request_started(self, endpoint: str, model: str | None = None) -> None:
        """A request was accepted for generation (pair with exactly one `request_finished`)."""
        del endpoint  # in-flight is counted per model; the endpoint matters at the finish
        self.series(model).in_flight.inc()

    def first_token(self, elapsed_s: float, model: str | None = None) -> None:
        """The first output token reached the client `elapsed_s` after the request arrived."""
        self.series(model).ttft.observe(elapsed_s)
        if model in (None, self.model):
            self._recent_ttft.add(elapsed_s)

    def tokens(self, n: int, gap_s: float, model: str | None = None) -> None:
        """`n` more tokens arrived `gap_s` after the previous ones (not for the first chunk)."""
        if n <= 0:
            return
        per_token_s = gap_s / n
        itl = self.series(model).itl
        for _ in range(n):
            itl.observe(per_token_s)

    def request_finished(self, endpoint: str, outcome: str, prompt_tokens: int,
                         completion_tokens: int, e2e_s: float,
                         ttft_s: float | None = None, model: str | None = None) -> None:
        """A started request ended; `outcome` is the finish reason, `error`, or `abort` (client
        gone). With `ttft_s`, the stream's pace after its first token is observed too."""
        series = self.series(model)
        series.in_flight.dec()
        self.requests.labels(model=model or self.model, endpoint=endpoint, outcome=outcome).inc()
        series.prompt_tokens.inc(max(prompt_tokens, 0))
        series.output_tokens.inc(max(completion_tokens, 0))
        series.e2e.observe(e2e_s)
        if ttft_s is not None and completion_tokens > 1 and e2e_s > ttft_s:
            series.pace.observe((completion_tokens - 1) / (e2e_s - ttft_s))

    def request_rejected(self, endpoint: str, status_code: int, model: str | None = None) -> None:
        """A request answered with an error status instead of a generation (400, 413, 429,
        503 ...); `RejectionCounter` calls this for every such answer."""
        self.requests.labels(model=model or self.model, endpoint=endpoint,
                             outcome=str(status_code)).inc()

    def track(self, endpoint: str, model: str | None = None) -> RequestTracker:
        """A per-request helper that takes the times itself; calls `request_started` now."""
        return RequestTracker(self, endpoint, self._clock, model or self.model)

    # ---- reading ---------------------------------------------------------------------------

    def ttft_quantiles(self) -> tuple[float | None, float | None]:
        """(p50, p99) of the default model's recent TTFTs (last `recent_ttft_count` within the
        window), or Nones."""
        values = self._recent_ttft.snapshot()
        return quantile(values, 0.5), quantile(values, 0.99)

    def ttft_since(self, t: float) -> list[float]:
        """The default model's TTFTs of first tokens sent after `clock()` time `t` (the
        dashboard's history)."""
        return self._recent_ttft.since(t)

    def requests_in_flight(self, model: str | None = None) -> int:
        value = self.registry.get_sample_value("kvfleet_gateway_requests_in_flight",
                                               {"model": model or self.model})
        return int(value or 0)

    def render(self) -> bytes:
        """The Prometheus text exposition (format 0.0.4) of this gateway's registry."""
        return generate_latest(self.registry)


class RequestTracker:
    """Times one request: TTFT at its first tokens, ITL between later ones, E2E at the finish.

    `finish` and `discard` are idempotent and exclusive (the first call wins), so a handler may
    call `finish("abort")` from a `finally` as a fallback after a normal finish.
    """

    def __init__(self, metrics: GatewayMetrics, endpoint: str, clock: Callable[[], float],
                 model: str | None = None):
        self._metrics = metrics
        self._clock = clock
        self.endpoint = endpoint
        self.model = model or metrics.model  # the label: what the client named
        self.started_at = clock()
        self._last_token_at: float | None = None
        self.ttft_s: float | None = None
        self.finished = False
        # tracing on: the request's span (gateway/http/tracing.py RequestSpan), told the same
        self.span = None
        metrics.request_started(endpoint, self.model)

    def on_tokens(self, n: int) -> None:
        """`n` output tokens were sent to the client just now."""
        if n <= 0:
            return
        now = self._clock()
        if self._last_token_at is None:
            self.ttft_s = now - self.started_at
            self._metrics.first_token(self.ttft_s, self.model)
            if self.span is not None:
                self.span.first_token(self.ttft_s)
        else:
            self._metrics.tokens(n, now - self._last_token_at, self.model)
        self._last_token_at = now

    def finish(self, outcome: str, prompt_tokens: int = 0, completion_tokens: int = 0,
               reasons: list[str | None] | None = None) -> None:
        """The response ended with `outcome` (finish reason, `error`, or `abort`); `reasons`:
        each choice's finish reason, for the span."""
        if self.finished:
            return
        self.finished = True
        e2e_s = self._clock() - self.started_at
        self._metrics.request_finished(self.endpoint, outcome, prompt_tokens, completion_tokens,
                                       e2e_s, self.ttft_s, self.model)
        if self.span is not None:
            self.span.finish(outcome, prompt_tokens, completion_tokens, e2e_s, reasons)

    def discard(self) -> None:
        """The handler raised instead of answering: leave in-flight, count nothing here (the
        error status is counted by `RejectionCounter`)."""
        if self.finished:
            return
        self.finished = True
        self._metrics.series(self.model).in_flight.dec()


class RejectionCounter:
    """ASGI middleware: every 4xx/5xx answer of a generation endpoint counts as a request with
    its status as the outcome, including those refused before any handler ran (invalid JSON,
    body too large). Answers with status 200 are counted by the handlers' `RequestTracker`.
    The model label is the one the route resolved the request to (`request.state.model`), else
    the default model's (an unknown name is no label: clients would make up any number)."""

    def __init__(self, app: Any, metrics: GatewayMetrics,
                 endpoints: Mapping[str, str] = GENERATION_ENDPOINTS):
        self.app = app
        self.metrics = metrics
        self.endpoints = dict(endpoints)

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        endpoint = self.endpoints.get(scope.get("path", "")) if scope["type"] == "http" else None
        if endpoint is None:
            await self.app(scope, receive, send)
            return
        status_sent = False

        async def send_counting(message: dict) -> None:
            nonlocal status_sent
            if message["type"] == "http.response.start":
                status_sent = True
                if message["status"] >= 400:
                    self.metrics.request_rejected(endpoint, message["status"],
                                                  self._model(scope))
            await send(message)

        try:
            await self.app(scope, receive, send_counting)
        except Exception:
            if not status_sent:  # Starlette's outer error middleware will answer 500
                self.metrics.request_rejected(endpoint, 500, self._model(scope))
            raise

    def _model(self, scope: dict) -> str | None:
        """The model label the route resolved the request to (None: the default model's)."""
        model = (scope.get("state") or {}).get("model")
        return model if self.metrics.knows(model) else None


def metrics_route(metrics: GatewayMetrics) -> APIRouter:
    """`GET /metrics`: the exposition in the format the scraper asks for (text 0.0.4 by default,
    OpenMetrics when its Accept header says so)."""
    router = APIRouter()

    @router.get("/metrics", include_in_schema=False)
    async def get_metrics(request: Request) -> Response:
        await metrics.refresh()
        encoder, content_type = choose_encoder(request.headers.get("accept", ""))
        return Response(encoder(metrics.registry), media_type=content_type)

    return router
