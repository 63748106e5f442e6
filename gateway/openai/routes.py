"""HTTP routes: thin; they hand validated schemas to the handlers of the model the request names
(gateway/models/served.py) and send what comes back."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvfleet.gateway.http.errors import APIError
from kvfleet.gateway.models.served import ServedModels
from kvfleet.gateway.openai.request_schemas import ChatCompletionRequest, CompletionRequest, SamplingRequest
from kvfleet.gateway.openai.responses import ModelCard, ModelList

log = logging.getLogger(__name__)

router = APIRouter()

CLIENT_CLOSED_REQUEST = 499  # nginx's status for "the client went away first" (nobody reads it)

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def _principal(request: Request):
    """The API key's Principal that ApiKeyAuth found (None when keys are off)."""
    return getattr(request.state, "principal", None)


def _send(result) -> Response:
    if isinstance(result, AsyncIterator):
        return StreamingResponse(result, media_type="text/event-stream", headers=SSE_HEADERS)
    return Response(result.model_dump_json(), media_type="application/json")


async def _answer(request: Request, work: Awaitable) -> Response:
    """The handler's answer; a non-streaming request is cancelled (and so cancelled on the
    workers) when its client goes away first, as a stream is."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # this handler itself was cancelled (server shutdown)
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
        log.info("client went away before the answer (X-Request-Id %s): request cancelled",
                 getattr(request.state, "request_id", "-"))
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    result = task.result()
    if not isinstance(result, AsyncIterator):
        log.info("X-Request-Id %s answered as %s", getattr(request.state, "request_id", "-"),
                 getattr(result, "id", "-"))
    return _send(result)


async def _disconnected(request: Request) -> None:
    """Returns when the client has closed the connection (the body is already read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _generate(request: Request, body: SamplingRequest, endpoint: str):
    """The answer of the named model's handler (`endpoint`: `completions` or `chat`)."""
    serving, target = await request.app.state.models.resolve(body.model)
    request.state.model = target.name  # the metrics label, should the answer be an error
    handler = serving.chat if endpoint == "chat" else serving.completions
    return await handler.create(body, _principal(request), target)


@router.post("/v1/completions")
async def create_completion(body: CompletionRequest, request: Request) -> Response:
    return await _answer(request, _generate(request, body, "completions"))


@router.post("/v1/chat/completions")
async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
    return await _answer(request, _generate(request, body, "chat"))


@router.get("/v1/requests/{req_id}/stream")
async def resume_stream(req_id: str, request: Request,
                        after: int = Query(0, ge=0, description="first output token to send")
                        ) -> Response:
    """Re-attach: the request's output from token `after` as SSE (completions chunk format)."""
    return _send(await request.app.state.reattach.stream(req_id, after))


@router.get("/v1/models")
async def list_models(request: Request) -> ModelList:
    """What the fleet serves now: the default model, the live workers' models, the adapters."""
    models = request.app.state.models
    await models.catalog.refresh_throttled()  # what it lists is not a second old
    return ModelList(data=model_cards(models, request.app.state.started))


def model_cards(models: ServedModels, created: int) -> list[ModelCard]:
    """/v1/models as vLLM lists it: the served models (`root`: where they load from), then
    the adapters (`root`: the adapter's directory, `parent`: its base model)."""
    catalog = models.catalog
    cards = []
    for model, source in catalog.sources.items():
        cards.append(ModelCard(id=model, created=created, root=source,
                               max_model_len=models.context_length(model)))
    for record in catalog.adapters.values():
        if record.name not in catalog.sources:  # a served model wins the name
            cards.append(ModelCard(id=record.name, created=record.created or created,
                                   root=record.path, parent=record.base_model,
                                   max_model_len=models.context_length(record.base_model)))
    return cards


@router.get("/health")
async def health() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/ready")
async def ready(request: Request) -> JSONResponse:
    if not await request.app.state.client.is_ready():
        raise APIError(503, "Redis does not answer.", error_type="service_unavailable")
    return JSONResponse({"status": "ready"})
