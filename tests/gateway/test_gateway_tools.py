"""Tool calling and reasoning at the gateway (fake engine): the prompt, the forced-call grammar,
and replies with tool_calls / reasoning_content, whole and streamed."""

from __future__ import annotations

import json

import pytest

from kvfleet.gateway.app import create_app
from tests.gateway.helpers import MODEL, sse_events

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


async def chat(http, **body):
    body.setdefault("messages", ASK)
    return await http.post("/v1/chat/completions", json={"model": MODEL, **body})


async def test_tools_are_described_in_a_template_without_tools(http, engine, say, tokenizer):
    say("Sure.")
    assert (await chat(http, tools=[WEATHER, TIME])).status_code == 200
    prompt = tokenizer.decode(engine.submitted[0].prompt_token_ids)
    assert "<tools>" in prompt and '"name": "get_weather"' in prompt and "<tool_call>" in prompt
    # auto: free text, or calls that follow the tools' schemas once the model opens one
    auto = engine.submitted[0].params.constraint
    assert auto.kind == "lark" and "PLAIN" in auto.spec and '"const": "get_time"' in auto.spec
    say("Sure.")
    assert (await chat(http, tools=[WEATHER], tool_choice="none")).status_code == 200
    assert "<tools>" not in tokenizer.decode(engine.submitted[1].prompt_token_ids)


@pytest.mark.parametrize("tool_choice, names", [
    ("required", {"get_weather", "get_time"}),
    ({"type": "function", "function": {"name": "get_time"}}, {"get_time"}),
])
async def test_forced_calls_are_constrained(http, engine, say, tool_choice, names):
    say(CALL_TEXT)
    response = await chat(http, tools=[WEATHER, TIME], tool_choice=tool_choice)
    assert response.status_code == 200, response.text
    constraint = engine.submitted[0].params.constraint
    assert constraint.kind == "lark" and "<tool_call>" in constraint.spec
    assert {n for n in ("get_weather", "get_time") if f'"const": "{n}"' in constraint.spec} == names


@pytest.mark.parametrize("body, param", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
])
async def test_tool_choice_errors(http, engine, body, param):
    response = await chat(http, tools=[WEATHER], **body)
    assert response.status_code == 400 and response.json()["error"]["param"] == param


async def test_tool_choice_needs_tools(http):
    response = await chat(http, tool_choice="required")
    assert response.status_code == 400


async def test_reply_carries_tool_calls(http, say):
    say("Let me look.\n" + CALL_TEXT)
    response = await chat(http, tools=[WEATHER])
    [choice] = response.json()["choices"]
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert message["content"] == "Let me look."
    [call] = message["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}


async def test_stream_carries_tool_call_deltas(http, say):
    say(CALL_TEXT, per_event=1)
    response = await chat(http, tools=[WEATHER], tool_choice="required", stream=True)
    chunks = [json.loads(e) for e in sse_events(response.text) if e != "[DONE]"]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    calls = [d["tool_calls"] for d in deltas if "tool_calls" in d]
    assert len(calls) > 2, "the arguments come in several fragments"
    first = calls[0][0]
    assert first["index"] == 0 and first["id"].startswith("call_") and first["type"] == "function"
    assert first["function"]["name"] == "get_weather"
    assert all("id" not in c[0] and c[0]["index"] == 0 for c in calls[1:])
    arguments = "".join(c[0]["function"].get("arguments", "") for c in calls)
    assert json.loads(arguments) == {"city": "Paris"}
    assert not any(d.get("content") for d in deltas)
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


@pytest.mark.parametrize("extra", [{"min_tokens": 3}, {"ignore_eos": True},
                                   {"response_format": {"type": "json_object"}}])
async def test_auto_is_left_free_where_a_grammar_cannot_end_the_answer(http, engine, say, extra):
    say("Sure.")
    assert (await chat(http, tools=[WEATHER], **extra)).status_code == 200
    constraint = engine.submitted[0].params.constraint
    assert constraint is None or "PLAIN" not in constraint.spec


TWO_CALLS = CALL_TEXT + '\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'


async def test_parallel_tool_calls_false_keeps_the_first_call(http, engine, say):
    say("Checking.\n" + TWO_CALLS + "\ntrailing words")
    response = await chat(http, tools=[WEATHER, TIME], parallel_tool_calls=False)
    [choice] = response.json()["choices"]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Checking."
    assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == ["get_weather"]
    # ... and the grammar of the request allows one call only
    assert "calls: call\n" in engine.submitted[0].params.constraint.spec
    say(TWO_CALLS)
    response = await chat(http, tools=[WEATHER, TIME])  # parallel by default: both
    calls = response.json()["choices"][0]["message"]["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]


async def test_parallel_tool_calls_false_streams_one_call(http, say):
    say(TWO_CALLS + "\nmore", per_event=1)
    response = await chat(http, tools=[WEATHER, TIME], parallel_tool_calls=False, stream=True)
    chunks = [json.loads(e) for e in sse_events(response.text) if e != "[DONE]"]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    calls = [call for d in deltas for call in d.get("tool_calls", [])]
    assert calls and {c["index"] for c in calls} == {0}
    assert json.loads("".join(c["function"].get("arguments", "") for c in calls)) == {
        "city": "Paris"}
    assert not any(d.get("content") for d in deltas)
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


async def test_history_with_calls_and_results_reaches_the_prompt(http, engine, say, tokenizer):
    say("It is sunny.")
    messages = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "sunny"}'}]
    response = await chat(http, messages=messages, tools=[WEATHER])
    assert response.status_code == 200, response.text
    prompt = tokenizer.decode(engine.submitted[0].prompt_token_ids)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' \
        in prompt
    assert '<tool_response>\n{"sky": "sunny"}\n</tool_response>' in prompt
    assert response.json()["choices"][0]["message"] == {"role": "assistant",
                                                        "content": "It is sunny."}


@pytest.fixture
def thinking_app(settings, engine, tokenizer, model_info):
    settings.reasoning_parser = "think"
    return create_app(settings, engine, tokenizer, model_info=model_info)


async def test_reasoning_is_split_whole_and_streamed(thinking_app, say):
    import httpx

    transport = httpx.ASGITransport(app=thinking_app)
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as http:
        say("<think>Paris is in France.</think>\n\nIt is sunny.", per_event=1)
        whole = (await chat(http)).json()["choices"][0]["message"]
        assert whole["reasoning_content"] == "Paris is in France."
        assert whole["content"] == "It is sunny."
        say("<think>Paris is in France.</think>\n\nIt is sunny.", per_event=1)
        response = await chat(http, stream=True)
        deltas = [json.loads(e)["choices"][0]["delta"] for e in sse_events(response.text)
                  if e != "[DONE]"]
        assert "".join(d.get("reasoning_content", "") for d in deltas) == "Paris is in France."
        assert "".join(d.get("content", "") for d in deltas) == "It is sunny."


async def test_template_kwargs_and_continue_final_message(http, engine, say, tokenizer):
    say(" world")
    messages = ASK + [{"role": "assistant", "content": "Hello"}]
    response = await chat(http, messages=messages, add_generation_prompt=False,
                          continue_final_message=True, chat_template_kwargs={"x": 1})
    assert response.status_code == 200, response.text
    prompt = tokenizer.decode(engine.submitted[0].prompt_token_ids)
    assert prompt.endswith("<|im_start|>assistant\nHello")
    bad = await chat(http, messages=messages, continue_final_message=True)
    assert bad.status_code == 400
