"""Simulated workers in one process: `kvfleet worker --sim-workers N` (and `kvfleet up
--sim-workers N`, which starts such processes of at most `checks.WORKERS_PER_PROCESS` each).

Each simulated worker is the real `WorkerService` (its Redis protocol, heartbeat, admission by KV
room and pace, prefix announcements, checkpoints and resume, drain, timelines, metrics) over a
`SimEngine` (engine.py) with a name of its own (`<worker id>-s<i>`) and a Redis connection of its
own; its loop and heartbeat run in threads of this process. The model is read as a gateway
reads it (its config and tokenizer, never weights: `random:llama-3.1-70b` costs nothing to
load), the cost model built once for them all. Their metrics are served together on one
`/metrics` endpoint (each series carries its worker's label).

SIGINT stops every simulated worker at once (their requests resume from checkpoints elsewhere);
SIGTERM drains them all (a second stops them); `kvfleet drain <id>` drains one.
"""

from __future__ import annotations

import logging
import signal
import socket
import sys
import threading
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, start_http_server

from kvfleet.shared import tracing
from kvfleet.shared.model_shapes import is_random_model, shape_name
from kvfleet.shared.models import load_tokenizer, resolve_model_path
from kvfleet.shared.redis_connect import connect
from kvfleet.shared.settings import WorkerSettings
from kvfleet.shared.wire import Heartbeat
from kvfleet.worker.engine.model.model_prep import max_model_len_of
from kvfleet.worker.engine.core.pace import warm_up
from kvfleet.worker.sim.checks import HEARTBEAT_SOURCE, ONE_BYTE_KV, check_sim_settings
from kvfleet.worker.sim.clock import StepClock
from kvfleet.worker.sim.cost import (
    RooflineCost, measured_cost_from_file, measured_cost_from_heartbeat, model_shape)
from kvfleet.worker.handoff.transfer import TcpTransferPlane
from kvfleet.worker.sim.engine import DEFAULT_BLOCK_SIZE, SimEngine
from kvfleet.worker.sim.tokens import AnswerLengths

log = logging.getLogger("kvfleet.sim")

GIL_SWITCH_INTERVAL_S = 0.0005

@dataclass(frozen=True)
class SimModel:
    """What simulated workers read of the model: its config, tokenizer, vocabulary and stops."""

    config: dict
    path: str  # config and tokenizer (no weights needed)
    vocab_size: int
    eos_token_ids: list[int]
    max_model_len: int


def read_model(settings: WorkerSettings) -> SimModel:
    from transformers import AutoConfig

    path = resolve_model_path(settings.model, settings.cache_dir, weights=False)
    config = AutoConfig.from_pretrained(path)
    eos = getattr(config, "eos_token_id", None)
    eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    return SimModel(config.to_dict(), path, config.vocab_size, eos, max_model_len_of(config))


def build_cost(settings: WorkerSettings, model: SimModel, client=None):
    """The cost model: the roofline of --sim-device for the model, or the measured curve of
    --sim-step-cost (a file, or `worker:<id>`'s heartbeat in the fleet's Redis)."""
    block_size = settings.block_size or DEFAULT_BLOCK_SIZE
    if settings.sim_device:
        kv_bytes = 1 if settings.kv_dtype in ONE_BYTE_KV else 2
        shape = shape_name(settings.model) if is_random_model(settings.model) else model.config
        return RooflineCost(settings.sim_device, shape, settings.tensor_parallel_size,
                            kv_bytes=kv_bytes, block_size=block_size)
    source = settings.sim_step_cost
    if not source.startswith(HEARTBEAT_SOURCE):
        return measured_cost_from_file(source)
    worker_id = source[len(HEARTBEAT_SOURCE):]
    raw = client.hgetall(settings.keys().worker(worker_id)) if client is not None else {}
    if not raw:
        raise ValueError(f"--sim-step-cost {source}: no live worker {worker_id!r} in Redis")
    return measured_cost_from_heartbeat(Heartbeat.decode(raw), f"worker {worker_id}")


def pool_blocks(settings: WorkerSettings, model: SimModel, cost) -> tuple[int, str]:
    """The simulated KV pool in blocks, and where its size comes from."""
    config = settings.engine_config()
    block_size = settings.block_size or DEFAULT_BLOCK_SIZE
    if isinstance(cost, RooflineCost):
        use, tokens = config.cache.gpu_memory_utilization, config.scheduler.max_batched_tokens
        pool = cost.kv_pool_bytes(use, tokens)
        return cost.kv_blocks(block_size, use, tokens), (
            f"{pool / 2**30:.1f} GiB a device: {cost.device.name}'s memory x {use:g} less the "
            "weights and activations")
    kv_bytes = 1 if settings.kv_dtype in ONE_BYTE_KV else 2
    per_token = model_shape(model.config).kv_bytes_per_token(kv_bytes)
    kv_memory = config.cache.kv_memory_bytes
    blocks = kv_memory // (block_size * per_token)
    if blocks < 1:
        raise ValueError(f"--kv-memory {kv_memory} B holds no block of {block_size} "
                         f"tokens at {per_token} B a token")
    return blocks, f"--kv-memory {kv_memory / 2**30:.2f} GiB"


# The fleet's own timings, in real seconds on a real fleet: under a time scale k they stand for
# modelled time as the steps do, so they run k times longer too (a heartbeat every k s at k, a
# steal after 250 x k ms...): the simulated fleet's protocol keeps its proportions to the steps,
# and the host does k times less of that work a real second.
SCALED_TIMINGS = ("heartbeat_interval_s", "heartbeat_ttl_s", "steal_after_ms",
                  "affinity_steal_after_ms", "resume_prefer_ms", "numerics_prefer_ms",
                  "publish_interval_ms", "drain_timeout_s", "handoff_lease_s")


def scaled_timings(settings: WorkerSettings) -> WorkerSettings:
    """The settings with the fleet's timings (`SCALED_TIMINGS`) times --sim-time-scale."""
    k = settings.sim_time_scale
    if k == 1:
        return settings
    return settings.model_copy(update={name: type(getattr(settings, name))(
        getattr(settings, name) * k) for name in SCALED_TIMINGS})


def build_sim_engine(settings: WorkerSettings, model: SimModel, cost,
                     tokenizer=None) -> SimEngine:
    blocks, note = pool_blocks(settings, model, cost)
    kv_bytes = 1 if settings.kv_dtype in ONE_BYTE_KV else 2
    per_token = (cost.shape if isinstance(cost, RooflineCost) else model_shape(model.config)
                 ).kv_bytes_per_token(kv_bytes)
    return SimEngine(settings.engine_config(), cost, vocab_size=model.vocab_size,
                       eos_token_ids=model.eos_token_ids, max_model_len=model.max_model_len,
                       num_blocks=blocks,
                       answer_lengths=AnswerLengths.parse(settings.sim_answer_tokens),
                       clock=StepClock(settings.sim_time_scale), tokenizer=tokenizer,
                       seed=settings.sim_seed, pool_note=note, kv_bytes_per_token=per_token)


def run_sim_workers(settings: WorkerSettings, stop: threading.Event | None = None) -> None:
    """Run `--sim-workers` simulated workers (at least one) until SIGINT, SIGTERM's drains end,
    or `stop` is set."""
    from kvfleet.worker.process.main import worker_protocol
    from kvfleet.worker.metrics import WorkerMetrics
    from kvfleet.worker.process.service import WorkerService

    if not settings.redis_url:
        raise SystemExit("kvfleet worker: set --redis-url or KVFLEET_REDIS_URL")
    check_sim_settings(settings)
    # a step's end is a thread waking from its sleep: it waits for the GIL at most this long
    # (Python's default is 5 ms, a third of a modelled H100 decode step)
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    count = settings.sim_workers or 1
    stop = stop or threading.Event()
    base_id = settings.resolved_worker_id()
    ids = [base_id] if count == 1 else [f"{base_id}-s{i}" for i in range(count)]
    stops = {worker_id: threading.Event() for worker_id in ids}
    drains = {worker_id: threading.Event() for worker_id in ids}
    if threading.current_thread() is threading.main_thread():
        def on_term(*_):
            for worker_id in ids:
                (stops if drains[worker_id].is_set() else drains)[worker_id].set()
        signal.signal(signal.SIGINT, lambda *_: stop.set())
        signal.signal(signal.SIGTERM, on_term)
    try:  # --otlp-traces-endpoint: the simulated workers' spans, one provider for the process
        provider = tracing.tracer_provider(settings.otlp_traces_endpoint, tracing.WORKER_SERVICE,
                                           base_id)
    except ValueError as exc:
        raise SystemExit(f"kvfleet worker: {exc}") from None
    model = read_model(settings)
    tokenizer = load_tokenizer(model.path)  # for stop strings; shared, read only
    setup = connect(settings.redis_url, socket_timeout=10, socket_connect_timeout=5)
    try:
        cost = build_cost(settings, model, setup)
    except ValueError as exc:
        raise SystemExit(f"kvfleet worker: {exc}") from None
    finally:
        setup.close()
    try:
        pool_blocks(settings, model, cost)
    except ValueError as exc:
        raise SystemExit(f"kvfleet worker: {exc}") from None
    log.info("%d simulated worker(s) of %s: %s; time scale %g", count, settings.served_names()[0],
             cost.describe(), settings.sim_time_scale)
    registry, metrics_url = CollectorRegistry(auto_describe=False), None
    if settings.metrics_port >= 0:
        server, _ = start_http_server(settings.metrics_port, addr=settings.metrics_host,
                                      registry=registry)
        host = settings.metrics_advertise_host or socket.gethostname()
        metrics_url = f"http://{host}:{server.server_port}/metrics"
        log.info("metrics of the simulated workers at %s", metrics_url)

    def serve(worker_id: str) -> None:
        mine = scaled_timings(settings).model_copy(update={"worker_id": worker_id})
        engine = build_sim_engine(mine, model, cost, tokenizer)
        config = engine.config
        if config.pace.pace_warmup and engine.pace.enabled:
            warm_up(engine)
        client = connect(settings.redis_url, socket_timeout=10, socket_connect_timeout=5,
                         health_check_interval=30)
        protocol = worker_protocol(mine, client, worker_id, engine.numerics.fingerprint)
        metrics = WorkerMetrics(worker_id, protocol.model, settings.cost_per_hour)
        registry.register(metrics.registry)
        plane = None if settings.handoff_port < 0 else TcpTransferPlane(
            settings.handoff_host, settings.handoff_port, settings.handoff_advertise_host)
        service = WorkerService(mine, engine, client, protocol, metrics, metrics_url, plane,
                                drain=drains[worker_id], tracer_provider=provider)
        try:
            service.run(stops[worker_id])
        except Exception:
            log.exception("simulated worker %s failed", worker_id)
            raise
        finally:
            engine.close()
            client.close()

    threads = [threading.Thread(target=serve, args=(worker_id,), name=f"sim-{worker_id}",
                                daemon=True) for worker_id in ids]
    for thread in threads:
        thread.start()
    while any(thread.is_alive() for thread in threads):
        if stop.wait(0.5):
            for event in stops.values():
                event.set()
            for thread in threads:
                thread.join(timeout=30)
            break
    if provider is not None:
        provider.shutdown()  # their last spans exported
    log.info("simulated workers stopped")
