"""Long prompts are tokenised in a worker thread, with the same result as on the event loop."""

from __future__ import annotations

import threading

import pytest

from kvfleet.gateway.http.errors import APIError
from kvfleet.gateway.models.tokenization import PromptProcessor

LONG = "The quick brown fox jumps over the lazy dog. 日本語のテキスト 😀 " * 40


@pytest.fixture
def processors(tokenizer, model_info):
    return (PromptProcessor(tokenizer, model_info, offload_min_chars=10**9),
            PromptProcessor(tokenizer, model_info, offload_min_chars=1))


async def test_offloaded_tokenisation_equals_inline(processors):
    inline, offloaded = processors
    for prompt in ["short", LONG[:400], [LONG[:300], "x"], [1, 2, 3]]:
        assert (await offloaded.completion_prompts_async(prompt)
                == await inline.completion_prompts_async(prompt)
                == inline.completion_prompts(prompt))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": LONG[:400]}]
    assert (await offloaded.chat_prompt_async(messages)
            == await inline.chat_prompt_async(messages) == inline.chat_prompt(messages))


async def test_only_long_prompts_leave_the_event_loop(tokenizer, model_info, monkeypatch):
    processor = PromptProcessor(tokenizer, model_info, offload_min_chars=100)
    calls = []
    encode = PromptProcessor._encode

    def recording_encode(self, text):
        calls.append((threading.current_thread().name, self.tokenizer))
        return encode(self, text)

    monkeypatch.setattr(PromptProcessor, "_encode", recording_encode)
    await processor.completion_prompts_async("short")
    await processor.completion_prompts_async(LONG)
    assert calls[0] == (threading.current_thread().name, tokenizer)
    thread, thread_tokenizer = calls[1]
    assert thread.startswith("kvfleet-tokenize")
    # the thread never shares the event loop's tokenizer object
    assert thread_tokenizer is not tokenizer


async def test_errors_of_offloaded_work_reach_the_caller(tokenizer, model_info):
    offloaded = PromptProcessor(tokenizer, model_info, offload_min_chars=0)  # even empty ones
    with pytest.raises(APIError):
        await offloaded.completion_prompts_async([])
    with pytest.raises(APIError):
        await offloaded.chat_prompt_async([])


async def test_the_thread_copy_is_made_before_the_first_long_prompt(tokenizer, model_info,
                                                                     monkeypatch):
    processor = PromptProcessor(tokenizer, model_info, offload_min_chars=100)
    processor.prepare_offload()
    made = processor._thread_processor
    assert made is not None and made.tokenizer is not tokenizer

    def no_copy(_):
        raise AssertionError("the tokenizer was copied again")

    monkeypatch.setattr("kvfleet.gateway.models.tokenization.copy.deepcopy", no_copy)
    processor.prepare_offload()  # idempotent
    assert await processor.completion_prompts_async(LONG) == processor.completion_prompts(LONG)
    assert processor._thread_processor is made


async def test_the_gateway_prepares_the_thread_before_serving(app):
    processor = app.state.completions.processor
    assert processor._thread_processor is None
    async with app.router.lifespan_context(app):
        assert processor._thread_processor is not None
