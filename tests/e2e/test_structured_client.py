"""Structured outputs and tool calls through the official `openai` client, on a real fleet with
the default model (SmolLM2-135M, whose chat template has no tools)."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from pydantic import BaseModel, Field

from kvfleet.shared.models import DEFAULT_MODEL

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

PERSON_SCHEMA = {
    "type": "object", "additionalProperties": False, "required": ["name", "age", "ok"],
    "properties": {"name": {"type": "string", "maxLength": 10},
                   "age": {"type": "integer", "minimum": 0, "maximum": 120},
                   "ok": {"type": "boolean"}}}
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                   "properties": {"city": {"type": "string", "maxLength": 20}}}}}
ASK_WEATHER = [{"role": "user", "content": "What is the weather like in Paris?"}]


class City(BaseModel):
    name: str = Field(max_length=20)
    country: str = Field(max_length=20)
    population_millions: int = Field(ge=0, le=50)


@pytest.fixture
def client(fleet) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{fleet.url}/v1", api_key="unused", timeout=300)


def test_parse_returns_the_pydantic_object(client):
    reply = client.beta.chat.completions.parse(
        model=DEFAULT_MODEL, response_format=City, max_tokens=60, temperature=0,
        messages=[{"role": "user", "content": "Describe Paris as JSON."}])
    choice = reply.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, City)
    assert City.model_validate_json(choice.message.content) == choice.message.parsed


def test_json_is_valid_in_200_samples_at_temperature_1(client):
    """200 sampled answers (8 requests x n=25, each batched on the worker) all parse and fit the
    schema. Two requests at a time: 25 queued ahead of one n=25 request stay under the fleet's
    queue-wait limit (429 beyond)."""

    def sample(seed: int):
        return client.with_options(max_retries=0).chat.completions.create(
            model=DEFAULT_MODEL, n=25, temperature=1.0, seed=seed, max_tokens=48,
            messages=[{"role": "user", "content": "Invent a person."}],
            response_format={"type": "json_schema",
                             "json_schema": {"name": "person", "schema": PERSON_SCHEMA}})

    with ThreadPoolExecutor(max_workers=2) as pool:
        replies = list(pool.map(sample, range(8)))
    answers = [c for r in replies for c in r.choices]
    assert len(answers) == 200
    values = []
    for choice in answers:
        assert choice.finish_reason == "stop", choice.message.content
        value = json.loads(choice.message.content)
        assert set(value) == {"name", "age", "ok"} and 0 <= value["age"] <= 120
        assert isinstance(value["ok"], bool) and len(value["name"]) <= 10
        values.append(json.dumps(value, sort_keys=True))
    assert len(set(values)) > 20, "temperature 1 should give varied answers"


def _final_answer_messages(call) -> list[dict]:
    return ASK_WEATHER + [
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": call.id, "type": "function",
            "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id,
         "content": json.dumps({"city": "Paris", "sky": "sunny", "celsius": 21})}]


def test_tool_round_trip(client):
    first = client.chat.completions.create(
        model=DEFAULT_MODEL, messages=ASK_WEATHER, tools=[WEATHER_TOOL], tool_choice="required",
        parallel_tool_calls=False, temperature=0, max_tokens=60)  # a 135M model repeats calls
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    assert set(json.loads(call.function.arguments)) == {"city"}
    final = client.chat.completions.create(
        model=DEFAULT_MODEL, messages=_final_answer_messages(call), tools=[WEATHER_TOOL],
        tool_choice="none", temperature=0, max_tokens=40)
    assert final.choices[0].message.content and not final.choices[0].message.tool_calls


def test_tool_round_trip_streamed(client):
    stream = client.chat.completions.create(
        model=DEFAULT_MODEL, messages=ASK_WEATHER, tools=[WEATHER_TOOL], stream=True,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        temperature=0, max_tokens=60)
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"id": None, "name": None, "arguments": ""})
                call["id"] = call["id"] or delta.id
                if delta.function and delta.function.name:
                    call["name"] = delta.function.name
                call["arguments"] += (delta.function.arguments or "") if delta.function else ""
            finish = choice.finish_reason or finish
    assert finish == "tool_calls" and list(calls) == [0]
    call = calls[0]
    assert call["name"] == "get_weather" and set(json.loads(call["arguments"])) == {"city"}

    class Call:  # the shape _final_answer_messages reads
        id = call["id"]
        function = type("F", (), {"name": call["name"], "arguments": call["arguments"]})

    stream = client.chat.completions.create(
        model=DEFAULT_MODEL, messages=_final_answer_messages(Call), tools=[WEATHER_TOOL],
        stream=True, temperature=0, max_tokens=40)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text.strip()


def test_unsupported_field_is_a_400_naming_it(client):
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model=DEFAULT_MODEL, messages=ASK_WEATHER,
                                       extra_body={"prediction": {"type": "content",
                                                                  "content": "x"}})
    assert error.value.body["param"] == "prediction"
