"""Each served model's tokenizer, chat template and limits, made into the handlers that answer it
(`ModelServing`): the default model's at start, any other's when a request first names it: off
the event loop, and once however many requests wait for it. A model that cannot be loaded is a
503 naming the cause, remembered for LOAD_RETRY_S (not one more load attempt per request)."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, TypeVar

from kvfleet.gateway.http.errors import APIError
from kvfleet.gateway.models.tokenization import ModelInfo, PromptProcessor
from kvfleet.shared.models import load_tokenizer, resolve_model_path

log = logging.getLogger(__name__)

LOAD_RETRY_S = 30.0  # a model that failed to load is tried again after this long


Completions = TypeVar("Completions")
Chat = TypeVar("Chat")


@dataclass(frozen=True)
class ModelServing(Generic[Completions, Chat]):
    """The handlers of one served model (its adapters' requests included: same tokenizer). The
    handlers are the request path's (gateway/openai: `CompletionServing`, `ChatServing`, built by
    the app); this layer below it holds them without knowing their types."""

    processor: PromptProcessor
    completions: Completions
    chat: Chat

    @property
    def info(self) -> ModelInfo:
        return self.processor.model


def load_processor(served_id: str, source: str, cache_dir: Path | None) -> PromptProcessor:
    """A served model's prompt processor from its source (blocking, seconds: run it in a thread;
    its tokenising thread's copy of the tokenizer is made here too, not on the event loop)."""
    path = resolve_model_path(source, cache_dir, weights=False)
    tokenizer = load_tokenizer(path)
    processor = PromptProcessor(tokenizer, ModelInfo.from_pretrained(served_id, path, tokenizer))
    processor.prepare_offload()
    return processor


def read_model_config(source: str, cache_dir: Path | None) -> dict:
    """The model's config.json as a dict (blocking): what an adapter is checked against."""
    path = resolve_model_path(source, cache_dir, weights=False)
    config_file = Path(path) / "config.json"
    if config_file.is_file():
        return json.loads(config_file.read_text())
    from transformers import AutoConfig  # a hub id in the local cache

    return AutoConfig.from_pretrained(path).to_dict()


def model_unavailable(model: str, source: str, exc: BaseException) -> APIError:
    return APIError(503, f"The gateway cannot load model `{model}` from `{source}`: {exc}",
                    error_type="service_unavailable", code="model_unavailable")


class ModelLoader:
    """Served model id -> its ModelServing, loaded on first use by `build` from a processor."""

    def __init__(self, build: Callable[[PromptProcessor], ModelServing],
                 cache_dir: Path | None = None, *,
                 load: Callable[[str, str, Path | None], PromptProcessor] = load_processor,
                 retry_s: float = LOAD_RETRY_S, clock: Callable[[], float] = time.monotonic):
        self._build = build
        self._cache_dir = cache_dir
        self._load_processor = load
        self._retry_s = retry_s
        self._clock = clock
        self._ready: dict[str, ModelServing] = {}
        self._loading: dict[str, asyncio.Task] = {}
        self._failed: dict[str, tuple[float, APIError]] = {}  # model -> (retry after, error)
        self._configs: dict[str, dict] = {}

    def add(self, serving: ModelServing) -> None:
        """A model loaded already (the default, at start)."""
        self._ready[serving.info.served_id] = serving

    def ready(self, model: str) -> ModelServing | None:
        return self._ready.get(model)

    async def get(self, model: str, source: str) -> ModelServing:
        """The model's handlers, loading it from `source` if needed; 503 if it cannot be."""
        ready = self._ready.get(model)
        if ready is not None:
            return ready
        failed = self._failed.get(model)
        if failed is not None:
            if self._clock() < failed[0]:
                raise failed[1]
            del self._failed[model]
        task = self._loading.get(model)
        if task is None:
            task = asyncio.get_running_loop().create_task(self._load(model, source),
                                                          name=f"load-model-{model}")
            task.add_done_callback(_retrieve)
            self._loading[model] = task
        # shielded: a waiter whose client left does not cancel the load the others wait for
        return await asyncio.shield(task)

    async def _load(self, model: str, source: str) -> ModelServing:
        log.info("loading the tokenizer of model %s from %s", model, source)
        try:
            processor = await asyncio.to_thread(self._load_processor, model, source,
                                                self._cache_dir)
        except Exception as exc:  # noqa: BLE001 - any failure of transformers' loaders
            log.warning("cannot load model %s from %s: %r", model, source, exc)
            error = model_unavailable(model, source, exc)
            self._failed[model] = (self._clock() + self._retry_s, error)
            raise error from exc
        finally:
            self._loading.pop(model, None)
        serving = self._build(processor)  # no await since the pop: no waiter loads it again
        self._ready[model] = serving
        return serving

    async def config(self, model: str, source: str) -> dict:
        """The model's config.json (read once, off the event loop); 503 if it cannot be read."""
        config = self._configs.get(model)
        if config is None:
            try:
                config = await asyncio.to_thread(read_model_config, source, self._cache_dir)
            except Exception as exc:  # noqa: BLE001 - a missing or malformed config
                raise model_unavailable(model, source, exc) from exc
            self._configs[model] = config
        return config


def _retrieve(task: asyncio.Task) -> None:
    """Mark a load's failure as seen even when every waiter went away first."""
    if not task.cancelled():
        task.exception()
