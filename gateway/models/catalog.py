"""What the fleet serves, as this gateway knows it: the default model (`--model`), every model a
live worker serves (its heartbeat names the model and where the worker loaded it from), and the
LoRA adapters registered in Redis (`Keys.loras`).

A request's `model` is resolved here without Redis: the catalog is read again in the background
every REFRESH_S, and at once when a request names something it does not know (at most once per
MISS_REFRESH_S however many such requests come, so a client naming nonsense costs little Redis;
concurrent misses wait for the one refresh).
Names are one namespace: a served model wins over an adapter of the same name (registration
refuses such a name, but a worker may start serving it later). The default model's other served
names (`--served-model-name`'s after the first) are aliases: a request naming one is a request
for the default model under its first name (its queues, answers and metrics label).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvfleet.gateway.fleet.load import read_heartbeats
from kvfleet.gateway.fleet.redis_context import RedisContext
from kvfleet.gateway.fleet.tasks import stop_task
from kvfleet.gateway.http.errors import model_not_found
from kvfleet.shared.lora import LoraRecord
from kvfleet.shared.redis_connect import REDIS_FAILURES
from kvfleet.shared.wire.records import text

log = logging.getLogger(__name__)

REFRESH_S = 1.0  # how old the background's view of the fleet may be
MISS_REFRESH_S = 0.25  # unknown names read Redis again at most this often


@dataclass(frozen=True)
class Target:
    """What a request's `model` names: a served model, or a LoRA adapter of one."""

    name: str  # as the client wrote it: the answer's `model` and the metrics label
    model: str  # the served base model: its queues, workers and tokenizer
    lora: str = ""  # the adapter's name ('' = the base model itself)
    lora_path: str = ""  # the adapter's directory, as the workers load it

    @classmethod
    def of_model(cls, model: str) -> Target:
        return cls(model, model)


class ModelCatalog:
    """The served models (served id -> source: what `resolve_model_path` loads) and the
    registered adapters, replaced whole at each refresh (readers never see half of one)."""

    def __init__(self, default_model: str, default_source: str, redis: RedisContext | None,
                 *, aliases: list[str] | tuple[str, ...] = (), refresh_s: float = REFRESH_S,
                 miss_refresh_s: float = MISS_REFRESH_S,
                 clock: Callable[[], float] = time.monotonic):
        self.default_model = default_model
        self.aliases = {alias: default_model for alias in aliases if alias != default_model}
        self._default_source = default_source
        self._redis = redis
        self.refresh_s = refresh_s
        self.miss_refresh_s = miss_refresh_s
        self._clock = clock
        self.sources: dict[str, str] = {default_model: default_source}  # default first
        self.adapters: dict[str, LoraRecord] = {}
        # start-up adapters not yet in Redis (it did not answer): served meanwhile all the same
        self.unwritten: dict[str, LoraRecord] = {}
        self.on_new_model: list[Callable[[str], None]] = []  # called as a model appears
        self._miss_refreshed_at = -math.inf
        self._miss_lock = asyncio.Lock()
        self._task: asyncio.Task | None = None

    # ---- resolving (no Redis unless the name is unknown) ---------------------------------

    def lookup(self, name: str) -> Target | None:
        """What `name` means now, from the last refresh; None if nothing."""
        name = self.canonical(name)
        if name in self.sources:
            return Target.of_model(name)
        record = self.adapters.get(name)
        if record is None:
            return None
        return Target(name, record.base_model, record.name, record.path)

    async def resolve(self, name: str) -> Target:
        """What `name` means; reads Redis again for a name not known yet; 404 if still none."""
        target = self.lookup(name)
        if target is None and self._redis is not None:
            await self.refresh_throttled()
            target = self.lookup(name)
        if target is None:
            raise model_not_found(name)
        return target

    def canonical(self, name: str) -> str:
        """The served model an alias names (its first served name); any other name as it is."""
        return self.aliases.get(name, name)

    def is_served_model(self, name: str) -> bool:
        """`name` is a served model's name or an alias of one."""
        return self.canonical(name) in self.sources

    # ---- refreshing --------------------------------------------------------------------

    async def refresh_throttled(self) -> None:
        """Refresh now (for a name not known, a listing) unless such a refresh ran less than
        `miss_refresh_s` ago (the background's refreshes do not count: a worker that began to
        serve a model after the last one is found at once). Callers meanwhile wait for it."""
        async with self._miss_lock:
            if self._clock() - self._miss_refreshed_at >= self.miss_refresh_s:
                self._miss_refreshed_at = self._clock()
                await self.refresh()

    async def refresh(self) -> bool:
        """Read the live workers' heartbeats and the adapter registry; False (and the last view
        kept) when Redis does not answer."""
        if self._redis is None:
            return False
        redis, keys = self._redis.redis, self._redis.keys
        try:
            async with asyncio.timeout(self._redis.command_timeout_s * 2):
                beats = await read_heartbeats(redis, keys)
                registry = await redis.hgetall(keys.loras())
        except (*REDIS_FAILURES, OSError, TimeoutError) as exc:
            log.debug("could not read the fleet's models from Redis: %r", exc)
            return False
        sources = {self.default_model: self._default_source}
        for beat in beats.values():  # sorted by worker id: the first worker's source wins
            if beat.model and beat.model not in sources:
                # a worker older than `model_source` loaded its model by the served id
                sources[beat.model] = beat.model_source or beat.model
        new = [m for m in sources if m not in self.sources]
        self.sources = sources
        self.adapters = {**_adapters(registry), **self.unwritten}
        for model in new:
            for callback in self.on_new_model:
                callback(model)
        return True

    def remember_adapter(self, record: LoraRecord) -> None:
        """This gateway registered `record`: serve it now, before the next refresh."""
        self.adapters = {**self.adapters, record.name: record}

    def forget_adapter(self, name: str) -> None:
        self.adapters = {k: v for k, v in self.adapters.items() if k != name}

    def start(self) -> None:
        """Refresh in the background (call from the event loop; `close` stops it)."""
        if self._redis is not None and self._task is None:
            self._task = asyncio.create_task(self._run(), name="model-catalog")

    async def close(self) -> None:
        if self._task is not None:
            await stop_task(self._task)
            self._task = None

    async def _run(self) -> None:
        while True:
            try:
                await self.refresh()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - the loop must outlive any one failure
                log.warning("model catalog refresh failed: %r", exc)
            await asyncio.sleep(self.refresh_s)


def _adapters(registry: dict) -> dict[str, LoraRecord]:
    """The registry hash's records by name; a record this gateway cannot read is left out."""
    out = {}
    for name, raw in registry.items():
        try:
            record = LoraRecord.from_json(raw)
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("adapter %s: unreadable registry record: %r", text(name), exc)
            continue
        out[record.name] = record
    return dict(sorted(out.items()))
