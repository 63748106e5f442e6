"""The fleet's LoRA adapters, registered in Redis (`Keys.loras`: every gateway serves them, every
worker of the base model loads one on its first request). An adapter is checked here against its
base model's config.json and the rank limit (shared/lora.py) before it is registered, so that no
worker is sent a request for an adapter it would refuse. Registration is first come first served
(HSETNX): two gateways registering one name at once give one of them a 400.

Start-up adapters (`--lora-modules`) are checked when the app is made (a bad one stops the
gateway), then written to Redis as pinned, replacing a record of the same name."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvfleet.gateway.fleet.redis_context import RedisContext
from kvfleet.gateway.fleet.tasks import stop_task
from kvfleet.gateway.http.errors import APIError, bad_request
from kvfleet.gateway.models.loader import read_model_config
from kvfleet.gateway.models.served import ServedModels
from kvfleet.shared.lora import AdapterError, LoraRecord, inspect_adapter, parse_lora_module
from kvfleet.shared.redis_connect import REDIS_FAILURES
from kvfleet.shared.settings import GatewaySettings

log = logging.getLogger(__name__)

PIN_RETRY_S = 1.0  # start-up adapters are written again this often while Redis does not answer


@dataclass(frozen=True)
class StartupAdapter:
    """One `--lora-modules` entry."""

    name: str
    path: str
    base_model: str


def startup_adapters(entries: list[str], default_model: str,
                     aliases: list[str] | tuple[str, ...] = ()) -> list[StartupAdapter]:
    """`--lora-modules` as adapters of the default model (a base named by one of its `aliases`
    is the default model, by its first served name); ValueError names a bad entry."""
    adapters: dict[str, StartupAdapter] = {}
    names = {default_model, *aliases}
    for entry in entries:
        name, path = parse_lora_module(entry)
        base = default_model
        if entry.strip().startswith("{"):
            base = json.loads(entry).get("base_model_name") or default_model
        if base not in names:
            raise ValueError(f"--lora-modules {name}: base_model_name `{base}` is not --model "
                             f"(`{default_model}`); register adapters of other models at run "
                             "time (POST /v1/load_lora_adapter)")
        base = default_model
        if name in names:
            raise ValueError(f"--lora-modules: `{name}` is the served model's own name")
        if name in adapters:
            raise ValueError(f"--lora-modules: the name `{name}` is given twice")
        adapters[name] = StartupAdapter(name, path, base)
    return list(adapters.values())


def check_startup_adapters(settings: GatewaySettings, served_id: str) -> list[LoraRecord]:
    """The start-up adapters as pinned records, each checked against the default model (blocking:
    at start); ValueError says which one is bad and why."""
    adapters = startup_adapters(settings.lora_modules, served_id, settings.served_names())
    if not adapters:
        return []
    config = read_model_config(settings.model, settings.cache_dir)
    records = []
    for adapter in adapters:
        try:
            info = inspect_adapter(adapter.path, config, settings.max_lora_rank)
        except AdapterError as exc:
            raise ValueError(f"--lora-modules {adapter.name}={adapter.path}: {exc}") from None
        records.append(LoraRecord(adapter.name, served_id, adapter.path, info.rank,
                                  info.target_modules, created=int(time.time()), pinned=True))
    return records


def already_loaded(name: str) -> APIError:
    return bad_request(f"The lora adapter '{name}' has already been loaded.", param="lora_name",
                       code="lora_adapter_exists")


def adapter_not_found(name: str) -> APIError:
    return APIError(404, f"The lora adapter '{name}' cannot be found.", param="lora_name",
                    code="lora_adapter_not_found")


def redis_unavailable(exc: BaseException) -> APIError:
    return APIError(503, f"Cannot reach the adapter registry: Redis does not answer ({exc!r}).",
                    error_type="service_unavailable")


class AdapterRegistry:
    """Registers and removes the fleet's adapters (Redis, then this gateway's catalog at once;
    the other gateways see it at their next catalog refresh, within a second)."""

    def __init__(self, redis: RedisContext | None, models: ServedModels, max_rank: int,
                 clock: Callable[[], float] = time.time):
        self._redis = redis
        self._models = models
        self._catalog = models.catalog
        self.max_rank = max_rank
        self._clock = clock
        self._pin_task: asyncio.Task | None = None

    async def register(self, name: str, path: str, base_model: str | None = None) -> LoraRecord:
        """Check the adapter at `path` against `base_model` (default: the default model) and
        register it under `name`; APIError 400 for a bad adapter or a taken name."""
        if self._redis is None:
            raise APIError(503, "The adapter registry needs the fleet's Redis.",
                           error_type="service_unavailable")
        # an alias of the default model names it: the record's `parent` is its first name
        base = self._catalog.canonical(base_model or self._catalog.default_model)
        await self._check_names(name, base)
        config = await self._models.config(base)
        try:
            info = await asyncio.to_thread(inspect_adapter, path, config, self.max_rank)
        except AdapterError as exc:
            raise bad_request(f"Invalid LoRA adapter `{name}`: {exc}", param="lora_path",
                              code="invalid_lora_adapter") from exc
        record = LoraRecord(name, base, path, info.rank, info.target_modules,
                            created=int(self._clock()))
        try:
            async with asyncio.timeout(self._redis.command_timeout_s * 2):
                written = await self._redis.redis.hsetnx(self._redis.keys.loras(), name,
                                                         record.to_json())
        except (*REDIS_FAILURES, OSError, TimeoutError) as exc:
            raise redis_unavailable(exc) from exc
        if not written:  # another gateway took the name since the catalog's last read
            raise already_loaded(name)
        self._catalog.remember_adapter(record)
        log.info("LoRA adapter %s of %s registered: %s (rank %d, %s)", name, base, path,
                 info.rank, ", ".join(info.target_modules))
        return record

    async def _check_names(self, name: str, base: str) -> None:
        """400 unless `name` is free and `base` a served model, as Redis says now."""
        await self._catalog.refresh()  # names taken on other gateways (a rare call)
        if self._catalog.is_served_model(name):
            raise bad_request(f"`{name}` is the name of a served model; an adapter needs a name "
                              "of its own.", param="lora_name", code="lora_adapter_exists")
        if name in self._catalog.adapters:
            raise already_loaded(name)
        if not self._catalog.is_served_model(base):
            raise bad_request(f"The base model `{base}` is not served: neither the gateway's "
                              "default model nor a live worker's.", param="base_model_name",
                              code="model_not_found")

    async def unregister(self, name: str) -> None:
        """Remove adapter `name` (requests already queued keep theirs); 404 if there is none."""
        if self._redis is None:
            raise adapter_not_found(name)
        try:
            async with asyncio.timeout(self._redis.command_timeout_s * 2):
                removed = await self._redis.redis.hdel(self._redis.keys.loras(), name)
        except (*REDIS_FAILURES, OSError, TimeoutError) as exc:
            raise redis_unavailable(exc) from exc
        self._catalog.forget_adapter(name)
        if not removed:
            raise adapter_not_found(name)
        log.info("LoRA adapter %s removed", name)

    # ---- start-up adapters -------------------------------------------------------------

    async def pin(self, records: list[LoraRecord]) -> None:
        """Register the start-up adapters (replacing records of the same names) and serve them;
        while Redis does not answer, serve them all the same and write them in the background
        (call from the event loop; `close` stops that)."""
        if not records:
            return
        for record in records:
            self._catalog.remember_adapter(record)
        if self._redis is None:
            return
        if not await self._write_pinned(records):
            self._catalog.unwritten = {r.name: r for r in records}
            self._pin_task = asyncio.create_task(self._write_pinned_until_done(records),
                                                 name="pin-loras")

    async def _write_pinned(self, records: list[LoraRecord]) -> bool:
        try:
            async with asyncio.timeout(self._redis.command_timeout_s * 2):
                await self._redis.redis.hset(self._redis.keys.loras(),
                                             mapping={r.name: r.to_json() for r in records})
        except (*REDIS_FAILURES, OSError, TimeoutError) as exc:
            log.warning("could not register the start-up adapters yet: %r", exc)
            return False
        log.info("LoRA adapters registered at start: %s",
                 ", ".join(f"{r.name}={r.path}" for r in records))
        return True

    async def _write_pinned_until_done(self, records: list[LoraRecord]) -> None:
        while not await self._write_pinned(records):
            await asyncio.sleep(PIN_RETRY_S)
        self._catalog.unwritten = {}

    async def close(self) -> None:
        if self._pin_task is not None:
            await stop_task(self._pin_task)
            self._pin_task = None
