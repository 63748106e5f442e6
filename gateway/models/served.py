"""Which model answers a request: the catalog says what its `model` names (a served model or an
adapter of one), the loader holds that model's handlers; and each model's context length, which
/v1/models lists (the cards themselves are gateway/openai/routes.py's)."""

from __future__ import annotations

from kvfleet.gateway.http.errors import APIError
from kvfleet.gateway.models.catalog import ModelCatalog, Target
from kvfleet.gateway.models.loader import ModelLoader, ModelServing


def no_live_worker(model: str, named: str) -> APIError:
    why = f"`{named}` is an adapter of `{model}`, and no" if named != model else "No"
    return APIError(503, f"{why} live worker serves `{model}` now: the gateway has no tokenizer "
                    "for it.", error_type="service_unavailable", code="model_unavailable")


class ServedModels:
    """The app's models: `resolve` on every generation request (no Redis once a name is known
    and its model loaded: two dict lookups)."""

    def __init__(self, catalog: ModelCatalog, loader: ModelLoader):
        self.catalog = catalog
        self.loader = loader

    @property
    def default(self) -> ModelServing:
        return self.loader.ready(self.catalog.default_model)

    async def resolve(self, name: str) -> tuple[ModelServing, Target]:
        """The handlers and the target of a request naming `name`; 404 for an unknown name,
        503 for a model the gateway cannot load."""
        target = self.catalog.lookup(name) or await self.catalog.resolve(name)
        ready = self.loader.ready(target.model)
        return ready or await self.serving(target.model, target.name), target

    async def serving(self, model: str, named: str | None = None) -> ModelServing:
        """The handlers of served model `model` (loaded on first use)."""
        ready = self.loader.ready(model)
        if ready is not None:
            return ready
        source = self.catalog.sources.get(model)
        if source is None:
            raise no_live_worker(model, named or model)
        return await self.loader.get(model, source)

    async def config(self, model: str) -> dict:
        """Served model `model`'s config.json (what its adapters are checked against)."""
        source = self.catalog.sources.get(model)
        if source is None:
            raise no_live_worker(model, model)
        return await self.loader.config(model, source)

    def context_length(self, model: str) -> int | None:
        """The context length of a loaded model (None until a request loads it)."""
        ready = self.loader.ready(model)
        return ready.info.context_length if ready is not None else None
