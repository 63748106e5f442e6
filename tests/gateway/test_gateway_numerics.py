"""The numerics a response was computed on, as OpenAI's `system_fingerprint`: the final events'
`numerics` (worker/engine/model/numerics.py), one fingerprint, or several joined by "+" where a
stream was resumed on other numerics (or its choices came from workers of different ones)."""

from __future__ import annotations

import itertools
import json

import pytest

from kvfleet.gateway.openai.serving import UsageTally
from kvfleet.shared.wire import Usage
from tests.gateway.fakes import token_events
from tests.gateway.helpers import MODEL, sse_events

MESSAGES = [{"role": "user", "content": "Hi!"}]


def test_the_tally_joins_the_fingerprints_in_order_each_once():
    tally = UsageTally(2)
    assert tally.system_fingerprint() is None  # no worker said
    tally.add(0, Usage(3, 2), "fp_a")
    assert tally.system_fingerprint() == "fp_a"
    tally.add(1, Usage(3, 2), "fp_a+fp_b")
    assert tally.system_fingerprint() == "fp_a+fp_b"
    tally.add(2, Usage(3, 2), "fp_b+fp_a")
    tally.add(3, Usage(3, 2), None)
    assert tally.system_fingerprint() == "fp_a+fp_b"


@pytest.fixture
def numerics_say(engine, tokenizer):
    """Each request answers 'Hello there' with the next chain of `chains` in its final event."""
    def script(*chains):
        chain = itertools.cycle(chains)

        def respond(request):
            events = token_events(tokenizer.encode("Hello there"),
                                  prompt_tokens=len(request.prompt_token_ids))
            events[-1].numerics = next(chain)
            return events
        engine.responder = respond
    return script


@pytest.mark.parametrize("chains, expected", [
    (["fp_a"], "fp_a"), (["fp_a+fp_b"], "fp_a+fp_b"), ([None], None)])
async def test_a_response_names_the_numerics_it_was_computed_on(http, numerics_say, chains,
                                                                 expected):
    numerics_say(*chains)
    for route, body in (("/v1/chat/completions", {"messages": MESSAGES}),
                        ("/v1/completions", {"prompt": "Hi"})):
        response = await http.post(route, json={"model": MODEL, **body})
        assert response.status_code == 200, response.text
        assert response.json()["system_fingerprint"] == expected


async def test_choices_of_different_numerics_are_both_named(http, numerics_say):
    numerics_say("fp_a", "fp_b")
    response = await http.post("/v1/chat/completions",
                               json={"model": MODEL, "messages": MESSAGES, "n": 2})
    assert response.json()["system_fingerprint"] == "fp_a+fp_b"


@pytest.mark.parametrize("route, body", [("/v1/chat/completions", {"messages": MESSAGES}),
                                         ("/v1/completions", {"prompt": "Hi"})])
async def test_a_stream_names_them_in_each_choices_last_chunk_and_the_usage_chunk(
        http, numerics_say, route, body):
    numerics_say("fp_a+fp_b")
    response = await http.post(route, json={"model": MODEL, "stream": True, **body,
                                            "stream_options": {"include_usage": True}})
    chunks = [json.loads(e) for e in sse_events(response.text)[:-1]]
    finish = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert [c["system_fingerprint"] for c in finish] == ["fp_a+fp_b"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["system_fingerprint"] == "fp_a+fp_b"
    others = [c for c in chunks[:-1] if c not in finish]
    assert others and all(c["system_fingerprint"] is None for c in others)
