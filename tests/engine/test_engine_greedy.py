"""Greedy outputs equal HF `generate` token for token, whatever the batch, chunking or preemption.

Every test runs on a tiny random Llama and a tiny random Qwen2 (the `tiny` fixture).
"""

from __future__ import annotations

import pytest

from tests.engine.tiny_models import greedy, random_prompt, run_to_completion

LENGTHS = [1, 5, 17, 40, 63]
MAX_TOKENS = [12, 30, 7, 20, 16]


def assert_matches_reference(tiny, prompts, max_tokens, produced):
    for i, (prompt, n) in enumerate(zip(prompts, max_tokens)):
        assert produced[f"r{i}"] == tiny.reference(prompt, n), f"request r{i} (prompt {len(prompt)})"


def test_requests_of_mixed_lengths_joining_at_different_steps(tiny):
    engine = tiny.engine(max_batched_tokens=64)
    prompts = [random_prompt(n, seed=i) for i, n in enumerate(LENGTHS)]
    join_at_step = [0, 0, 3, 5, 9]
    produced: dict[str, list[int]] = {}
    step = 0
    while step <= max(join_at_step) or engine.has_unfinished():
        for i, at in enumerate(join_at_step):
            if at == step:
                engine.add_request(f"r{i}", prompts[i], greedy(MAX_TOKENS[i]))
        for out in engine.step():
            produced.setdefault(out.req_id, []).extend(out.new_token_ids)
        step += 1
    assert_matches_reference(tiny, prompts, MAX_TOKENS, produced)
    assert engine.stats().num_generated_tokens == sum(MAX_TOKENS)


def test_chunked_prefill_with_a_tiny_token_budget(tiny):
    engine = tiny.engine(max_batched_tokens=7)
    prompts = [random_prompt(n, seed=10 + i) for i, n in enumerate(LENGTHS)]
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, greedy(MAX_TOKENS[i]))
    assert_matches_reference(tiny, prompts, MAX_TOKENS, run_to_completion(engine))


def assert_preempted_by(engine, preemption):
    stats = engine.stats()
    assert stats.num_preemptions > 0
    if preemption == "swap":
        assert stats.num_swap_preemptions == stats.num_preemptions
    else:
        assert stats.num_swap_preemptions == 0
    assert stats.swap_used_bytes == 0 and engine.swap_space.num_used_blocks == 0


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_forced_preemption_resumes_to_the_same_tokens(tiny, preemption):
    # 22 blocks of 4 tokens: each request fits alone (<= 20 blocks) but not all together
    engine = tiny.engine(num_blocks=22, max_batched_tokens=32, enable_prefix_caching=False,
                         preemption=preemption)
    lengths, max_tokens = [30, 24, 18, 9], [40, 36, 30, 25]
    prompts = [random_prompt(n, seed=20 + i) for i, n in enumerate(lengths)]
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, greedy(max_tokens[i]))
    produced = run_to_completion(engine)
    assert_preempted_by(engine, preemption)
    stats = engine.stats()
    assert stats.num_blocks_free == stats.num_blocks_total
    assert_matches_reference(tiny, prompts, max_tokens, produced)


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_preemption_with_prefix_caching_on(tiny, preemption):
    engine = tiny.engine(num_blocks=22, max_batched_tokens=16, preemption=preemption)
    shared = random_prompt(12, seed=30)
    prompts = [shared + random_prompt(n, seed=31 + i) for i, n in enumerate([14, 6, 10])]
    max_tokens = [40, 36, 30]
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, greedy(max_tokens[i]))
    produced = run_to_completion(engine)
    assert_preempted_by(engine, preemption)
    assert_matches_reference(tiny, prompts, max_tokens, produced)
    engine.block_manager.check_invariants()


def test_swap_falls_back_to_recompute_when_host_space_is_full(tiny_llama):
    # room for one 4-token block per stream at most: nothing a preempted stream holds fits
    engine = tiny_llama.engine(num_blocks=22, max_batched_tokens=32, enable_prefix_caching=False,
                               preemption="swap", swap_space_bytes=1)
    assert engine.swap_space.capacity_blocks == 0
    lengths, max_tokens = [30, 24, 18], [40, 36, 30]
    prompts = [random_prompt(n, seed=50 + i) for i, n in enumerate(lengths)]
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, greedy(max_tokens[i]))
    produced = run_to_completion(engine)
    assert engine.stats().num_preemptions > 0 and engine.stats().num_swap_preemptions == 0
    assert_matches_reference(tiny_llama, prompts, max_tokens, produced)


def test_aborting_a_swapped_out_stream_releases_its_host_memory(tiny_llama):
    engine = tiny_llama.engine(num_blocks=22, max_batched_tokens=32, enable_prefix_caching=False,
                               preemption="swap")
    for i, n in enumerate([30, 24, 18]):
        engine.add_request(f"r{i}", random_prompt(n, seed=60 + i), greedy(40))
    while engine.stats().num_swap_preemptions == 0:
        engine.step()
    swapped = [s.req_id for s in engine.scheduler.waiting if s.num_swapped_blocks]
    assert swapped and engine.stats().swap_used_bytes > 0
    for req_id in swapped:
        assert engine.abort(req_id).finish_reason == "abort"
    assert engine.stats().swap_used_bytes == 0 and engine.swap_space.num_used_blocks == 0
    run_to_completion(engine)
    assert engine.stats().num_blocks_free == engine.stats().num_blocks_total


def test_larger_blocks_and_batch(tiny):
    engine = tiny.engine(block_size=16, num_blocks=64, max_batched_tokens=128)
    lengths = [3, 70, 16, 33, 48, 1, 90, 15]
    prompts = [random_prompt(n, seed=40 + i) for i, n in enumerate(lengths)]
    max_tokens = [25, 10, 17, 32, 5, 20, 12, 16]
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, greedy(max_tokens[i]))
    assert_matches_reference(tiny, prompts, max_tokens, run_to_completion(engine))
