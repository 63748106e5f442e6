"""vLLM's runtime LoRA routes: POST /v1/load_lora_adapter and /v1/unload_lora_adapter, with vLLM's
answers (a 200 with a line of text; errors in OpenAI's shape). They change the fleet's adapter
registry (gateway/models/adapters.py), so every gateway and worker sees the change. Under /v1/:
any caller with a valid API key may call them (the key store has no admin keys)."""

from __future__ import annotations

import logging

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict

from kvfleet.gateway.http.errors import bad_request

log = logging.getLogger(__name__)

lora_router = APIRouter()


class LoadLoraAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", protected_namespaces=())

    lora_name: str = ""
    lora_path: str = ""
    base_model_name: str | None = None  # default: the gateway's --model


class UnloadLoraAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    lora_name: str = ""


def _who(request: Request) -> str:
    principal = getattr(request.state, "principal", None)
    return principal.key_id if principal is not None else "-"


@lora_router.post("/v1/load_lora_adapter", response_class=PlainTextResponse)
async def load_lora_adapter(body: LoadLoraAdapterRequest, request: Request) -> PlainTextResponse:
    if not body.lora_name or not body.lora_path:
        raise bad_request("Both 'lora_name' and 'lora_path' must be provided.")
    log.info("load_lora_adapter %s from %s (API key %s)", body.lora_name, body.lora_path,
             _who(request))
    record = await request.app.state.adapters.register(body.lora_name, body.lora_path,
                                                       body.base_model_name)
    return PlainTextResponse(f"Success: LoRA adapter '{record.name}' added successfully.")


@lora_router.post("/v1/unload_lora_adapter", response_class=PlainTextResponse)
async def unload_lora_adapter(body: UnloadLoraAdapterRequest,
                              request: Request) -> PlainTextResponse:
    if not body.lora_name:
        raise bad_request("'lora_name' needs to be provided to unload a LoRA adapter.")
    log.info("unload_lora_adapter %s (API key %s)", body.lora_name, _who(request))
    await request.app.state.adapters.unregister(body.lora_name)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
