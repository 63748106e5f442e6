"""Start one worker process: load the model into an engine, then serve the model's streams."""

from __future__ import annotations

import dataclasses
import functools
import gc
import logging
import signal
import socket
import threading

import torch

from kvfleet.shared import tracing
from kvfleet.shared.models import resolve_model_path
from kvfleet.shared.settings import WorkerSettings
from kvfleet.shared.redis_connect import connect
from kvfleet.worker.cpu_share import cpu_share
from kvfleet.worker.engine.attention import resolve_backend_name
from kvfleet.worker.engine.memory.device import resolve_device
from kvfleet.worker.engine.core.config import EngineConfig
from kvfleet.worker.engine.engine import Engine, load_pretrained
from kvfleet.worker.engine.core.pace import warm_up
from kvfleet.worker.process.tp_rank import launch_engine
from kvfleet.worker.handoff.transfer import TcpTransferPlane
from kvfleet.worker.metrics import WorkerMetrics
from kvfleet.worker.protocol import WorkerProtocol
from kvfleet.worker.process.service import WorkerService

log = logging.getLogger("kvfleet.worker")


def check_device_settings(config: EngineConfig) -> None:
    """Refuse a device and attention backend that cannot run together (the Triton kernel on a
    CPU) before the model loads, with the reason, instead of failing every request's first step."""
    try:
        resolve_backend_name(config.model.attention_backend, resolve_device(config.model.device))
    except (ValueError, RuntimeError) as exc:
        raise SystemExit(f"kvfleet worker: {exc}") from None


def build_engine(settings: WorkerSettings) -> Engine:
    from transformers import AutoTokenizer

    config = settings.engine_config()
    check_device_settings(config)

    # On CPU: the configured threads, else torch's default (physical cores) capped by this
    # process's share of the machine (its cpuset and its cgroup CPU quota, e.g. a container's).
    # With tensor parallelism the ranks share them (each rank is a process of its own).
    threads = settings.num_threads if settings.num_threads > 0 else \
        min(torch.get_num_threads(), cpu_share())
    threads = max(1, threads // settings.tensor_parallel_size)
    if threads != torch.get_num_threads():
        log.info("torch threads: %d%s", threads, " per rank" if settings.tensor_parallel_size > 1
                 else "")
        torch.set_num_threads(threads)
    path = resolve_model_path(settings.model, settings.cache_dir)
    tokenizer = AutoTokenizer.from_pretrained(path)
    config = with_draft_model_path(config, tokenizer, settings.cache_dir)
    # every rank loads its own copy (with one rank: this process)
    load = functools.partial(load_pretrained, path, config.model.dtype, config.model.device,
                             config.model.load_format)
    engine = launch_engine(load, config, tokenizer=tokenizer, num_threads=threads)  # logs its budget
    if config.pace.pace_warmup and engine.pace.enabled:
        log.info("pace warm-up: %.1f s; step cost %s", warm_up(engine),
                 engine.pace.curve().to_json())
    return engine


def freeze_startup_heap() -> None:
    """Put the start-up heap (torch, transformers, the tokenizer, the model's modules: about half a
    million objects with the default model) beyond the cyclic collector's reach, once the engine
    is built. A full collection scanned all of it, 0.26-0.31 s on a 2-core Zen 4 (docs/
    BENCHMARKS.md, "A workload's floor"): a pause inside a step, which every stream sees as one
    long gap. It lives as long as the process anyway. The thresholds stay CPython's: collections
    now scan only what serving made, and a finished request's objects are freed by reference
    counting as before (the gateway does the same: gateway/app.py, tune_gc_for_serving)."""
    gc.collect()
    gc.freeze()


def with_draft_model_path(config: EngineConfig, tokenizer, cache_dir) -> EngineConfig:
    """The draft model of `--speculative-config` resolved as `--model` is (a directory, the
    default model, an id in the local HF cache); a draft whose tokenizer differs from the
    model's is refused at start-up (its proposals would be other tokens)."""
    from transformers import AutoTokenizer

    spec = config.speculative_config
    if spec is None or spec.model is None:
        return config
    path = resolve_model_path(spec.model, cache_dir)
    try:
        draft_vocab = AutoTokenizer.from_pretrained(path).get_vocab()
    except (OSError, ValueError) as exc:
        raise SystemExit(f"kvfleet worker: draft model {spec.model!r}: {exc}") from None
    if draft_vocab != tokenizer.get_vocab():
        raise SystemExit(f"kvfleet worker: draft model {spec.model!r} has another tokenizer "
                         "than the model's")
    return dataclasses.replace(config, speculative_config=spec.model_copy(update={"model": path}))


def run_worker(settings: WorkerSettings, stop: threading.Event | None = None,
               drain: threading.Event | None = None) -> None:
    """Serve until SIGINT (at once: unfinished requests resume elsewhere from checkpoints) or
    SIGTERM (a drain: streams move to peers with their KV, the rest finish within
    --drain-timeout-s; a second SIGTERM stops at once), or until `stop` is set."""
    if not settings.redis_url:
        raise SystemExit("kvfleet worker: set --redis-url or KVFLEET_REDIS_URL")
    stop = stop or threading.Event()
    drain = drain or threading.Event()
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, lambda *_: stop.set())
        signal.signal(signal.SIGTERM, lambda *_: stop.set() if drain.is_set() else drain.set())
    worker_id = settings.resolved_worker_id()
    try:  # --otlp-traces-endpoint: this worker's spans (shared/tracing.py); checked before loading
        provider = tracing.tracer_provider(settings.otlp_traces_endpoint, tracing.WORKER_SERVICE,
                                           worker_id)
    except ValueError as exc:
        raise SystemExit(f"kvfleet worker: {exc}") from None
    engine = build_engine(settings)
    freeze_startup_heap()
    try:
        _serve(settings, engine, worker_id, stop, drain, provider)
    finally:
        engine.close()  # tensor-parallel ranks stop with rank 0
        if provider is not None:
            provider.shutdown()  # its last spans exported


def worker_protocol(settings: WorkerSettings, client, worker_id: str,
                    numerics: str = "") -> WorkerProtocol:
    """The worker's side of the fleet's Redis, for the model's first served name
    (`--served-model-name`, else its served id): its streams, heartbeat, announced blocks."""
    return WorkerProtocol(client, settings.keys(), settings.served_names()[0], worker_id,
                          result_ttl_s=settings.result_ttl_s,
                          steal_after_ms=settings.steal_after_ms,
                          affinity_steal_after_ms=settings.affinity_steal_after_ms,
                          owners_refresh_s=settings.heartbeat_interval_s,
                          owner_gone_grace_s=settings.heartbeat_ttl_s, numerics=numerics)


def _serve(settings: WorkerSettings, engine: Engine, worker_id: str,
           stop: threading.Event, drain: threading.Event, tracer_provider=None) -> None:
    # Socket timeout above the blocking XREADGROUP's BLOCK, so a quiet stream never times out.
    client = connect(settings.redis_url, socket_timeout=10, socket_connect_timeout=5,
                     health_check_interval=30)
    protocol = worker_protocol(settings, client, worker_id, engine.numerics.fingerprint)
    metrics = WorkerMetrics(worker_id, protocol.model, settings.cost_per_hour)
    metrics_url = None
    if settings.metrics_port >= 0:
        port = metrics.serve(settings.metrics_port, settings.metrics_host)
        host = settings.metrics_advertise_host or socket.gethostname()
        metrics_url = f"http://{host}:{port}/metrics"
        log.info("metrics at %s", metrics_url)
    plane = None
    if settings.handoff_port >= 0:
        plane = TcpTransferPlane(settings.handoff_host, settings.handoff_port,
                                 settings.handoff_advertise_host)
    log.info("worker %s (role %s, numerics %s) serving %s from %s", worker_id, settings.role,
             protocol.numerics, protocol.model, settings.redis_url)
    service = WorkerService(settings, engine, client, protocol, metrics, metrics_url, plane,
                            drain=drain, tracer_provider=tracer_provider)
    if service.handoffs.addr:
        log.info("KV transfer plane at %s", service.handoffs.addr)
    service.run(stop)
    log.info("worker %s stopped", worker_id)
