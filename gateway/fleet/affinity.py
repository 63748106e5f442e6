"""Prefix-affinity routing in the gateway (docs/ARCHITECTURE.md, "Prefix-affinity routing"): which
worker's own stream a request goes to, or the shared streams. The same router, with policy
`random` (`--routing random`), is the cache-blind baseline: a uniformly random live worker that
reads new requests, whatever its cache or load.

`route` runs on the request path and touches no Redis: it hashes the prompt's blocks the way the
workers do (shared/wire/prefix_hash.py: from the root of the model and of the request's LoRA
adapter, if any, so an adapter's blocks never match the base model's; the workers' block size),
reads the prefix index (gateway/fleet/prefix_index.py) and the workers' loads, which a background
task refreshes from their heartbeats (only the model's own-stream owners, no SCAN). A worker's
load is the larger of its running + waiting requests + entries in its own streams as its last
heartbeat said, and the requests this gateway routed to it that have not ended yet.

The rule: a worker is eligible while its load after this request stays within `balance` x the
mean (or `LEAST_LOAD_SLACK` above the least loaded worker), and its free KV holds the prompt's
uncached part; among the eligible the longest cached prefix wins (`min_blocks` at least: fewer
count as none), ties to the least loaded. A prefix is scored block by block over its leading run
(which ends at the first block the worker holds in neither tier): a block on the worker's device
counts 1, one in its host tier (`--kv-offloading-size`) `host_tier_weight` (restoring it is a
copy, far cheaper than recomputing but not free), so a device holder beats a host-tier holder of
the same prefix, which beats a worker holding nothing (weight 1: the tiers alike; 0: a host-tier
block adds nothing, as if absent). A worker's prefix is what it announced plus the blocks
of the prompts this gateway routed to it in the last `EXPECTED_S` (it is computing them): a burst
of requests sharing a new system prompt goes to one worker, not to all of them before the first
announcement. A worker that drains or only decodes (role `decode`) reads no new requests: it is
never chosen. Only without an index or a live worker that reads new requests does a request go
to the shared streams, where the first worker with room takes it.

With policy `random` the router follows no announcements (no prefix index): each request goes to
the own stream of a worker drawn uniformly from the model's live workers that read new requests
(by the same heartbeats), from a `random.Random` the caller may seed. The workers' steal rules
are the same, so an idle worker still takes an entry waiting on a busy one after
`--affinity-steal-after-ms`: random routing degrades gracefully, as affinity does when load wins.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from redis.asyncio import Redis

from kvfleet.gateway.fleet.load import takes_new_requests
from kvfleet.gateway.fleet.prefix_index import PrefixIndex
from kvfleet.gateway.fleet.tasks import stop_task
from kvfleet.shared.redis_connect import REDIS_FAILURES
from kvfleet.shared.wire import Heartbeat, Keys
from kvfleet.shared.wire.prefix_hash import ANNOUNCE_BYTES, block_hashes, lora_root
from kvfleet.shared.wire.records import text

log = logging.getLogger(__name__)

# A worker may be this many requests above the least loaded one for its cache, however low the
# fleet's mean: at low loads one request more or less costs little and a cache miss a prefill.
LEAST_LOAD_SLACK = 2
LOAD_REFRESH_S = 0.1
MAX_TRACKED = 100_000  # routed requests whose end is awaited
EXPECTED_S = 10.0  # how long a routed prompt's blocks count as its worker's before announced  # how often the owners' heartbeats are read


@dataclass
class RouterStats:
    """What this gateway's router did since it started (the metrics read it)."""

    routed: dict[str, int] = field(default_factory=dict)  # by Route.reason
    by_worker: dict[str, int] = field(default_factory=dict)  # requests routed to a worker
    prompt_tokens: int = 0  # of every request routed
    cached_tokens: int = 0  # expected cached at the chosen worker (on its device)
    host_tier_tokens: int = 0  # expected in the chosen worker's host tier (brought back there)


@dataclass(frozen=True)
class Route:
    """Where one request goes: `worker` (its own stream) or None (the shared streams)."""

    worker: str | None
    # prompt tokens the chosen worker is expected to find in its cache on its device (the
    # entry's `cached`: its admission counts them as held)
    cached_tokens: int
    # "affinity": the worker holds (or is about to hold) at least min_blocks of its prompt;
    # "least_loaded": none that the load allows does, the least loaded takes it; "random": a
    # uniformly random worker (policy random); "shared": no index or no live worker yet, the
    # shared streams
    reason: str
    seconds: float = 0.0  # time spent routing
    host_tier_tokens: int = 0  # of the leading run, tokens the worker holds in its host tier


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


POLICIES = ("affinity", "random")


class Router:
    """Routes one gateway's requests; `follow` begins following Redis for a model. `policy`:
    "affinity" (the prefix index and the load rule) or "random" (a uniformly random live worker,
    drawn from `rng`: a seeded one makes the choices reproducible)."""

    def __init__(self, redis: Redis, keys: Keys, *, balance: float = 1.5, min_blocks: int = 1,
                 listing_ttl_ms: int = 10_000, policy: str = "affinity",
                 rng: random.Random | None = None, host_tier_weight: float = 0.75):
        if policy not in POLICIES:
            raise ValueError(f"routing policy must be one of {POLICIES}, got {policy!r}")
        if not 0.0 <= host_tier_weight <= 1.0:
            raise ValueError(f"host_tier_weight must be in [0, 1], got {host_tier_weight}")
        self.host_tier_weight = host_tier_weight
        self.policy = policy
        self.rng = rng or random.Random()
        self.redis = redis
        self.keys = keys
        self.balance = balance
        self.min_blocks = min_blocks
        self.listing_ttl_ms = listing_ttl_ms
        self.indexes: dict[str, PrefixIndex] = {}
        self.loads: dict[str, WorkerLoads] = {}
        self._roots: dict[tuple[str, str, str], bytes] = {}  # (model, adapter, path) -> root
        self._tasks: list[asyncio.Task] = []
        self.stats = RouterStats()  # every model's requests
        self.model_stats: dict[str, RouterStats] = {}  # by model (the metrics' label)
        # model -> worker -> announce id -> until when (monotonic s): blocks of prompts routed
        # to that worker, expected in its cache before it announces them
        self._expected: dict[str, dict[str, dict[bytes, float]]] = {}
        # request id -> (model, worker) until its stream ends; the oldest forgotten past a cap
        self._routes: dict[str, tuple[str, str]] = {}
        # each route's seconds, by model (a histogram)
        self.observe: Callable[[str, float], None] | None = None

    def follow(self, model: str) -> None:
        """Start following the model's announcements (policy affinity only) and workers' loads
        (in the background; until the index has its first snapshot, or the loads their first
        read, requests go to the shared streams). Call from the event loop; a model already
        followed is left as it is."""
        if model in self.loads:
            return
        self.loads[model] = WorkerLoads()
        if self.policy == "affinity":
            index = PrefixIndex(self.redis, self.keys, model,
                                listing_ttl_ms=self.listing_ttl_ms)
            self.indexes[model] = index
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
                self.forget_expired()
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

    def route(self, model: str, prompt_token_ids: Sequence[int], request_id: str = "",
              adapter: str = "", adapter_path: str = "") -> Route:
        """Where a request for `model` (and its LoRA `adapter`, if any) with this prompt goes;
        no Redis on the way. A routed request counts in its worker's load until
        `finished(request_id)`."""
        started = time.perf_counter()
        route = self._decide(model, prompt_token_ids, self._root(model, adapter, adapter_path))
        if route.worker is not None:
            self.loads[model].routed(route.worker)
            if request_id:
                self._routes[request_id] = (model, route.worker)
                if len(self._routes) > MAX_TRACKED:  # a caller that never said `finished`
                    self.finished(next(iter(self._routes)))
        seconds = time.perf_counter() - started
        mine = self.model_stats.get(model) or self.model_stats.setdefault(model, RouterStats())
        for stats in (self.stats, mine):
            stats.routed[route.reason] = stats.routed.get(route.reason, 0) + 1
            stats.prompt_tokens += len(prompt_token_ids)
            stats.cached_tokens += route.cached_tokens
            stats.host_tier_tokens += route.host_tier_tokens
            if route.worker is not None:
                stats.by_worker[route.worker] = stats.by_worker.get(route.worker, 0) + 1
        if self.observe is not None:
            self.observe(model, seconds)
        return Route(route.worker, route.cached_tokens, route.reason, seconds,
                     route.host_tier_tokens)

    def _root(self, model: str, adapter: str, adapter_path: str) -> bytes:
        """The hash chain's root of the model's (or its adapter's) prompts, as workers make it."""
        root = self._roots.get((model, adapter, adapter_path))
        if root is None:
            root = self._roots[(model, adapter, adapter_path)] = lora_root(model, adapter,
                                                                           adapter_path)
        return root

    def finished(self, request_id: str) -> None:
        """The request's stream ended (or it was never routed): it no longer loads its worker."""
        routed = self._routes.pop(request_id, None)
        if routed is not None:
            model, worker_id = routed
            self.loads[model].ended(worker_id)

    def _decide(self, model: str, prompt_token_ids: Sequence[int], root: bytes) -> Route:
        if self.policy == "random":
            return self._random(model)
        index, loads = self.indexes.get(model), self.loads.get(model)
        if index is None or not index.synced:
            return Route(None, 0, "shared")
        workers = sorted(w for w, beat in loads.beats.items() if takes_new_requests(beat))
        if not workers:
            return Route(None, 0, "shared")
        load = {w: loads.load(w) for w in workers}
        ids = self._block_ids(root, prompt_token_ids, loads.beats)
        expected = self._expected.setdefault(model, {})
        now = time.monotonic()
        # per worker, the prompt's leading run it holds or is expected to hold (held), and the
        # one it announced (cached): (blocks, of them on device, score in tokens)
        held, cached = {}, {}
        for w in workers:
            size, mine = loads.beats[w].block_size, ids.get(loads.beats[w].block_size, ())
            sets, host = index.sets.get(w, ()), index.host.get(w, ())
            held[w] = _leading(mine, sets, host, expected.get(w), now, self.host_tier_weight,
                               size)
            cached[w] = _leading(mine, sets, host, None, now, self.host_tier_weight, size)
        mean_after = (sum(load.values()) + 1) / len(workers)
        cap = max(self.balance * mean_after, min(load.values()) + LEAST_LOAD_SLACK)
        balanced = [w for w in workers if load[w] + 1 <= cap]
        # a host-tier block is brought back into a free pool block: only device ones are free
        fitting = [w for w in balanced if _fits(loads.beats[w], len(prompt_token_ids)
                                                - held[w][1] * loads.beats[w].block_size)]

        def enough(w: str) -> float:  # a worker holding fewer than min_blocks holds nothing here
            return held[w][2] if held[w][0] >= self.min_blocks else 0.0

        # ties: what a worker announced beats what it is only expected to hold (an entry
        # another worker took computed its blocks there), then the least loaded
        best = max(fitting or balanced, key=lambda w: (enough(w), cached[w][2], -load[w]))
        # the chosen worker will hold the prompt's blocks: the next request sharing its prefix
        # follows it before the worker has computed and announced them
        size = loads.beats[best].block_size
        if size in ids:
            mine = expected.setdefault(best, {})
            for block_id in ids[size]:
                mine[block_id] = now + EXPECTED_S
        blocks, device, _ = cached[best]
        return Route(best, device * size, "affinity" if enough(best) else "least_loaded",
                     host_tier_tokens=(blocks - device) * size)

    def _random(self, model: str) -> Route:
        """A uniformly random live worker that reads new requests; none yet: the shared
        streams. Its cache is not looked at (the entry's `cached` is 0: the worker counts the
        whole prompt against its budget until its own prefix cache says otherwise)."""
        loads = self.loads.get(model)
        workers = sorted(w for w, beat in loads.beats.items() if takes_new_requests(beat)) \
            if loads is not None else []
        if not workers:
            return Route(None, 0, "shared")
        return Route(self.rng.choice(workers), 0, "random")

    def _block_ids(self, root: bytes, prompt: Sequence[int],
                   beats: dict[str, Heartbeat]) -> dict[int, list[bytes]]:
        """The prompt's announce ids at each block size the workers use (the last prompt token is
        always computed, so at most `(len - 1) // block_size` blocks count). A worker without a
        block size (older than the field) announces nothing either."""
        out: dict[int, list[bytes]] = {}
        for size in {beat.block_size for beat in beats.values() if beat.block_size > 0}:
            hashes = block_hashes(prompt, size, root,
                                  max_blocks=max(len(prompt) - 1, 0) // size)
            out[size] = [h[:ANNOUNCE_BYTES] for h in hashes]
        return out

    def forget_expired(self) -> None:
        """Drop the expected blocks whose time is up (the workers announced them by now, or
        never will)."""
        now = time.monotonic()
        for by_worker in self._expected.values():
            for worker_id in list(by_worker):
                mine = {b: t for b, t in by_worker[worker_id].items() if t > now}
                if mine:
                    by_worker[worker_id] = mine
                else:
                    del by_worker[worker_id]


def _leading(ids: Sequence[bytes], held, host, expected: dict[bytes, float] | None,
             now: float, host_weight: float, block_size: int) -> tuple[int, int, float]:
    """(blocks, of them on device, score in tokens) of the leading run of `ids` a worker holds:
    each id in `held` (in its host tier when also in `host`) or expected until after `now` (on
    device: it is being computed there); the run ends at the first id held in neither tier. A
    device block scores `block_size`, a host-tier one `host_weight` x that."""
    count = device = 0
    for block_id in ids:
        if expected is not None and expected.get(block_id, 0.0) > now:
            device += 1
        elif block_id not in held:
            break
        elif block_id not in host:
            device += 1
        count += 1
    return count, device, (device + host_weight * (count - device)) * block_size


def _fits(beat: Heartbeat, uncached_tokens: int) -> bool:
    """Whether the worker's free KV (as its heartbeat said) holds `uncached_tokens` more."""
    if beat.blocks_total <= 0 or beat.block_size <= 0:
        return True  # unknown: let the worker's own admission decide
    return beat.blocks_free * beat.block_size >= uncached_tokens
