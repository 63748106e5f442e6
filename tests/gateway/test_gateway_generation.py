"""ChoiceStream's ownership rules: the event stream is always closed, the request is cancelled
with the workers whenever the gateway stops before the final event, and the answer ends where the
worker's final event says."""

from __future__ import annotations

import asyncio

import pytest

from kvfleet.gateway.fleet.client import EngineTimeout
from kvfleet.gateway.output.background import BackgroundTasks
from kvfleet.gateway.output.choice_stream import ChoiceStream
from kvfleet.gateway.output.merge import merge_choices
from kvfleet.shared.wire import GenerationRequest, SamplingParams, TokenEvent, Usage
from tests.gateway.fakes import FakeEngineClient, token_events


def make_request(req_id="cmpl-g", stop=()):
    return GenerationRequest(req_id=req_id, model="m", prompt_token_ids=[1],
                             params=SamplingParams(stop=list(stop)))


async def start(engine, tokenizer, request, background):
    events = await engine.submit(request)
    return ChoiceStream(engine, request, events, tokenizer, background)


async def test_finished_request_is_closed_not_cancelled(tokenizer):
    engine = FakeEngineClient(lambda r: token_events(tokenizer.encode("hi"), prompt_tokens=1))
    background = BackgroundTasks()
    choice = await start(engine, tokenizer, make_request(), background)
    deltas = [d async for d in choice]
    await background.drain()
    assert deltas[-1].finish_reason == "stop" and deltas[-1].usage.completion_tokens == 1
    assert engine.closed == ["cmpl-g"] and engine.cancelled == []


async def test_consumer_cancelled_mid_stream_cancels_the_request(tokenizer):
    engine = FakeEngineClient(lambda r: [TokenEvent(seq=0, attempt=0, token_ids=[42])])
    background = BackgroundTasks()
    choice = await start(engine, tokenizer, make_request(), background)
    received = []

    async def consume():
        async for delta in choice:
            received.append(delta)
    task = asyncio.create_task(consume())
    while not received:
        await asyncio.sleep(0.01)
    task.cancel()  # what Starlette does when the client disconnects
    await asyncio.gather(task, return_exceptions=True)
    await background.drain()
    assert engine.cancelled == ["cmpl-g"] and engine.closed == ["cmpl-g"]


async def test_timeout_cancels_the_request(tokenizer):
    engine = FakeEngineClient(lambda r: [EngineTimeout("no worker answered")])
    background = BackgroundTasks()
    choice = await start(engine, tokenizer, make_request(), background)
    with pytest.raises(EngineTimeout):
        [d async for d in choice]
    await background.drain()
    assert engine.cancelled == ["cmpl-g"]


async def test_the_answer_ends_where_the_workers_final_event_says(tokenizer):
    ids = tokenizer.encode("a b STOP c")
    engine = FakeEngineClient(lambda r: [
        TokenEvent(seq=0, attempt=0, token_ids=ids[:3]),
        TokenEvent(seq=3, attempt=0, token_ids=ids[3:], finish_reason="stop",
                   usage=Usage(1, len(ids), 1), stop_reason="STOP", text_after_stop=len(" c"))])
    background = BackgroundTasks()
    choice = await start(engine, tokenizer, make_request(stop=["STOP"]), background)
    deltas = [d async for d in choice]
    await background.drain()
    assert "".join(d.text for d in deltas) == "a b "
    assert (deltas[-1].finish_reason, deltas[-1].stop_reason) == ("stop", "STOP")
    assert deltas[-1].usage.cached_tokens == 1 and engine.cancelled == []


async def test_a_stop_string_the_worker_went_past_is_text(tokenizer):
    """The gateway does not decide: the worker did not stop at this STOP (min_tokens, or text the
    client sees differently), so it is part of the answer."""
    ids = tokenizer.encode("a b STOP c")
    engine = FakeEngineClient(lambda r: [
        TokenEvent(seq=0, attempt=0, token_ids=ids),
        TokenEvent(seq=len(ids), attempt=0, token_ids=tokenizer.encode(" d"),
                   finish_reason="length", usage=Usage(1, len(ids) + 1))])
    background = BackgroundTasks()
    choice = await start(engine, tokenizer, make_request(stop=["STOP"]), background)
    deltas = [d async for d in choice]
    await background.drain()
    assert "".join(d.text for d in deltas) == "a b STOP c d"
    assert deltas[-1].finish_reason == "length" and deltas[-1].stop_reason is None
    assert engine.cancelled == []


async def test_merge_tags_items_by_source_and_raises_the_first_error():
    async def numbers(values, fail=False):
        for value in values:
            await asyncio.sleep(0)
            yield value
        if fail:
            raise ValueError("boom")
    merged = [item async for item in merge_choices([numbers([1, 2]), numbers([3])])]
    assert sorted(merged) == [(0, 1), (0, 2), (1, 3)]
    with pytest.raises(ValueError, match="boom"):
        [item async for item in merge_choices([numbers([1], fail=True), numbers([2])])]
