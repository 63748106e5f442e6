"""The batch worker process: an rq worker on the batch queue, plus a reaper thread that requeues
batches whose job died (their lease expired) so they resume where they stopped.

The worker is rq's SimpleWorker: a batch job is I/O (HTTP to the gateway), and running it in the
worker's own process means the process's death is the job's death: no forked work horse lives on,
holding the batch, after its parent was killed.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import uuid

from redis import Redis
from redis.exceptions import RedisError
from rq import Queue, SimpleWorker

from kvfleet.batch.jobs import requeue_orphans
from kvfleet.batch.store import BatchStore
from kvfleet.shared.redis_connect import connect
from kvfleet.shared.settings import BatchSettings
from kvfleet.shared.wire import Keys

log = logging.getLogger(__name__)


def run_batch_worker(settings: BatchSettings, burst: bool = False) -> int:
    if not settings.redis_url:
        raise SystemExit("kvfleet batch-worker: needs --redis-url (or KVFLEET_REDIS_URL)")
    keys = settings.keys()
    # rq needs a single Redis: --batch-redis-url when the fleet's is a cluster
    rq_redis = Redis.from_url(settings.batch_redis_url or settings.redis_url)  # rq raises its socket timeout for BLPOP
    queue = Queue(keys.batch_queue(), connection=rq_redis)
    name = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    worker = SimpleWorker([queue], connection=rq_redis, name=name)
    reaper = Reaper(settings, keys, worker)
    reaper.start()
    log.info("batch worker %s on queue %s, sending lines to %s", name, queue.name,
             settings.gateway_url)
    try:
        worker.work(burst=burst, logging_level=settings.log_level.upper(), with_scheduler=False)
    finally:
        reaper.stop()
    return 0


class Reaper:
    """Every half lease TTL: requeue batches that have no live job (one reaper at a time across
    the fleet, by a short Redis lock), and keep this worker's rq heartbeat fresh while a long job
    runs in the main thread (SimpleWorker does not beat during a job)."""

    def __init__(self, settings: BatchSettings, keys: Keys, worker: SimpleWorker):
        self._interval_s = settings.batch_lease_ttl_s / 2
        self._lease_ttl_s = settings.batch_lease_ttl_s
        self._redis = connect(settings.redis_url, socket_connect_timeout=5, socket_timeout=10)
        self._store = BatchStore(self._redis, keys, settings.batch_ttl_s)
        self._queue = Queue(keys.batch_queue(), connection=Redis.from_url(
            settings.batch_redis_url or settings.redis_url, socket_connect_timeout=5,
            socket_timeout=10))
        self._lock_key = keys.batch_reaper()
        self._worker = worker
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="batch-reaper", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while True:
            try:
                self.reap_once()
                if self._worker.get_current_job_id() is not None:
                    self._worker.heartbeat()
            except RedisError as exc:
                log.warning("reaper: Redis error %r; retrying", exc)
            except Exception:  # noqa: BLE001 - the reaper must outlive any one bad record
                log.exception("reaper: unexpected error")
            if self._stop.wait(self._interval_s):
                return

    def reap_once(self) -> list[str]:
        lock_ms = max(int(self._interval_s * 1000 * 0.9), 1)
        if not self._redis.set(self._lock_key, "1", nx=True, px=lock_ms):
            return []
        return requeue_orphans(self._store, self._queue, self._lease_ttl_s)

