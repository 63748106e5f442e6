"""Admission of a generation request before it is enqueued: per-key rate limits, then
backpressure (the queue's expected wait), each a 429 with Retry-After in OpenAI's error shape."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvfleet.gateway.fleet.client import EngineClient, QueueLoad
from kvfleet.gateway.http.errors import TooManyRequests
from kvfleet.shared.settings import GatewaySettings
from kvfleet.shared.wire import GenerationRequest

if TYPE_CHECKING:
    from kvfleet.gateway.admission.auth import Principal
    from kvfleet.gateway.admission.ratelimit import RateLimiter

class QueueWaitEstimator:
    """Expected queue wait = requests queued *ahead* × work per request ÷ fleet tokens/s.

    Ahead = undelivered entries of the model's streams plus what this gateway admitted since the
    last read; a new request's own choices are not ahead of it (they are counted, once, for the
    requests after it), so a request with many choices is admitted by an idle fleet. When a live
    worker promises a pace (`--target-itl-ms`), the requests ahead that fit in the fleet's room at
    that pace start at once and wait ~0: only those beyond the room wait, `(ahead - room) × work
    per request ÷ tokens/s`, so a fleet with room admits a queue its speed alone would refuse.
    With no pace promised, every request ahead waits its share. The depth limit counts them
    (they take room in the queue). The load is read from Redis at most once per `cache_s`, and
    what this gateway admitted since uses up the room, so a burst between two reads cannot slip
    through. With no live worker the wait is unknown (requests must still queue for a worker
    that starts later): only the depth limit applies then.
    """

    def __init__(self, client: EngineClient, model: str, settings: GatewaySettings,
                 clock: Callable[[], float] = time.monotonic):
        self._client = client
        self._model = model
        self._settings = settings
        self._clock = clock
        self._load: QueueLoad | None = None
        self._read_at = -math.inf
        self._admitted_since_read = 0
        self._lock = asyncio.Lock()

    @property
    def enabled(self) -> bool:
        return self._settings.max_queue_wait_s > 0 or self._settings.max_queue_depth > 0

    async def load(self) -> QueueLoad | None:
        if self._clock() - self._read_at >= self._settings.queue_estimate_cache_s:
            async with self._lock:  # concurrent requests share one read
                if self._clock() - self._read_at >= self._settings.queue_estimate_cache_s:
                    self._load = await self._client.queue_load(self._model)
                    self._read_at = self._clock()
                    self._admitted_since_read = 0
        return self._load

    def throughput(self, load: QueueLoad) -> float:
        return max(load.tokens_per_s, self._settings.min_fleet_tokens_per_s, 1e-9)

    async def check(self, num_requests: int) -> None:
        """Raise TooManyRequests when `num_requests` more would wait too long; else count them."""
        if not self.enabled:
            return
        load = await self.load()
        if load is None:  # Redis unreadable: the enqueue itself will say so (503)
            return
        s = self._settings
        ahead = load.undelivered + self._admitted_since_read
        depth = ahead + num_requests
        per_request_s = s.queue_tokens_per_request / self.throughput(load)
        if s.max_queue_depth and depth > s.max_queue_depth and ahead:  # an empty queue takes it
            raise TooManyRequests(
                f"The queue of `{self._model}` is full ({ahead} requests waiting, "
                f"limit {s.max_queue_depth}). Retry later.",
                (depth - s.max_queue_depth) * per_request_s, code="queue_full")
        if s.max_queue_wait_s and load.live_workers:
            waiting = max(ahead - load.pace_room, 0) if load.pace_promised else ahead
            wait_s = waiting * per_request_s
            if wait_s > s.max_queue_wait_s:
                raise TooManyRequests(
                    f"The expected wait in the queue of `{self._model}` is {wait_s:.0f} s "
                    f"(limit {s.max_queue_wait_s:g} s). Retry later.",
                    wait_s - s.max_queue_wait_s, code="queue_wait_too_long")
        self._admitted_since_read += num_requests


class Admission:
    """What a request passes before its enqueue. Backpressure first: a request refused for a full
    queue must not spend the key's rate-limit budget. Each served model has its own queues, so
    its own estimator (made on its first request: only models a request resolved to)."""

    def __init__(self, client: EngineClient, settings: GatewaySettings,
                 limiter: RateLimiter | None = None):
        self._client = client
        self._settings = settings
        self.queues: dict[str, QueueWaitEstimator] = {}
        self.limiter = limiter

    def queue(self, model: str) -> QueueWaitEstimator:
        """The estimator of `model`'s queues (the base model's, for an adapter's requests)."""
        estimator = self.queues.get(model)
        if estimator is None:
            estimator = self.queues[model] = QueueWaitEstimator(self._client, model,
                                                                self._settings)
        return estimator

    async def admit(self, requests: list[GenerationRequest], principal: Principal | None) -> None:
        await self.queue(requests[0].model).check(len(requests))
        if self.limiter is not None and principal is not None:
            tokens = sum(len(r.prompt_token_ids) + r.params.max_tokens for r in requests)
            await self.limiter.check(principal, tokens)
