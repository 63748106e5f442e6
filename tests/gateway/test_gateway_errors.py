"""Every failure is OpenAI's error shape with the right status; no input gives a 500."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st

from tests.gateway.helpers import CONTEXT_LENGTH, MODEL

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
HI = [{"role": "user", "content": "hi"}]


def assert_error(response, status: int, param: str | None = None, code: str | None = None) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    if param is not None:
        assert error["param"] == param
    if code is not None:
        assert error["code"] == code
    return error


async def test_malformed_json_is_400(http):
    for path in (CHAT, COMPLETIONS):
        response = await http.post(path, content=b'{"model": ', headers={
            "content-type": "application/json"})
        error = assert_error(response, 400, code="invalid_json")
        assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize("body", [b"[]", b'"text"', b"\xff\xfe", b"", b"null"])
async def test_body_that_is_not_an_object_is_400(http, body):
    response = await http.post(CHAT, content=body, headers={"content-type": "application/json"})
    assert_error(response, 400)


@pytest.mark.parametrize("path,body,param", [
    (CHAT, {"model": MODEL, "messages": HI, "temperature": "hot"}, "temperature"),
    (CHAT, {"model": MODEL, "messages": HI, "temperature": 2.5}, "temperature"),
    (CHAT, {"model": MODEL, "messages": HI, "n": 0}, "n"),
    (CHAT, {"model": MODEL, "messages": HI, "max_tokens": -1}, "max_tokens"),
    (CHAT, {"model": MODEL, "messages": HI, "top_logprobs": 50, "logprobs": True}, "top_logprobs"),
    (CHAT, {"model": MODEL, "messages": HI, "stream": "sometimes"}, "stream"),
    (CHAT, {"model": MODEL, "messages": HI, "priority": "urgent"}, "priority"),
    (CHAT, {"model": MODEL, "messages": HI, "num_speculative_tokens": -1},
     "num_speculative_tokens"),
    (CHAT, {"model": MODEL, "messages": HI, "num_speculative_tokens": 33},
     "num_speculative_tokens"),
    (CHAT, {"model": MODEL, "messages": HI, "stop": 5}, "stop"),
    (CHAT, {"model": MODEL, "messages": "hi"}, "messages"),
    (CHAT, {"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
    (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]},
     "messages.0.content"),
    (CHAT, {"messages": HI}, "model"),
    (COMPLETIONS, {"model": MODEL, "prompt": [1, "a"]}, "prompt"),
    (COMPLETIONS, {"model": MODEL, "prompt": [-1]}, "prompt"),
    (COMPLETIONS, {"model": MODEL, "prompt": "x", "logprobs": 99}, "logprobs"),
    (COMPLETIONS, {"model": MODEL, "prompt": "x", "seed": 2**70}, "seed"),
    (COMPLETIONS, {"model": MODEL}, "prompt"),
])
async def test_wrong_types_and_ranges_are_400_naming_the_parameter(http, path, body, param):
    error = assert_error(await http.post(path, json=body), 400, param=param)
    assert param.split(".")[-1] in error["message"]


async def test_parameter_combinations_are_400(http):
    response = await http.post(CHAT, json={"model": MODEL, "messages": HI, "top_logprobs": 2})
    assert "logprobs" in assert_error(response, 400)["message"]
    response = await http.post(COMPLETIONS, json={"model": MODEL, "prompt": "x", "stream": True,
                                                  "prompt_logprobs": 1})
    assert "prompt_logprobs" in assert_error(response, 400)["message"]


async def test_too_many_choices_is_400(http, engine):
    response = await http.post(COMPLETIONS, json={"model": MODEL, "prompt": ["a"] * 20, "n": 10})
    assert "200 choices" in assert_error(response, 400, param="n")["message"]
    assert engine.submitted == []


async def test_unknown_model_is_404(http):
    for path, extra in ((CHAT, {"messages": HI}), (COMPLETIONS, {"prompt": "x"})):
        response = await http.post(path, json={"model": "gpt-17", **extra})
        error = assert_error(response, 404, param="model", code="model_not_found")
        assert "gpt-17" in error["message"]


async def test_prompt_over_the_context_is_400_with_the_numbers(http, engine):
    too_long = [7] * (CONTEXT_LENGTH + 1)
    response = await http.post(COMPLETIONS, json={"model": MODEL, "prompt": too_long})
    error = assert_error(response, 400, code="context_length_exceeded")
    assert str(CONTEXT_LENGTH) in error["message"] and str(CONTEXT_LENGTH + 1) in error["message"]
    response = await http.post(COMPLETIONS, json={"model": MODEL, "prompt": [7] * 500,
                                                  "max_tokens": 100})
    error = assert_error(response, 400, param="max_tokens", code="context_length_exceeded")
    assert all(str(n) in error["message"] for n in (CONTEXT_LENGTH, 600, 500, 100))
    long_chat = [{"role": "user", "content": "word " * CONTEXT_LENGTH}]
    response = await http.post(CHAT, json={"model": MODEL, "messages": long_chat})
    assert_error(response, 400, code="context_length_exceeded")
    assert engine.submitted == []


async def test_max_tokens_default_is_capped_by_the_context(http, engine, say):
    say("ok")
    response = await http.post(COMPLETIONS, json={"model": MODEL, "prompt": [7] * 500})
    assert response.status_code == 200
    assert engine.submitted[0].params.max_tokens == CONTEXT_LENGTH - 500


async def test_empty_prompt_or_messages_is_400(http, engine):
    assert_error(await http.post(CHAT, json={"model": MODEL, "messages": []}), 400,
                 param="messages")
    for prompt in ("", [], [[]], [""]):
        assert_error(await http.post(COMPLETIONS, json={"model": MODEL, "prompt": prompt}), 400,
                     param="prompt")
    assert engine.submitted == []


async def test_body_over_the_limit_is_413(http, settings):
    big = {"model": MODEL, "prompt": "x" * (settings.max_body_bytes + 10)}
    assert_error(await http.post(COMPLETIONS, json=big), 413)

    async def chunked():  # no Content-Length: the limit is counted while reading
        payload = json.dumps(big).encode()
        for start in range(0, len(payload), 4096):
            yield payload[start:start + 4096]
    response = await http.post(COMPLETIONS, content=chunked(),
                               headers={"content-type": "application/json"})
    assert_error(response, 413)


async def test_engine_unavailable_is_503(http, engine):
    engine.unavailable = True
    for stream in (False, True):
        response = await http.post(CHAT, json={"model": MODEL, "messages": HI, "stream": stream})
        error = assert_error(response, 503)
        assert "Redis" in error["message"]


async def test_unknown_route_and_method_keep_the_shape(http):
    assert_error(await http.get("/v1/nothing"), 404)
    assert_error(await http.get(CHAT), 405)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=6),
                                                                      children, max_size=3),
    max_leaves=8)
fields = st.sampled_from(["model", "prompt", "messages", "max_tokens", "temperature", "top_p",
                          "n", "stop", "seed", "logprobs", "top_logprobs", "stream",
                          "stream_options", "echo", "top_k", "min_p", "priority", "user",
                          "max_completion_tokens", "stop_token_ids", "min_tokens"])


@hypothesis_settings(max_examples=40, deadline=None,
                     suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(path=st.sampled_from([CHAT, COMPLETIONS]),
       extra=st.dictionaries(fields, json_values, max_size=4))
async def test_no_input_gives_a_500(http, say, path, extra):
    say("ok")
    body = {"model": MODEL, "prompt": "hi", "messages": HI, **extra}
    response = await http.post(path, json=body)
    assert response.status_code in (200, 400, 404), response.text
    if response.status_code != 200:
        assert_error(response, response.status_code)
