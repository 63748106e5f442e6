"""Prompt logprobs computed in prefill, checked against log_softmax of a transformers forward:
whole prompts, chunked prefill, prefix-cache neighbours, recompute preemption, max_tokens 0."""

from __future__ import annotations

import pytest
import torch

from kvfleet.shared.wire import SamplingParams
from tests.engine.tiny_models import greedy, random_prompt, run_to_completion
from kvfleet.worker.engine.engine import RequestOutput


def reference_logprobs(tiny, prompt: list[int]) -> torch.Tensor:
    """[len(prompt) - 1, vocab]: log-softmax of HF's logits at positions 0 .. n - 2 (fp32)."""
    with torch.inference_mode():
        logits = tiny.model(torch.tensor([prompt])).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1)


def collect(engine) -> dict[str, list[RequestOutput]]:
    outputs: dict[str, list[RequestOutput]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            outputs.setdefault(out.req_id, []).append(out)
    return outputs


def assert_matches_reference(tiny, prompt, entries, top_n: int) -> None:
    want = reference_logprobs(tiny, prompt)
    assert [e.token_id for e in entries] == prompt[1:]
    got = torch.tensor([e.logprob for e in entries])
    expected = want.gather(1, torch.tensor(prompt[1:]).unsqueeze(1)).squeeze(1)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    for position, entry in enumerate(entries):
        row = want[position]
        assert entry.rank == int((row > row[entry.token_id]).sum()) + 1
        top = row.topk(top_n)
        assert [t for t, _ in entry.top] == top.indices.tolist()
        torch.testing.assert_close(torch.tensor([v for _, v in entry.top]), top.values,
                                   atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("max_batched_tokens", [512, 7])  # whole prompt; chunks of <= 7 tokens
def test_prompt_logprobs_match_a_transformers_forward(tiny, max_batched_tokens):
    prompt = random_prompt(23, seed=5)
    engine = tiny.engine(max_batched_tokens=max_batched_tokens)
    engine.add_request("p", prompt, greedy(4, prompt_logprobs=3))
    engine.add_request("plain", random_prompt(9, seed=6), greedy(4))  # batched beside it
    outputs = collect(engine)
    carrying = [o for o in outputs["p"] if o.prompt_logprobs is not None]
    assert len(carrying) == 1 and carrying[0].new_token_ids  # once, with the first token
    assert_matches_reference(tiny, prompt, carrying[0].prompt_logprobs, top_n=3)
    assert all(o.prompt_logprobs is None for o in outputs["plain"])
    # the generated tokens are those of a request without prompt logprobs
    assert [t for o in outputs["p"] for t in o.new_token_ids] == tiny.reference(prompt, 4)


def test_max_tokens_zero_scores_the_prompt_and_generates_nothing(tiny_llama):
    prompt = random_prompt(11, seed=8)
    engine = tiny_llama.engine()
    engine.add_request("score", prompt, SamplingParams(max_tokens=0, prompt_logprobs=0))
    outputs = collect(engine)["score"]
    assert [o.new_token_ids for o in outputs] == [[]]
    (final,) = outputs
    assert final.finish_reason == "length" and final.num_output_tokens == 0
    assert_matches_reference(tiny_llama, prompt, final.prompt_logprobs, top_n=0)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_prompt_logprobs_do_not_read_the_prefix_cache(tiny_llama):
    prompt = random_prompt(20, seed=9)
    engine = tiny_llama.engine()
    engine.add_request("warm", prompt, greedy(2))
    run_to_completion(engine)
    hits_before = engine.block_manager.prefix_hit_tokens
    engine.add_request("p", prompt, greedy(2, prompt_logprobs=1))
    (carrying,) = [o for o in collect(engine)["p"] if o.prompt_logprobs is not None]
    assert engine.block_manager.prefix_hit_tokens == hits_before
    assert_matches_reference(tiny_llama, prompt, carrying.prompt_logprobs, top_n=1)


def test_recompute_preemption_does_not_repeat_prompt_logprobs(tiny_llama):
    # A pool too small for both: one is preempted (recompute) and prefilled again.
    prompts = [random_prompt(14, seed=10), random_prompt(14, seed=11)]
    engine = tiny_llama.engine(num_blocks=10, block_size=4, preemption="recompute",
                               max_batched_tokens=8)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, greedy(12, prompt_logprobs=2))
    outputs = collect(engine)
    assert engine.scheduler.num_preemptions > 0
    for i, prompt in enumerate(prompts):
        carrying = [o for o in outputs[f"r{i}"] if o.prompt_logprobs is not None]
        assert len(carrying) == 1
        assert_matches_reference(tiny_llama, prompt, carrying[0].prompt_logprobs, top_n=2)


def test_a_request_resumed_past_its_first_token_sends_no_prompt_logprobs(tiny_llama):
    prompt = random_prompt(9, seed=12)
    expected = tiny_llama.reference(prompt, 6)
    engine = tiny_llama.engine()
    engine.add_request("resumed", prompt, greedy(6, prompt_logprobs=1),
                       output_token_ids=expected[:3])
    outputs = collect(engine)["resumed"]
    assert all(o.prompt_logprobs is None for o in outputs)
    assert [t for o in outputs for t in o.new_token_ids] == expected[3:]
