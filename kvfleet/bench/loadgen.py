"""The load generator: replays trace requests against one target at a given load. Open loop
sends each request at its arrival time ÷ rate; a concurrency cap holds at most N in flight (with
rate = inf that is a closed loop: a new request the moment one finishes)."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx

from kvfleet.bench.client import BenchTarget, RequestRecord, stream_request
from kvfleet.bench.trace import TraceRequest

CANCELLED_AT_LIMIT = "cancelled at the duration limit"


@dataclass(frozen=True)
class LoadSpec:
    rate: float = 1.0  # trace time speed-up; inf: no waiting between arrivals
    concurrency: int | None = None  # max requests in flight; None: unlimited
    duration_limit_s: float | None = None  # stop sending, and cancel what runs, after this

    def label(self) -> str:
        if math.isinf(self.rate):
            parts = [] if self.concurrency else ["all at once"]
        else:
            parts = [f"rate {self.rate:g}x"]
        if self.concurrency:
            parts.append(f"concurrency {self.concurrency}")
        return ", ".join(parts)


@dataclass(frozen=True)
class RunResult:
    load: LoadSpec
    records: list[RequestRecord]  # the requests that were sent, in trace order
    duration_s: float  # first send to last finish (or to the duration limit)


async def replay(client: httpx.AsyncClient, target: BenchTarget, requests: list[TraceRequest],
                 load: LoadSpec, on_done: Callable[[], None] = lambda: None) -> RunResult:
    run_start = time.perf_counter()
    deadline = run_start + load.duration_limit_s if load.duration_limit_s else math.inf
    slots = asyncio.Semaphore(load.concurrency) if load.concurrency else None
    records: list[RequestRecord] = []
    tasks: dict[asyncio.Task, RequestRecord] = {}
    for index, request in enumerate(requests):
        scheduled_s = 0.0 if math.isinf(load.rate) else request.arrival_s / load.rate
        if not await _wait_for_turn(run_start + scheduled_s, deadline, slots):
            break
        record = RequestRecord(index, scheduled_s, request.max_tokens)
        records.append(record)
        task = asyncio.create_task(stream_request(client, target, request, record, run_start))
        task.add_done_callback(lambda _task: _release(slots, on_done))
        tasks[task] = record
    await _wait_or_cancel(tasks, deadline)
    return RunResult(load, records, _duration_s(records))


async def _wait_for_turn(send_at: float, deadline: float,
                         slots: asyncio.Semaphore | None) -> bool:
    """Sleep until the arrival time, then until a slot is free; False past the deadline."""
    if send_at >= deadline:
        return False
    await asyncio.sleep(max(0.0, send_at - time.perf_counter()))
    if slots is None:
        return True
    try:
        await asyncio.wait_for(slots.acquire(), timeout=_seconds_left(deadline))
    except TimeoutError:
        return False
    return True


def _release(slots: asyncio.Semaphore | None, on_done: Callable[[], None]) -> None:
    if slots is not None:
        slots.release()
    on_done()


async def _wait_or_cancel(tasks: dict[asyncio.Task, RequestRecord], deadline: float) -> None:
    """Wait for every request; at the deadline cancel the rest and mark their records."""
    if not tasks:
        return
    _, pending = await asyncio.wait(tasks, timeout=_seconds_left(deadline))
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    for task in pending:
        tasks[task].error = CANCELLED_AT_LIMIT


def _seconds_left(deadline: float) -> float | None:
    return None if math.isinf(deadline) else max(0.0, deadline - time.perf_counter())


def _duration_s(records: list[RequestRecord]) -> float:
    finished = [r.finished_at_s for r in records if r.finished_at_s is not None]
    return max(finished, default=0.0)
