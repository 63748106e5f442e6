"""Prefix-affinity routing in the gateway (docs/ARCHITECTURE.md, "Prefix-affinity routing"): which
worker's own stream a request goes to, or the shared streams.

`route` runs on the request path and touches no Redis: it hashes the prompt's blocks the way the
workers do (shared/wire/prefix_hash.py, the model's root, the workers' block size), reads the
prefix index (gateway/fleet/prefix_index.py) and the workers' loads, which a background task
refreshes from their heartbeats (only the model's own-stream owners, no SCAN). A worker's load is
the larger of its running + waiting requests + entries in its own streams as its last heartbeat
said, and the requests this gateway routed to it that have not ended yet.

The rule: a worker is eligible while its load after this request stays within `balance` x the
mean (or `LEAST_LOAD_SLACK` above the least loaded worker), and its free KV holds the prompt's
uncached part; among the eligible the longest cached prefix wins, ties to the least loaded. With
fewer than `min_blocks` blocks matched the request goes to the shared streams, where the first
worker with room takes it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from redis.asyncio import Redis

from gateway.fleet.prefix_index import PrefixIndex
from gateway.fleet.tasks import stop_task
from shared.redis_connect import REDIS_FAILURES
from shared.wire import Heartbeat, Keys
from shared.wire.prefix_hash import ANNOUNCE_BYTES, block_hashes, root_hash
from shared.wire.records import text

log = logging.getLogger(__name__)

# A worker may be this many requests above the least loaded one for its cache, however low the
# fleet's mean: at low loads one request more or less costs little and a cache miss a prefill.
LEAST_LOAD_SLACK = 2
LOAD_REFRESH_S = 0.1
MAX_TRACKED = 100_000  # routed requests whose end is awaited  # how often the owners' heartbeats are read


@dataclass
class RouterStats:
    """What this gateway's router did since it started (the metrics read it)."""

    routed: dict[str, int] = field(default_factory=dict)  # by Route.reason
    by_worker: dict[str, int] = field(default_factory=dict)  # requests routed to a worker
    prompt_tokens: int = 0  # of every request routed
    cached_tokens: int = 0  # expected cached at the chosen worker


@dataclass(frozen=True)
class Route:
    """Where one request goes: `worker` (its own stream) or None (the shared streams)."""

    worker: str | None
    cached_tokens: int  # prompt tokens the chosen worker is expected to find in its cache
    reason: str  # "affinity" (a worker holds its prefix), "shared" (none holds enough)
    seconds: float = 0.0  # time spent routing


class WorkerLoads:
    """The live workers of one model and their loads: the larger of what a worker's heartbeat
    last said (running + waiting + entries in its own streams: every gateway's requests, up to a
    heartbeat interval old) and the requests this gateway routed to it that have not ended
    (exact, at once)."""

    def __init__(self) -> None:
        self.beats: dict[str, Heartbeat] = {}
        self.in_flight: dict[str, int] = {}  # worker -> requests routed here, not yet ended

    def update(self, beats: dict[str, Heartbeat]) -> None:
        self.beats = beats

    def routed(self, worker_id: str) -> None:
        self.in_flight[worker_id] = self.in_flight.get(worker_id, 0) + 1

    def ended(self, worker_id: str) -> None:
        left = self.in_flight.get(worker_id, 0) - 1
        if left > 0:
            self.in_flight[worker_id] = left
        else:
            self.in_flight.pop(worker_id, None)

    def load(self, worker_id: str) -> int:
        beat = self.beats[worker_id]
        return max(beat.running + beat.waiting + beat.own_queue,
                   self.in_flight.get(worker_id, 0))


class Router:
    """Routes one gateway's requests; `follow` begins following Redis for a model."""

    def __init__(self, redis: Redis, keys: Keys, *, balance: float = 1.25, min_blocks: int = 1,
                 listing_ttl_ms: int = 10_000):
        self.redis = redis
        self.keys = keys
        self.balance = balance
        self.min_blocks = min_blocks
        self.listing_ttl_ms = listing_ttl_ms
        self.indexes: dict[str, PrefixIndex] = {}
        self.loads: dict[str, WorkerLoads] = {}
        self._roots: dict[str, bytes] = {}
        self._tasks: list[asyncio.Task] = []
        self.stats = RouterStats()
        # request id -> (model, worker) until its stream ends; the oldest forgotten past a cap
        self._routes: dict[str, tuple[str, str]] = {}
        self.observe: Callable[[float], None] | None = None  # each route's seconds (a histogram)

    def follow(self, model: str) -> None:
        """Start following the model's announcements and workers' loads (in the background;
        until the index has its first snapshot, requests go to the shared streams). Call from
        the event loop; a model already followed is left as it is."""
        if model in self.indexes:
            return
        index = PrefixIndex(self.redis, self.keys, model, listing_ttl_ms=self.listing_ttl_ms)
        self.indexes[model] = index
        self.loads[model] = WorkerLoads()
        self._roots[model] = root_hash(model)
        self._tasks.append(asyncio.create_task(index.run(), name=f"prefix-index-{model}"))
        self._tasks.append(asyncio.create_task(self._follow_loads(model),
                                               name=f"worker-loads-{model}"))

    async def close(self) -> None:
        for task in self._tasks:
            await stop_task(task)
        self._tasks = []

    async def _follow_loads(self, model: str) -> None:
        while True:
            try:
                await self.refresh_loads(model)
            except asyncio.CancelledError:
                raise
            except (*REDIS_FAILURES, OSError) as exc:
                log.debug("could not read the workers' heartbeats: %r", exc)
            await asyncio.sleep(LOAD_REFRESH_S)

    async def refresh_loads(self, model: str) -> None:
        """Read the heartbeats of the model's own-stream owners (one pipeline)."""
        owners = sorted(text(w) for w in await self.redis.smembers(
            self.keys.worker_queue_owners(model)))
        beats: dict[str, Heartbeat] = {}
        if owners:
            pipe = self.redis.pipeline(transaction=False)
            for worker_id in owners:
                pipe.hgetall(self.keys.worker(worker_id))
            for worker_id, raw in zip(owners, await pipe.execute()):
                if raw:
                    beat = Heartbeat.decode(raw)
                    if beat.model == model:
                        beats[worker_id] = beat
        self.loads[model].update(beats)
        if model in self.indexes:
            self.indexes[model].forget_except(set(beats))

    def route(self, model: str, prompt_token_ids: Sequence[int], request_id: str = "") -> Route:
        """Where a request for `model` with this prompt goes; no Redis on the way. A routed
        request counts in its worker's load until `finished(request_id)`."""
        started = time.perf_counter()
        route = self._decide(model, prompt_token_ids)
        if route.worker is not None:
            self.loads[model].routed(route.worker)
            if request_id:
                self._routes[request_id] = (model, route.worker)
                if len(self._routes) > MAX_TRACKED:  # a caller that never said `finished`
                    self.finished(next(iter(self._routes)))
        seconds = time.perf_counter() - started
        stats = self.stats
        stats.routed[route.reason] = stats.routed.get(route.reason, 0) + 1
        stats.prompt_tokens += len(prompt_token_ids)
        stats.cached_tokens += route.cached_tokens
        if self.observe is not None:
            self.observe(seconds)
        return Route(route.worker, route.cached_tokens, route.reason, seconds)

    def finished(self, request_id: str) -> None:
        """The request's stream ended (or it was never routed): it no longer loads its worker."""
        routed = self._routes.pop(request_id, None)
        if routed is not None:
            model, worker_id = routed
            self.loads[model].ended(worker_id)

    def _decide(self, model: str, prompt_token_ids: Sequence[int]) -> Route:
        index, loads = self.indexes.get(model), self.loads.get(model)
        if index is None or not index.synced or not loads.beats:
            return Route(None, 0, "shared")
        workers = sorted(loads.beats)
        load = {w: loads.load(w) for w in workers}
        cached = self._cached_tokens(model, index, prompt_token_ids, loads.beats)
        mean_after = (sum(load.values()) + 1) / len(workers)
        cap = max(self.balance * mean_after, min(load.values()) + LEAST_LOAD_SLACK)
        balanced = [w for w in workers if load[w] + 1 <= cap]
        fitting = [w for w in balanced if _fits(loads.beats[w], len(prompt_token_ids) - cached[w])]
        best = max(fitting or balanced, key=lambda w: (cached[w], -load[w]))
        block_size = loads.beats[best].block_size or 1
        if cached[best] < self.min_blocks * block_size:
            return Route(None, 0, "shared")
        stats = self.stats
        stats.by_worker[best] = stats.by_worker.get(best, 0) + 1
        return Route(best, cached[best], "affinity")

    def _cached_tokens(self, model: str, index: PrefixIndex, prompt: Sequence[int],
                       beats: dict[str, Heartbeat]) -> dict[str, int]:
        """Per worker, the prompt tokens its cache holds from the first on (the last prompt token
        is always computed, so at most `(len - 1) // block_size` blocks count)."""
        ids_by_size: dict[int, list[bytes]] = {}
        out = {}
        for worker_id, beat in beats.items():
            size = beat.block_size
            if size <= 0:  # a worker older than the field announces nothing either
                out[worker_id] = 0
                continue
            if size not in ids_by_size:
                hashes = block_hashes(prompt, size, self._roots[model],
                                      max_blocks=max(len(prompt) - 1, 0) // size)
                ids_by_size[size] = [h[:ANNOUNCE_BYTES] for h in hashes]
            out[worker_id] = index.leading(worker_id, ids_by_size[size]) * size
        return out


def _fits(beat: Heartbeat, uncached_tokens: int) -> bool:
    """Whether the worker's free KV (as its heartbeat said) holds `uncached_tokens` more."""
    if beat.blocks_total <= 0 or beat.block_size <= 0:
        return True  # unknown: let the worker's own admission decide
    return beat.blocks_free * beat.block_size >= uncached_tokens
