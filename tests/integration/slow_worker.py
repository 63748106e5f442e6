"""A worker process on the tiny test model whose every engine step takes at least `--step-s`:
what a real model's long prefill steps look like to the fleet protocol, in a test's budget.

    python -m tests.integration.slow_worker --redis-url URL --worker-id ID --step-s 0.6 ...
"""

from __future__ import annotations

import argparse
import functools
import logging
import signal
import threading
import time

import redis
import torch

from kvfleet.shared.settings import WorkerSettings
from kvfleet.shared.wire import Keys
from tests.engine.tiny_models import build_model
from kvfleet.worker.engine.engine import Engine, EngineConfig
from kvfleet.worker.process.tp_rank import launch_engine
from kvfleet.worker.metrics import WorkerMetrics
from kvfleet.worker.protocol import WorkerProtocol
from kvfleet.worker.process.service import WorkerService

MODEL = "tiny"


class SlowSteps:
    """The engine, with every step padded to at least `step_s` seconds (sleeping, as a forward
    pass does, without the GIL)."""

    def __init__(self, engine: Engine, step_s: float):
        self._engine = engine
        self._step_s = step_s

    def step(self):
        started = time.monotonic()
        outputs = self._engine.step()
        time.sleep(max(0.0, self._step_s - (time.monotonic() - started)))
        return outputs

    def __getattr__(self, name):
        return getattr(self._engine, name)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--redis-url", required=True)
    parser.add_argument("--worker-id", required=True)
    parser.add_argument("--step-s", type=float, required=True)
    parser.add_argument("--heartbeat-ttl-s", type=float, required=True)
    parser.add_argument("--heartbeat-interval-s", type=float, default=0.1)
    parser.add_argument("--max-running", type=int, default=4)
    parser.add_argument("--metrics-port", type=int, required=True)
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    torch.set_num_threads(1)
    settings = WorkerSettings(redis_url=args.redis_url, model=MODEL, worker_id=args.worker_id,
                              heartbeat_ttl_s=args.heartbeat_ttl_s,
                              heartbeat_interval_s=args.heartbeat_interval_s, read_block_ms=50,
                              max_running=args.max_running)
    client = redis.Redis.from_url(args.redis_url)
    protocol = WorkerProtocol(client, Keys(), MODEL, args.worker_id, result_ttl_s=600)
    metrics = WorkerMetrics(args.worker_id, MODEL)
    metrics.serve(args.metrics_port, "127.0.0.1")
    config = EngineConfig(device="cpu", dtype="float32", num_blocks=256, block_size=4,
                          tensor_parallel_size=args.tensor_parallel_size)
    # every rank builds the seeded model itself (one rank: the same weights in this process)
    engine = SlowSteps(launch_engine(functools.partial(build_model, "llama"), config, num_threads=1),
                       args.step_s)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        WorkerService(settings, engine, client, protocol, metrics).run(stop)
    finally:
        engine.close()


if __name__ == "__main__":
    main()
