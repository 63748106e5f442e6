"""`--served-model-name` across the fleet: a real gateway and a real worker service (a tiny
engine) on a real Redis, both given the names. The worker reads the streams the gateway writes
for a request naming an alias (the first name's), and the blocks it announces are hashed from
the first name's root: the gateway's router finds them for the same prompt."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from kvfleet.gateway.app import create_app
from kvfleet.gateway.models.tokenization import ModelInfo
from kvfleet.shared.models import DEFAULT_MODEL, load_tokenizer, resolve_model_path
from kvfleet.shared.redis_connect import connect
from kvfleet.shared.settings import GatewaySettings, WorkerSettings
from kvfleet.shared.wire.prefix_hash import block_hashes, root_hash
from tests.engine.tiny_models import VOCAB, TinyModel, random_prompt
from tests.helpers.service_thread import serving
from kvfleet.worker.process.main import worker_protocol
from kvfleet.worker.process.service import WorkerService

HUB = "HuggingFaceTB/SmolLM2-135M-Instruct"
NAMES = [HUB, "smol"]
PREFIX = "kvsrv:"
BS = 4  # the tiny engine's block size


@pytest.fixture(scope="module")
def tiny() -> TinyModel:
    return TinyModel("llama")


@pytest.fixture
def worker(redis_url, tiny):
    """A worker service started as `kvfleet worker --served-model-name HUB smol` would be, its
    loop in a thread."""
    settings = WorkerSettings(redis_url=redis_url, model="tiny", served_model_name=f"{HUB},smol",
                              key_prefix=PREFIX, worker_id="w-names", heartbeat_interval_s=0.05,
                              read_block_ms=10)
    client = connect(redis_url)
    protocol = worker_protocol(settings, client, settings.worker_id)
    service = WorkerService(settings, tiny.engine(num_blocks=64, block_size=BS), client, protocol)
    with serving(service):
        yield service
    client.close()


async def test_a_worker_serves_what_the_gateway_writes_for_an_alias(redis_url, worker):
    settings = GatewaySettings(redis_url=redis_url, model=DEFAULT_MODEL, served_model_name=NAMES,
                               key_prefix=PREFIX, request_timeout_s=30, first_event_timeout_s=20)
    tokenizer = load_tokenizer(resolve_model_path(DEFAULT_MODEL))
    info = ModelInfo(served_id=settings.served_names()[0], context_length=512,
                     vocab_size=VOCAB)
    app = create_app(settings, None, tokenizer, model_info=info)
    prompt = random_prompt(17, seed=5)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw",
                                     timeout=30) as http:
            response = await http.post("/v1/completions", json={
                "model": "smol", "prompt": prompt, "max_tokens": 4, "temperature": 0,
                "ignore_eos": True})
            assert response.status_code == 200, response.text
            body = response.json()
            assert body["model"] == HUB and body["usage"]["completion_tokens"] == 4
            assert worker.protocol.model == HUB
            # the worker's blocks, announced under the first name, hashed from its root
            keys = settings.keys()
            redis = connect(redis_url)
            held = redis.smembers(keys.kv_blocks(HUB, "w-names"))
            redis.close()
            expected = {h[:8] for h in block_hashes(prompt, BS, root_hash(HUB))}
            assert expected <= held
            # ... and the gateway's router, hashing the same prompt, finds them there
            router = app.state.client.router
            for attempt in range(200):  # once its index has read the announcements
                route = router.route(HUB, prompt, f"probe-{attempt}")
                router.finished(f"probe-{attempt}")
                if route.reason == "affinity":
                    break
                await asyncio.sleep(0.05)
            assert (route.worker, route.reason) == ("w-names", "affinity")
            assert route.cached_tokens == len(prompt) // BS * BS
