"""Fixtures of the gateway tests: the real SmolLM2 tokenizer (loaded once), a fake engine, the
app."""

from __future__ import annotations

import httpx
import pytest

from kvfleet.gateway.app import create_app
from kvfleet.gateway.models.tokenization import ModelInfo
from kvfleet.shared.models import DEFAULT_MODEL, load_tokenizer, resolve_model_path
from kvfleet.shared.settings import GatewaySettings
from tests.gateway.fakes import FakeEngineClient
from tests.gateway.helpers import CONTEXT_LENGTH, MODEL


@pytest.fixture(scope="session")
def tokenizer():
    return load_tokenizer(resolve_model_path(DEFAULT_MODEL))


@pytest.fixture(scope="session")
def model_info(tokenizer) -> ModelInfo:
    return ModelInfo(served_id=MODEL, context_length=CONTEXT_LENGTH, vocab_size=len(tokenizer))


@pytest.fixture
def settings() -> GatewaySettings:
    return GatewaySettings(redis_url="redis://127.0.0.1:1/0", model=MODEL, max_body_bytes=50_000,
                           default_max_tokens=64, request_timeout_s=30,
                           first_event_timeout_s=5)


@pytest.fixture
def engine() -> FakeEngineClient:
    return FakeEngineClient()


@pytest.fixture
def app(settings, engine, tokenizer, model_info):
    return create_app(settings, engine, tokenizer, model_info=model_info)


@pytest.fixture
async def http(app):
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
        yield client


@pytest.fixture
def say(engine, tokenizer):
    """say("text", **token_events options): every request answers `text` (plus EOS), or as much
    of it as a worker would before a stop the request asks for."""
    from tests.gateway.fakes import worker_events

    def configure(text: str, eos: bool = True, **options):
        ids = tokenizer.encode(text) + ([tokenizer.eos_token_id] if eos else [])
        engine.responder = lambda request: worker_events(request, ids, tokenizer, **options)
        return ids
    return configure
