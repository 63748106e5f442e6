"""The gateway's cancellations, published in batches by one task (docs/ARCHITECTURE.md,
"Cancellation").

A client that goes away makes the gateway publish its request's id on the cancel channel. When
hundreds of clients go away in the same instant (a load generator stopping, a proxy dropping its
connections), one command per id would take as many of the gateway's pooled Redis connections at
once: the cancellations beyond the pool failed (and were lost), and the requests still in flight
had no connection left for their own commands (a 503). Here the ids wait in one set, and one task
sends what has gathered as a single pipeline (one PUBLISH, or SPUBLISH on a cluster, per id: the
protocol is unchanged) on one connection, then the next batch. A batch that fails (Redis away, a
failover) is sent again, with a backoff, until Redis takes it: a cancellation is given up only
when the request it cancels cannot be running any more (its deadline passed) or the gateway
shuts down."""

from __future__ import annotations

import asyncio
import logging
import time

from kvfleet.gateway.fleet.tasks import cancel_requested, stop_task
from kvfleet.shared.redis_connect import AsyncClient

log = logging.getLogger(__name__)

BATCH_MAX = 512  # ids in one pipeline at most
RETRY_MIN_S = 0.05  # the first wait after a batch failed; doubled after each failure in a row
RETRY_MAX_S = 1.0


class CancelPublisher:
    """Publishes request ids on the cancel channel in batches, from one task, retrying failed
    batches; a caller waits until its id was published (`publish`), or given up."""

    def __init__(self, redis: AsyncClient, channel: str, *, sharded: bool,
                 command_timeout_s: float, give_up_s: float):
        self._redis = redis
        self._channel = channel
        self._sharded = sharded  # SPUBLISH on a cluster
        self._command_timeout_s = command_timeout_s
        self._give_up_s = give_up_s  # how long an id may wait (the requests' longest life)
        self._pending: dict[str, float] = {}  # id -> when it is given up (monotonic), FIFO
        self._done: dict[str, asyncio.Future] = {}  # id -> resolved True (published) / False
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._closed = False

    @property
    def pending(self) -> int:
        """Ids waiting to be published."""
        return len(self._pending)

    async def publish(self, req_id: str) -> bool:
        """Publish `req_id` with the next batch and wait for it: True once Redis took it, False if
        it was given up. The id stays queued when the caller stops waiting (its task cancelled);
        an id already waiting is not queued twice."""
        if self._closed:
            log.warning("cancellation of %s after the gateway's fleet client closed: dropped",
                        req_id)
            return False
        done = self._done.get(req_id)
        if done is None:
            done = self._done[req_id] = asyncio.get_running_loop().create_future()
            self._pending[req_id] = time.monotonic() + self._give_up_s
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(), name="gateway-cancels")
        self._wake.set()
        return await asyncio.shield(done)

    async def close(self, flush_s: float | None = None) -> None:
        """Publish what is waiting (for up to `flush_s`, the command timeout by default), then stop;
        ids still waiting are given up."""
        self._closed = True
        if self._task is not None:
            if self._pending:
                waiting = [self._done[req_id] for req_id in self._pending]
                await asyncio.wait(waiting, timeout=self._command_timeout_s if flush_s is None
                                   else flush_s)
            await stop_task(self._task)
            self._task = None
        if self._pending:
            log.warning("shutdown: %d cancellations could not be published", len(self._pending))
            self._resolve(list(self._pending), False)

    async def _run(self) -> None:
        delay_s = RETRY_MIN_S
        failing_since: float | None = None
        while True:
            if not self._pending:
                self._wake.clear()
                await self._wake.wait()
            await asyncio.sleep(0)  # the ids handed in this same turn of the loop join the batch
            batch = []
            for req_id in self._pending:
                batch.append(req_id)
                if len(batch) == BATCH_MAX:
                    break
            try:
                await self._send(batch)
            except Exception as exc:  # noqa: BLE001 - the task must outlive any one failure
                # (redis-py's cluster client has raised RuntimeError while rebuilding its node
                # map after a failover): a dead task would leave every later cancel unsent
                if failing_since is None:
                    failing_since = time.monotonic()
                    log.warning("could not publish %d cancellations (%r): retrying until Redis "
                                "takes them", len(self._pending), exc)
                self._give_up_expired()
                if cancel_requested():  # a cancel redis-py swallowed (gateway/fleet/tasks.py)
                    raise asyncio.CancelledError from None
                await asyncio.sleep(delay_s)
                delay_s = min(delay_s * 2, RETRY_MAX_S)
                continue
            if failing_since is not None:
                log.info("cancellations published again after %.1f s of failures",
                         time.monotonic() - failing_since)
                failing_since = None
            delay_s = RETRY_MIN_S
            self._resolve(batch, True)
            if cancel_requested():
                raise asyncio.CancelledError

    async def _send(self, batch: list[str]) -> None:
        """One pipeline of one publish per id, on one connection (per node, on a cluster);
        a batch sent twice (a failure after Redis took part of it) cancels nothing twice: a
        worker ignores the id of a request it does not run."""
        async with asyncio.timeout(self._command_timeout_s * 2):
            pipe = self._redis.pipeline(transaction=False)
            for req_id in batch:
                if self._sharded:
                    pipe.spublish(self._channel, req_id)
                else:
                    pipe.publish(self._channel, req_id)
            await pipe.execute()

    def _give_up_expired(self) -> None:
        now = time.monotonic()
        expired = [req_id for req_id, give_up in self._pending.items() if give_up <= now]
        if expired:
            log.warning("gave up %d cancellations that Redis did not take before their "
                        "requests' deadlines (e.g. %s)", len(expired), expired[0])
            self._resolve(expired, False)

    def _resolve(self, req_ids: list[str], published: bool) -> None:
        for req_id in req_ids:
            self._pending.pop(req_id, None)
            done = self._done.pop(req_id, None)
            if done is not None and not done.done():
                done.set_result(published)
