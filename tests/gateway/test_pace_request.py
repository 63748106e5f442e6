"""A request's own pace (`target_itl_ms`, `target_ttft_ms`): it reaches the engine's sampling
parameters, unset means the worker's setting, and a bad value is a 400 in OpenAI's shape."""

from __future__ import annotations

import pytest

from tests.gateway.helpers import MODEL
from tests.gateway.test_gateway_errors import CHAT, COMPLETIONS, HI, assert_error


def body(path: str, **extra) -> dict:
    request = {"model": MODEL, "max_tokens": 4, **extra}
    request.update({"messages": HI} if path == CHAT else {"prompt": "hi"})
    return request


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
async def test_the_targets_reach_the_engine(http, engine, say, path):
    say("ok")
    response = await http.post(path, json=body(path, n=2, target_itl_ms=25.5,
                                               target_ttft_ms=0))
    assert response.status_code == 200, response.text
    assert [(r.params.target_itl_ms, r.params.target_ttft_ms) for r in engine.submitted] == \
        [(25.5, 0.0), (25.5, 0.0)]  # every choice; 0: no TTFT promise for this request


@pytest.mark.parametrize("extra", [{}, {"target_itl_ms": None, "target_ttft_ms": None}])
async def test_unset_or_null_is_the_workers_setting(http, engine, say, extra):
    say("ok")
    response = await http.post(CHAT, json=body(CHAT, **extra))
    assert response.status_code == 200, response.text
    params = engine.submitted[0].params
    assert params.target_itl_ms is None and params.target_ttft_ms is None


@pytest.mark.parametrize("param,value", [
    ("target_itl_ms", -1), ("target_itl_ms", 600_001), ("target_itl_ms", "fast"),
    ("target_ttft_ms", -0.5), ("target_ttft_ms", 1e9), ("target_ttft_ms", [1]),
])
@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
async def test_a_bad_target_is_a_400_naming_it(http, engine, path, param, value):
    error = assert_error(await http.post(path, json=body(path, **{param: value})), 400,
                         param=param)
    assert param in error["message"]
    assert error["type"] == "invalid_request_error"
    assert not engine.submitted
