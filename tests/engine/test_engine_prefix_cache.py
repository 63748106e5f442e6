"""Prefix caching keeps outputs exact: shared prefixes hit, and greedy tokens still equal HF's."""

from __future__ import annotations

import pytest

from tests.engine.tiny_models import greedy, random_prompt, run_to_completion

BS = 4


def run_one(engine, req_id, prompt, max_tokens):
    engine.add_request(req_id, prompt, greedy(max_tokens))
    out = run_to_completion(engine)[req_id]
    return out


def cached_tokens_of(engine, req_id, prompt, max_tokens):
    """Run one request; its output tokens and the num_cached_tokens it reported."""
    engine.add_request(req_id, prompt, greedy(max_tokens))
    tokens, cached = [], None
    while engine.has_unfinished():
        for out in engine.step():
            tokens.extend(out.new_token_ids)
            cached = out.num_cached_tokens
    return tokens, cached


@pytest.mark.parametrize("shared_len,expected_hit", [(16, 16), (10, 8), (0, 0)],
                         ids=["full-blocks", "partial-block", "no-overlap"])
def test_shared_prefix_hits_whole_blocks_and_keeps_outputs_exact(tiny, shared_len, expected_hit):
    engine = tiny.engine(block_size=BS)
    shared = random_prompt(shared_len, seed=1) if shared_len else []
    first = shared + random_prompt(9, seed=2)
    second = shared + random_prompt(7, seed=3)
    assert run_one(engine, "a", first, 10) == tiny.reference(first, 10)
    tokens, cached = cached_tokens_of(engine, "b", second, 12)
    assert tokens == tiny.reference(second, 12)
    assert cached == expected_hit
    stats = engine.stats()
    assert stats.prefix_hit_tokens == expected_hit
    assert stats.prefix_queried_tokens == len(first) + len(second)
    assert stats.num_blocks_free == stats.num_blocks_total


def test_identical_greedy_requests_give_identical_outputs(tiny):
    engine = tiny.engine(block_size=BS)
    prompt = random_prompt(16, seed=4)  # a multiple of the block size: the last block recomputes
    expected = tiny.reference(prompt, 15)
    outputs = [cached_tokens_of(engine, f"same{i}", prompt, 15) for i in range(3)]
    for tokens, cached in outputs[1:]:
        assert tokens == expected and cached == 12  # 3 of 4 blocks; the last token is computed
    assert outputs[0] == (expected, 0)
    # and several at once, joining while the first ones run
    produced: dict[str, list[int]] = {}
    for i in range(3):
        engine.add_request(f"again{i}", prompt, greedy(15))
        for out in engine.step():
            produced.setdefault(out.req_id, []).extend(out.new_token_ids)
    for req_id, tokens in run_to_completion(engine).items():
        produced.setdefault(req_id, []).extend(tokens)
    assert produced == {f"again{i}": expected for i in range(3)}


def test_two_requests_share_blocks_while_both_run(tiny):
    engine = tiny.engine(block_size=BS)
    shared = random_prompt(20, seed=5)
    a, b = shared + random_prompt(3, seed=6), shared + random_prompt(5, seed=7)
    engine.add_request("a", a, greedy(20))
    first = engine.step()  # a's prompt computed and published
    engine.add_request("b", b, greedy(20))
    produced = {"a": first[0].new_token_ids}
    used_while_both_run = None
    while engine.has_unfinished():
        for out in engine.step():
            produced.setdefault(out.req_id, []).extend(out.new_token_ids)
        if engine.stats().num_running == 2 and used_while_both_run is None:
            stats = engine.stats()
            used_while_both_run = stats.num_blocks_total - stats.num_blocks_free
    assert produced["a"] == tiny.reference(a, 20)
    assert produced["b"] == tiny.reference(b, 20)
    assert engine.stats().prefix_hit_tokens == 20
    # without sharing a and b would hold ceil(23/4) + ceil(25/4) = 13 blocks
    assert used_while_both_run is not None and used_while_both_run < 13


def test_eviction_pressure_keeps_outputs_exact_and_returns_every_block(tiny):
    engine = tiny.engine(block_size=BS, num_blocks=24, max_batched_tokens=32)
    prompts = [random_prompt(30, seed=100 + i) for i in range(6)]
    outputs = [run_one(engine, f"p{i}", p, 8) for i, p in enumerate(prompts)]
    # the early prompts were evicted by the later ones; run the first and last again
    again_first = run_one(engine, "again-first", prompts[0], 8)
    again_last, cached = cached_tokens_of(engine, "again-last", prompts[-1], 8)
    for prompt, out in zip(prompts, outputs):
        assert out == tiny.reference(prompt, 8)
    assert again_first == outputs[0] and again_last == outputs[-1]
    assert cached > 0
    stats = engine.stats()
    assert stats.num_cached_blocks <= stats.num_blocks_total
    assert stats.num_blocks_free == stats.num_blocks_total
    engine.block_manager.check_invariants()


def test_skip_prefix_cache_neither_reads_nor_publishes(tiny):
    engine = tiny.engine(block_size=BS)
    prompt = random_prompt(17, seed=8)
    engine.add_request("private", prompt, greedy(5, skip_prefix_cache=True))
    run_to_completion(engine)
    assert engine.stats().num_cached_blocks == 0
    run_one(engine, "public", prompt, 5)
    tokens, cached = cached_tokens_of(engine, "skipper", prompt, 5)
    assert cached == 16  # "public" published 4 full blocks; a normal request hits them all
    engine.add_request("skip-again", prompt, greedy(5, skip_prefix_cache=True))
    outs = []
    while engine.has_unfinished():
        outs.extend(engine.step())
    assert outs[-1].num_cached_tokens == 0 and tokens == tiny.reference(prompt, 5)


def test_prefix_caching_off(tiny):
    engine = tiny.engine(block_size=BS, enable_prefix_caching=False)
    prompt = random_prompt(16, seed=9)
    for i in range(2):
        assert run_one(engine, f"r{i}", prompt, 6) == tiny.reference(prompt, 6)
    stats = engine.stats()
    assert stats.prefix_hit_tokens == 0 and stats.num_cached_blocks == 0


def test_masked_prefill_after_a_cached_prefix_never_asks_sdpa_for_gqa(tiny_llama, monkeypatch):
    """A chunk after a cached prefix needs a mask; with GQA (4 query heads on 2 KV heads here)
    its heads are packed per KV head, so no SDPA call gets a mask together with GQA (on CUDA that
    pair runs the math kernel, which materialises every score). Tokens stay HF's."""
    import torch.nn.functional as F

    from kvfleet.worker.engine.attention import sdpa_backend

    calls = []
    sdpa = F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, **kwargs):
        calls.append((attn_mask is not None, q.shape[-3] != k.shape[-3] or kwargs.get("enable_gqa")))
        return sdpa(q, k, v, attn_mask=attn_mask, **kwargs)

    monkeypatch.setattr(sdpa_backend.F, "scaled_dot_product_attention", spy)
    # chunked prefill too; --no-deterministic: the CPU backend's prefill chunks on SDPA (by
    # default every row takes the decode kernel)
    engine = tiny_llama.engine(block_size=BS, max_batched_tokens=6, deterministic=False)
    shared = random_prompt(12, seed=5)
    first, second = shared + random_prompt(5, seed=6), shared + random_prompt(9, seed=7)
    assert run_one(engine, "a", first, 6) == tiny_llama.reference(first, 6)
    assert run_one(engine, "b", second, 6) == tiny_llama.reference(second, 6)
    assert engine.stats().prefix_hit_tokens >= 12
    masked = [gqa for has_mask, gqa in calls if has_mask]
    assert masked and not any(masked)
    assert any(gqa for has_mask, gqa in calls if not has_mask)  # chunks from 0 keep is_causal GQA


def test_prompts_sent_together_share_the_prefix_their_step_computes(tiny):
    """Three prompts on one opening, added before any step: the first computes the opening
    and the others, admitted in the same step, read its keys from the pool; every answer still
    equals HF's."""
    engine = tiny.engine(block_size=BS)
    shared = random_prompt(18, seed=8)
    prompts = {f"p{i}": shared + random_prompt(3 + i, seed=20 + i) for i in range(3)}
    for req_id, prompt in prompts.items():
        engine.add_request(req_id, prompt, greedy(12))
    produced: dict[str, list[int]] = {}
    cached: dict[str, int] = {}
    first = engine.step()
    assert {out.req_id for out in first} == set(prompts)  # all three prefilled in one step
    for out in first + run_to_completion_outputs(engine):
        produced.setdefault(out.req_id, []).extend(out.new_token_ids)
        cached[out.req_id] = out.num_cached_tokens
    assert cached == {"p0": 0, "p1": 16, "p2": 16}  # 4 full blocks of the 18-token opening
    for req_id, prompt in prompts.items():
        assert produced[req_id] == tiny.reference(prompt, 12), req_id
    assert engine.stats().num_blocks_free == engine.stats().num_blocks_total


def run_to_completion_outputs(engine) -> list:
    outputs = []
    while engine.has_unfinished():
        outputs.extend(engine.step())
    return outputs
