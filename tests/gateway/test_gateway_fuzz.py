"""Property-based fuzz of the gateway's OpenAPI schema (schemathesis): every generated request,
valid or not, must get an answer that is not a 5xx, and the server must still be healthy after.

The number of requests is `KVFLEET_FUZZ_REQUESTS` (default 500): a few for the operations without
inputs, the rest split over those with a body or parameters (Hypothesis may end an operation early
when its input space is exhausted). The 5,000-request run:
    KVFLEET_FUZZ_REQUESTS=5000 .venv/bin/python -m pytest tests/gateway/test_gateway_fuzz.py -m slow
"""

from __future__ import annotations

import math
import os

import pytest
import schemathesis  # noqa: E402  (test extra: the fuzz must run, never skip)
from hypothesis import HealthCheck, Phase, settings  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from starlette.testclient import TestClient

from kvfleet.gateway.app import create_app
from kvfleet.gateway.fleet.redis_context import RedisContext
from kvfleet.shared.settings import GatewaySettings
from tests.gateway.fakes import FakeEngineClient, token_events
from tests.gateway.helpers import MODEL

TOTAL_REQUESTS = int(os.environ.get("KVFLEET_FUZZ_REQUESTS", "500"))
SMALL_OPERATION_EXAMPLES = 20  # operations without a body (health, ready, models) have few inputs
slow_if_long = pytest.mark.slow if TOTAL_REQUESTS > 1000 else (lambda test: test)
SENT: list[int] = []


@pytest.fixture(scope="module")
def fuzz_settings(redis_server) -> GatewaySettings:
    return GatewaySettings(redis_url=redis_server.url, key_prefix="fuzz:", model=MODEL,
                           max_body_bytes=50_000, default_max_tokens=16,
                           request_timeout_s=30, first_event_timeout_s=5)


@pytest.fixture(scope="module")
def fuzz_redis(fuzz_settings) -> RedisContext:
    return RedisContext.from_settings(fuzz_settings)


@pytest.fixture(scope="module")
def fuzz_app(tokenizer, model_info, fuzz_settings, fuzz_redis):
    engine = FakeEngineClient()
    eos = tokenizer.eos_token_id
    engine.responder = lambda request: token_events(
        [11, 12, 13, eos], prompt_tokens=len(request.prompt_token_ids), logprobs=True)
    # A real Redis for the routes that keep state there (files, batches); the engine is fake.
    return create_app(fuzz_settings, engine, tokenizer, model_info=model_info, redis=fuzz_redis)


@pytest.fixture(scope="module")
def fuzz_schema(fuzz_app):
    return schemathesis.openapi.from_asgi("/openapi.json", fuzz_app)


def fuzz_operation(operation, max_examples: int) -> None:
    """Hypothesis over one operation's generated cases (schemathesis 4's pytest plugin does not
    run under pytest 9, so the strategies are driven here)."""
    from hypothesis import given

    @given(case=operation.as_strategy())
    @settings(max_examples=max_examples, deadline=None, database=None, derandomize=True,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    def run(case) -> None:
        response = case.call()
        SENT.append(response.status_code)
        case.validate_response(response, checks=[not_a_server_error])

    run()


@slow_if_long
def test_no_server_errors(fuzz_schema):
    operations = [result.ok() for result in fuzz_schema.get_all_operations()]
    rich = [op for op in operations if op.body or op.path_parameters or op.query]
    assert {op.path for op in rich} >= {"/v1/completions", "/v1/chat/completions"}
    for operation in operations:
        if operation not in rich:
            fuzz_operation(operation, SMALL_OPERATION_EXAMPLES)
    for index, operation in enumerate(rich):  # the rest of the budget, evenly
        left = TOTAL_REQUESTS - len(SENT)
        fuzz_operation(operation, max(math.ceil(left / (len(rich) - index)), 1))
    print(f"fuzz: {len(SENT)} requests, statuses {sorted(set(SENT))}")


@slow_if_long
def test_healthy_after_fuzzing(fuzz_app, fuzz_redis):
    # The fuzz cases ran in event loops of their own, and the asyncio Redis client pooled
    # connections made there: one of them reused from this loop (while the old loop is not yet
    # collected) fails with "attached to a different loop". A gateway runs in one loop; here the
    # pool starts afresh in the loop of this client.
    fuzz_redis.redis.connection_pool.reset()
    with TestClient(fuzz_app) as client:
        assert client.get("/health").json() == {"status": "ok"}
        response = client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi"})
        assert response.status_code == 200, response.text
        metrics = client.get("/metrics").text
    assert 'outcome="500"' not in metrics
