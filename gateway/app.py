"""The gateway's FastAPI app, wired from settings: engine client, the served models (the default
model's tokenizer loaded here, the others' on first use) and their handlers, the adapter
registry, errors."""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections.abc import Callable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

from fastapi import FastAPI

from kvfleet.gateway.admin import admin_router
from kvfleet.gateway.admission.admission import Admission
from kvfleet.gateway.admission.auth import ApiKeyAuth, ApiKeyStore
from kvfleet.gateway.admission.body_limit import BodySizeLimit
from kvfleet.gateway.admission.ratelimit import RateLimiter
from kvfleet.gateway.dashboard.history import (FleetHistory, HistorySampler, history_router,
                                       redis_snapshot_reader)
from kvfleet.gateway.dashboard.metrics import (GENERATION_ENDPOINTS, GatewayMetrics, RejectionCounter,
                                       metrics_route)
from kvfleet.gateway.dashboard.router import dashboard_router
from kvfleet.gateway.fleet.client import EngineClient
from kvfleet.gateway.fleet.redis_client import RedisEngineClient
from kvfleet.gateway.fleet.redis_context import RedisContext
from kvfleet.gateway.http.errors import install_error_handlers
from kvfleet.gateway.http.request_id import RequestIdMiddleware
from kvfleet.gateway.http.tracing import TraceMiddleware
from kvfleet.gateway.models.adapters import AdapterRegistry, check_startup_adapters
from kvfleet.gateway.models.catalog import ModelCatalog
from kvfleet.gateway.models.loader import ModelLoader, ModelServing
from kvfleet.gateway.models.served import ServedModels
from kvfleet.gateway.models.tokenization import ModelInfo, PromptProcessor
from kvfleet.gateway.openai.batches import batch_router
from kvfleet.gateway.openai.lora_routes import lora_router
from kvfleet.gateway.openai.routes import router
from kvfleet.gateway.openai.serving_chat import ChatServing
from kvfleet.gateway.openai.serving_completion import CompletionServing
from kvfleet.gateway.openai.serving_reattach import ReattachServing
from kvfleet.gateway.openai.utility_routes import utility_router
from kvfleet.gateway.output.background import BackgroundTasks
from kvfleet.shared import tracing
from kvfleet.shared.models import load_tokenizer, resolve_model_path
from kvfleet.shared.settings import GatewaySettings

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider

log = logging.getLogger(__name__)

SHUTDOWN_DRAIN_S = 5.0  # how long cancellations still in flight may take at shutdown


def create_app(settings: GatewaySettings, client: EngineClient | None = None, tokenizer=None,
               *, model_info: ModelInfo | None = None, redis: RedisContext | None = None,
               tracer_provider: TracerProvider | None = None) -> FastAPI:
    """The app. Its one Redis context (`redis`; without one and without `client`, built here from
    settings and closed with the app) serves the engine client, API keys, rate limits, the
    dashboard and the batch routes. Without `client`, a RedisEngineClient on that context
    (connected in the lifespan). A `client` without `redis` (a fake, in tests) makes an app
    without Redis: settings' API keys only, no rate limits, no dashboard, batch routes are 503s.
    Without `tokenizer`, the default model's; without `model_info`, read from the model's config.
    Start-up adapters (`lora_modules`) are checked here: a bad one raises ValueError. Traces
    go to `tracer_provider`, else to the one `--otlp-traces-endpoint` makes (shut down with the
    app); with neither, none (shared/tracing.py)."""
    owned_redis = None
    owned_provider = None
    if tracer_provider is None:
        tracer_provider = owned_provider = tracing.tracer_provider(
            settings.otlp_traces_endpoint, tracing.GATEWAY_SERVICE)
    if client is None:
        if redis is None:
            redis = owned_redis = RedisContext.from_settings(settings)
        client = RedisEngineClient.from_settings(settings, redis)
    if tokenizer is None or model_info is None:
        model_path = resolve_model_path(settings.model, settings.cache_dir, weights=False)
        tokenizer = tokenizer or load_tokenizer(model_path)
        model_info = model_info or ModelInfo.from_pretrained(
            settings.served_names()[0], model_path, tokenizer)
    served_id = model_info.served_id  # the first served name: the others are its aliases
    pinned = check_startup_adapters(settings, served_id)
    background = BackgroundTasks()
    samplers: list[HistorySampler] = []
    prefix_router = getattr(client, "router", None)  # --routing affinity or random

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        default.processor.prepare_offload()  # before the first request, not on its way
        await client.start()
        if prefix_router is not None:  # its index ready by the first request
            prefix_router.follow(served_id)
        await adapters.pin(pinned)
        await catalog.refresh()  # the live workers' models known by the first request
        catalog.start()
        for sampler in samplers:
            sampler.start()
        try:
            yield
        finally:
            for sampler in samplers:
                await sampler.stop()
            await adapters.close()
            await catalog.close()
            try:
                await asyncio.wait_for(background.drain(), SHUTDOWN_DRAIN_S)
            except TimeoutError:
                log.warning("shutdown: cancellations still in flight were dropped")
            await client.close()
            if owned_redis is not None:
                await owned_redis.aclose()
            if owned_provider is not None:  # its last spans exported
                await asyncio.to_thread(owned_provider.shutdown)

    app = FastAPI(title="kvfleet gateway", lifespan=lifespan)
    metrics = _metrics(client, served_id)
    app.state.client = client
    app.state.model = model_info  # the default model's
    app.state.metrics = metrics
    app.state.started = int(time.time())
    limiter = RateLimiter(redis, settings) if redis is not None else None
    admission = Admission(client, settings, limiter)
    app.state.admission = admission

    def serving_of(processor: PromptProcessor) -> ModelServing:
        """One served model's handlers (the default's here, the others' on first use)."""
        return ModelServing(
            processor,
            CompletionServing(client, processor, settings, background, metrics, admission),
            ChatServing(client, processor, settings, background, metrics, admission))

    default = serving_of(PromptProcessor(tokenizer, model_info))
    models = _served_models(settings, redis, serving_of, default, prefix_router)
    catalog = models.catalog
    adapters = AdapterRegistry(redis, models, settings.max_lora_rank)
    app.state.models = models
    app.state.adapters = adapters
    app.state.completions = default.completions  # the default model's handlers
    app.state.chat = default.chat
    app.state.reattach = ReattachServing(client, models)
    app.state.background = background
    api_keys = ApiKeyStore(settings.api_keys, redis)
    install_error_handlers(app)
    app.include_router(router)
    app.include_router(utility_router)
    app.include_router(lora_router)
    app.include_router(batch_router(redis, settings))
    app.include_router(admin_router(redis, settings, api_keys))
    app.include_router(metrics_route(metrics))
    if redis is not None:
        metrics.watch_fleet(redis)  # kvfleet_fleet_*: what an autoscaler scales workers on
        # the dashboard shows the default model's workers, queue and latency
        app.include_router(dashboard_router(redis, served_id, metrics,
                                            prefix_router=prefix_router))
        history = FleetHistory(settings.dashboard_history_s, settings.dashboard_sample_s)
        samplers.append(HistorySampler(history, redis_snapshot_reader(redis, served_id), metrics))
        app.state.history = history
        app.include_router(history_router(history))
    # /v1/files takes batch input files and enforces KVFLEET_BATCH_MAX_FILE_BYTES itself.
    app.add_middleware(BodySizeLimit, max_body_bytes=settings.max_body_bytes,
                       exempt_paths=("/v1/files",))
    app.add_middleware(ApiKeyAuth, store=api_keys)
    app.add_middleware(RejectionCounter, metrics=metrics)  # sees every 413
    if tracer_provider is not None:  # a span per generation request, refusals included
        app.add_middleware(TraceMiddleware, tracer=tracer_provider.get_tracer("kvfleet.gateway"),
                           paths=GENERATION_ENDPOINTS)
    app.add_middleware(RequestIdMiddleware)  # outermost: every answer carries X-Request-Id
    return app


def _metrics(client: EngineClient, served_id: str) -> GatewayMetrics:
    """The gateway's metrics, watching what the engine client has of a Redis fleet."""
    metrics = GatewayMetrics(served_id)
    if getattr(client, "homes", None) is not None:  # a Redis fleet with several stream shards
        metrics.watch_shard_shares(client.homes)
    if getattr(client, "fanout", None) is not None:  # a Redis fleet
        metrics.watch_fanout(client.fanout)
    if getattr(client, "router", None) is not None:  # --routing affinity or random
        metrics.watch_router(client.router)
    return metrics


def _served_models(settings: GatewaySettings, redis: RedisContext | None,
                   serving_of: Callable[[PromptProcessor], ModelServing], default: ModelServing,
                   prefix_router) -> ServedModels:
    """The default model (loaded; its other served names as aliases) and the fleet's other models
    and adapters (read from Redis; the router follows each model as soon as a live worker serves
    it)."""
    aliases = [name for name in settings.served_names() if name != default.info.served_id]
    catalog = ModelCatalog(default.info.served_id, settings.model, redis, aliases=aliases)
    if prefix_router is not None:
        catalog.on_new_model.append(prefix_router.follow)
    loader = ModelLoader(serving_of, settings.cache_dir)
    loader.add(default)
    return ServedModels(catalog, loader)


# Generation thresholds of the cyclic garbage collector while serving (CPython's: 700, 10, 10).
# Young collections stay as frequent; a middle one scans at most 2 × 700 objects, not 10 × 700;
# a full one runs after 1,000 middle ones instead of 10 (CPython also waits until the objects
# that survived since the last full one are a quarter of the heap).
GC_THRESHOLDS = (700, 2, 1000)


def tune_gc_for_serving() -> None:
    """Keep the cyclic garbage collector from stalling the event loop; call it once the app is
    built, before it serves (`serve()` does).

    A collection stops every stream on the loop, and its time grows with the objects it scans.
    The start-up heap (tokenizer, transformers, torch: by far the most objects) goes to the
    permanent generation, so no collection scans it again: it lives as long as the process
    anyway. With thousands of open streams a full collection still scans as many objects again
    (a stall every stream feels): it is made rare. That is safe because a finished request's
    objects are freed by reference counting: the benchmark's full collections found almost no
    cyclic objects (docs/BENCHMARKS.md, "Gateway under load").
    """
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


def serve(settings: GatewaySettings) -> None:
    """Run the gateway with uvicorn on settings.host:settings.port (`kvfleet gateway`)."""
    import uvicorn

    logging.basicConfig(level=settings.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        app = create_app(settings)
    except ValueError as exc:  # a setting that cannot serve (a bad --lora-modules adapter)
        raise SystemExit(f"kvfleet gateway: {exc}") from None
    tune_gc_for_serving()
    log.info("gateway for %s on http://%s:%d", app.state.model.served_id, settings.host,
             settings.port)
    uvicorn.run(app, host=settings.host, port=settings.port,
                log_level=settings.log_level.lower(), timeout_graceful_shutdown=10)
