"""Tool-call parsing of the three formats, whole and streamed in every split."""

from __future__ import annotations

import json

import pytest

from kvfleet.gateway.tools.formats import HERMES, LLAMA3_JSON, MISTRAL, format_for_template
from kvfleet.gateway.tools.parser import ToolCallParser, parse_tool_calls

WEATHER = '{"city": "Paris", "unit": {"kind": "celsius"}}'
TIME = '{"tz": "UTC"}'

CASES = [
    (HERMES, f'Let me check.\n<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER}}}\n'
             f'</tool_call>\n<tool_call>\n{{"name": "get_time", "arguments": {TIME}}}\n</tool_call>',
     "Let me check.", [("get_weather", WEATHER), ("get_time", TIME)]),
    (LLAMA3_JSON, f'{{"name": "get_weather", "parameters": {WEATHER}}}; '
                  f'{{"name": "get_time", "parameters": {TIME}}}',
     "", [("get_weather", WEATHER), ("get_time", TIME)]),
    (LLAMA3_JSON, f'<|python_tag|>{{"name": "get_time", "parameters": {TIME}}}', "",
     [("get_time", TIME)]),
    (MISTRAL, f'[TOOL_CALLS][{{"name": "get_weather", "arguments": {WEATHER}}}, '
              f'{{"name": "get_time", "arguments": {TIME}}}]',
     "", [("get_weather", WEATHER), ("get_time", TIME)]),
    (MISTRAL, f'[{{"name": "get_time", "arguments": {TIME}}}]', "", [("get_time", TIME)]),
]


@pytest.mark.parametrize("fmt, text, content, calls", CASES)
def test_whole_answer(fmt, text, content, calls):
    got_content, got_calls = parse_tool_calls(text, fmt)
    assert got_content == content
    assert [(c.name, c.arguments) for c in got_calls] == calls
    assert all(json.loads(c.arguments) for c in got_calls)
    assert len({c.id for c in got_calls}) == len(calls)


@pytest.mark.parametrize("fmt, text, content, calls", CASES)
@pytest.mark.parametrize("step", [1, 2, 5, 17])
def test_streamed_in_pieces_gives_the_same_calls(fmt, text, content, calls, step):
    parser = ToolCallParser(fmt)
    pieces = [parser.feed(text[i:i + step]) for i in range(0, len(text), step)]
    pieces.append(parser.finish())
    assert "".join(p.content for p in pieces) == content
    streamed: dict[int, dict] = {}
    for piece in pieces:
        for delta in piece.calls:
            call = streamed.setdefault(delta.index, {"id": None, "name": None, "arguments": ""})
            if delta.id is not None:
                assert call["id"] is None, "id and name come once"
                call["id"], call["name"] = delta.id, delta.name
            call["arguments"] += delta.arguments
    assert [(streamed[i]["name"], streamed[i]["arguments"]) for i in sorted(streamed)] == calls
    assert [streamed[i]["id"] for i in sorted(streamed)] == [c.id for c in parser.calls]


def test_arguments_stream_before_the_call_ends():
    parser = ToolCallParser(HERMES)
    first = parser.feed('<tool_call>\n{"name": "f", "arguments": {"text": "a long')
    assert first.calls[0].name == "f"
    assert "".join(d.arguments for d in first.calls) == '{"text": "a long'


@pytest.mark.parametrize("fmt, text", [
    (HERMES, "No tools needed: the answer is 4."),
    (HERMES, "I would use <tool_call> but it is broken {"),
    (LLAMA3_JSON, "Plain words, then {braces}."),
    (LLAMA3_JSON, '{"not": "a call"}'),
])
def test_text_that_is_not_a_call_stays_content(fmt, text):
    content, calls = parse_tool_calls(text, fmt)
    assert calls == [] and content == text


def test_format_follows_the_template():
    assert format_for_template("...<tool_call>...tools...") is HERMES
    assert format_for_template("...[TOOL_CALLS]...") is MISTRAL
    assert format_for_template("{{'<|python_tag|>'}} tools") is LLAMA3_JSON
    assert format_for_template("{{ message['content'] }}") is HERMES  # no tools: our prompt's
    assert format_for_template("<tool_call>", configured="mistral") is MISTRAL
