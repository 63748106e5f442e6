"""The template-built SSE frames equal what the pydantic chunk models produce (`chunk_json`)."""

from __future__ import annotations

import json

import pytest

from kvfleet.gateway.openai.responses import (
    ChatChoiceLogprobs,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatDelta,
    ChatLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    TopLogprob,
    UsageInfo,
    chunk_json,
)
from kvfleet.gateway.openai.sse_chunks import ChatChunkEncoder, CompletionChunkEncoder

ID, CREATED, MODEL = "cmpl-0123abcd", 1_764_400_000, 'Smol"LM2/135M\\x'
TEXTS = ["", " the", 'quote " backslash \\ slash /', "tab\tnew\nline\r\x00\x1f", "emoji 😀🎉",
         "日本語", "\u2028\u2029 separators", "\ufffd"]


def payload(frame: bytes) -> dict:
    text = frame.decode()
    assert text.startswith("data: ") and text.endswith("\n\n")
    return json.loads(text[len("data: "):-2])


def pydantic_frame(chunk) -> bytes:
    return f"data: {chunk_json(chunk)}\n\n".encode()


def completion_logprobs() -> CompletionLogprobs:
    return CompletionLogprobs(tokens=[" the", "😀"], token_logprobs=[-0.25, float("-inf")],
                              top_logprobs=[{" the": -0.25, " a": -1.5}, {"😀": -3.0}],
                              text_offset=[0, 4])


def chat_logprobs() -> ChatChoiceLogprobs:
    top = [TopLogprob(token=" the", logprob=-0.25, bytes=[32, 116, 104, 101]),
           TopLogprob(token="\ufffd", logprob=-2.0, bytes=[240])]
    return ChatChoiceLogprobs(content=[ChatLogprob(token=" the", logprob=-0.25,
                                                   bytes=[32, 116, 104, 101], top_logprobs=top)])


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("with_logprobs", [False, True])
@pytest.mark.parametrize("finish_reason", [None, "stop", "length"])
def test_completion_frames_equal_the_pydantic_chunks(text, with_logprobs, finish_reason):
    logprobs = completion_logprobs() if with_logprobs else None
    frame = CompletionChunkEncoder(ID, CREATED, MODEL).text(3, text, logprobs, finish_reason)
    expected = pydantic_frame(CompletionResponse(
        id=ID, created=CREATED, model=MODEL, choices=[CompletionChoice(
            index=3, text=text, logprobs=logprobs, finish_reason=finish_reason)]))
    assert payload(frame) == payload(expected)
    assert frame == expected  # byte-equal too: same field order and separators


STOP_REASONS = [None, 7, "\nUser:", 'quote " and 😀']


@pytest.mark.parametrize("stop_reason", STOP_REASONS)
def test_final_frames_carry_the_stop_reason_as_the_pydantic_chunks(stop_reason):
    """`stop_reason` beside a finish reason only, as vLLM's final chunk (a token id stays a
    number)."""
    frame = CompletionChunkEncoder(ID, CREATED, MODEL).text(0, "", None, "stop", stop_reason)
    expected = pydantic_frame(CompletionResponse(
        id=ID, created=CREATED, model=MODEL, choices=[CompletionChoice(
            index=0, text="", finish_reason="stop", stop_reason=stop_reason)]))
    assert frame == expected and payload(frame)["choices"][0]["stop_reason"] == stop_reason
    frame = ChatChunkEncoder(ID, CREATED, MODEL).finish(1, "stop", stop_reason)
    expected = pydantic_frame(ChatCompletionChunk(
        id=ID, created=CREATED, model=MODEL, choices=[ChatChunkChoice(
            index=1, delta=ChatDelta(), finish_reason="stop", stop_reason=stop_reason)]))
    assert frame == expected and payload(frame)["choices"][0]["stop_reason"] == stop_reason
    middle = CompletionChunkEncoder(ID, CREATED, MODEL).text(0, "x")
    assert "stop_reason" not in payload(middle)["choices"][0]


def test_completion_usage_frame_equals_the_pydantic_chunk():
    usage = UsageInfo.of(12, 30, 8)
    frame = CompletionChunkEncoder(ID, CREATED, MODEL).usage(usage)
    expected = pydantic_frame(CompletionResponse(id=ID, created=CREATED, model=MODEL, choices=[],
                                                 usage=usage))
    assert payload(frame) == payload(expected)
    assert frame == expected


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("with_logprobs", [False, True])
def test_chat_content_frames_equal_the_pydantic_chunks(text, with_logprobs):
    logprobs = chat_logprobs() if with_logprobs else None
    frame = ChatChunkEncoder(ID, CREATED, MODEL).content(1, text, logprobs)
    expected = pydantic_frame(ChatCompletionChunk(
        id=ID, created=CREATED, model=MODEL,
        choices=[ChatChunkChoice(index=1, delta=ChatDelta(content=text), logprobs=logprobs)]))
    assert payload(frame) == payload(expected)
    assert frame == expected


def test_chat_role_finish_and_usage_frames_equal_the_pydantic_chunks():
    encoder = ChatChunkEncoder(ID, CREATED, MODEL)

    def chunk(**fields) -> bytes:
        return pydantic_frame(ChatCompletionChunk(id=ID, created=CREATED, model=MODEL, **fields))

    role = chunk(choices=[ChatChunkChoice(index=0, delta=ChatDelta(role="assistant",
                                                                   content=""))])
    finish = chunk(choices=[ChatChunkChoice(index=2, delta=ChatDelta(), finish_reason="length")])
    usage = UsageInfo.of(5, 7, 0)
    for frame, expected in ((encoder.role(0), role), (encoder.finish(2, "length"), finish),
                            (encoder.usage(usage), chunk(choices=[], usage=usage))):
        assert payload(frame) == payload(expected)
        assert frame == expected
