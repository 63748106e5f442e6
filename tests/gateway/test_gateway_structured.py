"""Structured outputs, logit_bias and refused fields at the gateway (fake engine): what reaches
the worker in the request record, and the 400s."""

from __future__ import annotations

import json
import logging

import pytest

from kvfleet.shared.wire import GenerationRequest
from tests.gateway.helpers import MODEL

MESSAGES = [{"role": "user", "content": "Give me a person."}]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}


async def chat(http, **body):
    return await http.post("/v1/chat/completions",
                           json={"model": MODEL, "messages": MESSAGES, **body})


@pytest.mark.parametrize("body, kind, spec", [
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}},
     "json_schema", SCHEMA),
    ({"response_format": {"type": "json_object"}}, "json_object", None),
    ({"guided_json": SCHEMA}, "json_schema", SCHEMA),
    ({"guided_json": json.dumps(SCHEMA)}, "json_schema", SCHEMA),
    ({"guided_regex": "[0-9]+"}, "regex", "[0-9]+"),
    ({"guided_choice": ["yes", "no"]}, "choice", ["yes", "no"]),
    ({"structured_outputs": {"choice": ["a", "b"]}}, "choice", ["a", "b"]),
    ({"structured_outputs": {"json": SCHEMA}}, "json_schema", SCHEMA),
    ({"guided_grammar": 'start: "x"'}, "lark", 'start: "x"'),
])
async def test_constraint_reaches_the_request_record(http, engine, say, body, kind, spec):
    say('{"name": "Ann"}')
    response = await chat(http, n=2, **body)
    assert response.status_code == 200, response.text
    for request in engine.submitted:  # every choice carries it, through msgpack
        constraint = GenerationRequest.unpack(request.pack()).params.constraint
        assert constraint.kind == kind
        if kind in ("json_schema", "choice"):
            assert json.loads(constraint.spec) == spec
        elif spec is not None:
            assert constraint.spec == spec


async def test_response_format_on_completions(http, engine, say):
    say("{}")
    response = await http.post("/v1/completions", json={
        "model": MODEL, "prompt": "JSON:", "response_format": {"type": "json_object"}})
    assert response.status_code == 200, response.text
    assert engine.submitted[0].params.constraint.kind == "json_object"


async def test_text_response_format_is_free(http, engine, say):
    say("hi")
    assert (await chat(http, response_format={"type": "text"})).status_code == 200
    assert engine.submitted[0].params.constraint is None


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}},
     "response_format"),
    ({"guided_regex": "(open"}, "guided_regex"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
    ({"guided_regex": "a+", "min_tokens": 3}, "min_tokens"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
])
async def test_bad_constraints_are_400s_naming_the_field(http, engine, body, param):
    response = await chat(http, **body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    assert engine.submitted == []


async def test_logit_bias_reaches_the_worker_and_is_checked(http, engine, say):
    say("ok")
    response = await chat(http, logit_bias={"17": -100, "42": 5.5})
    assert response.status_code == 200, response.text
    assert engine.submitted[0].params.logit_bias == {17: -100.0, 42: 5.5}
    for bias, param in [({"999999": 1}, "logit_bias"), ({"17": 101}, "logit_bias.17"),
                        ({"abc": 1}, "logit_bias")]:
        response = await chat(http, logit_bias=bias)
        assert response.status_code == 400 and response.json()["error"]["param"] == param


@pytest.mark.parametrize("field, value", [
    ("audio", {"voice": "alloy", "format": "wav"}), ("prediction", {"type": "content",
                                                                    "content": "x"}),
    ("web_search_options", {}), ("functions", [{"name": "f"}]), ("function_call", "auto"),
])
async def test_unsupported_openai_fields_are_named(http, engine, field, value):
    response = await chat(http, **{field: value})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == field and field in error["message"]
    assert error["code"] == "unsupported_parameter" and engine.submitted == []


@pytest.mark.parametrize("field, value", [("modalities", ["audio"]), ("store", True),
                                          ("service_tier", "flex")])
async def test_unsupported_values_are_named(http, field, value):
    response = await chat(http, **{field: value})
    assert response.status_code == 400 and response.json()["error"]["param"].startswith(field)


async def test_best_of_returns_the_most_likely_candidates(http, engine, tokenizer):
    """best_of candidates are sampled; the n with the highest cumulative logprob come back, best
    first, and every candidate's tokens are billed."""
    from kvfleet.shared.wire import TokenEvent, TokenLogprob, Usage

    scores = {0: -3.0, 1: -0.5, 2: -1.5}  # candidate index -> logprob of each of its tokens

    def responder(request):
        index = int(request.req_id.rsplit("-", 1)[1])
        ids = tokenizer.encode(f" candidate {index}")
        entries = [TokenLogprob(t, scores[index]) for t in ids]
        return [TokenEvent(seq=0, attempt=0, token_ids=ids, logprobs=entries,
                           finish_reason="length", usage=Usage(2, len(ids)))]
    engine.responder = responder
    response = await http.post("/v1/completions", json={
        "model": MODEL, "prompt": [5, 6], "best_of": 3, "n": 2, "max_tokens": 3, "seed": 1})
    assert response.status_code == 200, response.text
    body = response.json()
    assert [c["text"] for c in body["choices"]] == [" candidate 1", " candidate 2"]
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert all(c["logprobs"] is None for c in body["choices"])  # not asked for
    assert len(engine.submitted) == 3
    assert all(r.params.logprobs == 0 for r in engine.submitted)  # for the ranking
    per_candidate = len(tokenizer.encode(" candidate 0"))
    assert body["usage"]["completion_tokens"] == 3 * per_candidate
    assert body["usage"]["prompt_tokens"] == 2


@pytest.mark.parametrize("body", [{"best_of": 1, "n": 2},
                                  {"best_of": 3, "stream": True},
                                  {"best_of": 129}])
async def test_bad_best_of_is_400(http, engine, body):
    response = await http.post("/v1/completions", json={"model": MODEL, "prompt": "x", **body})
    assert response.status_code == 400, response.text
    assert "best_of" in response.json()["error"]["message"]
    assert engine.submitted == []


async def test_unknown_fields_are_ignored_with_a_warning(http, engine, say, caplog):
    say("ok")
    with caplog.at_level(logging.WARNING, logger="kvfleet.gateway.openai.fields"):
        response = await chat(http, frobnicate=1, my_tracking_tag="x",
                              modalities=["text"], store=False, service_tier="auto")
    assert response.status_code == 200, response.text
    assert "frobnicate" in caplog.text and "my_tracking_tag" in caplog.text


@pytest.mark.parametrize("messages, param", [
    ([{"role": "user"}], "messages.0"),
    ([{"role": "system", "content": None}, {"role": "user", "content": "x"}], "messages.0"),
    ([{"role": "user", "content": "x"}, {"role": "tool", "content": "42"}], "messages.1"),
])
async def test_messages_without_required_fields(http, messages, param):
    response = await http.post("/v1/chat/completions", json={"model": MODEL, "messages": messages})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


@pytest.mark.parametrize("value", ["true", 1, "yes"])
async def test_stream_must_be_a_boolean(http, value):
    response = await chat(http, stream=value)
    assert response.status_code == 400 and response.json()["error"]["param"] == "stream"
