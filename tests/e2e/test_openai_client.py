"""The official `openai` client, sync and async, against a real fleet on the default model."""

from __future__ import annotations

import openai
import pytest

from kvfleet.shared.models import DEFAULT_MODEL

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture
def sync_client(fleet) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{fleet.url}/v1", api_key="unused", timeout=120)


@pytest.fixture
def async_client(fleet) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{fleet.url}/v1", api_key="unused", timeout=120)


def test_models_and_chat_non_stream(sync_client):
    assert [m.id for m in sync_client.models.list()] == [DEFAULT_MODEL]
    reply = sync_client.chat.completions.create(model=DEFAULT_MODEL, messages=QUESTION,
                                                temperature=0, max_tokens=20)
    assert "Paris" in reply.choices[0].message.content
    assert reply.choices[0].finish_reason == "stop"
    assert reply.usage.completion_tokens > 0
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens


def test_completion_stream_with_usage(sync_client):
    stream = sync_client.completions.create(
        model=DEFAULT_MODEL, prompt="The capital of France is", max_tokens=8, temperature=0,
        stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text.strip()
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 8 and not chunks[-1].choices


def test_stop_string_ends_the_answer(sync_client):
    """The worker stops at the stop string and says so (vLLM's stop_reason); the gateway cuts the
    text there, streamed or not, and never streams past it."""
    reply = sync_client.chat.completions.create(model=DEFAULT_MODEL, messages=QUESTION,
                                                temperature=0, max_tokens=20, stop=["Paris"])
    assert reply.choices[0].finish_reason == "stop"
    assert reply.choices[0].stop_reason == "Paris"
    assert "Paris" not in reply.choices[0].message.content
    assert reply.choices[0].message.content.startswith("The capital of France is")
    stream = sync_client.chat.completions.create(model=DEFAULT_MODEL, messages=QUESTION,
                                                 temperature=0, max_tokens=20, stop=["Paris"],
                                                 stream=True)
    chunks = [c.choices[0] for c in stream if c.choices]
    assert "".join(c.delta.content or "" for c in chunks) == reply.choices[0].message.content
    assert (chunks[-1].finish_reason, chunks[-1].stop_reason) == ("stop", "Paris")
    kept = sync_client.completions.create(
        model=DEFAULT_MODEL, prompt="The capital of France is", temperature=0, max_tokens=20,
        stop=["Paris"], extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].text.endswith("Paris") and kept.choices[0].stop_reason == "Paris"


def test_seed_reproducibility(sync_client):
    def sample(seed):
        return sync_client.chat.completions.create(
            model=DEFAULT_MODEL, messages=[{"role": "user", "content": "Tell me a story."}],
            temperature=1.0, max_tokens=24, seed=seed).choices[0].message.content

    first = sample(42)
    assert sample(42) == first
    assert any(sample(seed) != first for seed in (43, 44))


def test_logprobs(sync_client):
    reply = sync_client.chat.completions.create(model=DEFAULT_MODEL, messages=QUESTION,
                                                temperature=0, max_tokens=6, logprobs=True,
                                                top_logprobs=3)
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens
    for item in content:
        assert item.logprob <= 0.0
        assert len(item.top_logprobs) == 3
        # greedy: the chosen token is the most likely one
        assert item.logprob == pytest.approx(max(t.logprob for t in item.top_logprobs), abs=1e-4)


async def test_async_stream_and_non_stream(async_client):
    reply = await async_client.completions.create(model=DEFAULT_MODEL, prompt="One, two, three,",
                                                  max_tokens=6, temperature=0)
    stream = await async_client.completions.create(model=DEFAULT_MODEL,
                                                   prompt="One, two, three,", max_tokens=6,
                                                   temperature=0, stream=True)
    streamed = "".join([c.choices[0].text async for c in stream if c.choices])
    assert streamed == reply.choices[0].text


def test_errors_reach_the_client_as_openai_errors(sync_client):
    with pytest.raises(openai.NotFoundError):
        sync_client.chat.completions.create(model="nope", messages=QUESTION)
    with pytest.raises(openai.BadRequestError, match="context"):
        sync_client.completions.create(model=DEFAULT_MODEL, prompt="hi", max_tokens=100_000)


def test_echo_logprobs_score_a_prompt_like_a_transformers_forward(sync_client, hf_reference):
    """`echo` + `logprobs` + `max_tokens: 0` (prompt scoring, e.g. lm-eval's loglikelihood):
    the prompt tokens' logprobs are those of log_softmax over a transformers forward."""
    import torch

    from kvfleet.shared.models import load_tokenizer, resolve_model_path

    path = resolve_model_path(DEFAULT_MODEL)
    prompt_ids = load_tokenizer(path).encode("The capital of France is Paris.")
    reply = sync_client.completions.create(model=DEFAULT_MODEL, prompt=prompt_ids, echo=True,
                                           logprobs=2, max_tokens=0)
    [choice] = reply.choices
    assert choice.finish_reason == "length" and reply.usage.completion_tokens == 0
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == len(prompt_ids) and logprobs.token_logprobs[0] is None
    with torch.inference_mode():
        want = torch.log_softmax(
            hf_reference.model(torch.tensor([prompt_ids])).logits[0, :-1].float(), -1)
    expected = want.gather(1, torch.tensor(prompt_ids[1:]).unsqueeze(1)).squeeze(1)
    torch.testing.assert_close(torch.tensor(logprobs.token_logprobs[1:]), expected,
                               atol=1e-3, rtol=1e-3)
    assert all(len(top) >= 2 for top in logprobs.top_logprobs[1:])
