"""Tensor parallelism on the CPU: 2 gloo ranks (this process is rank 0, one spawned child) give
greedy outputs equal to HF `generate` token for token, and equal to the 1-rank engine, through
chunked prefill, a shared prefix (prefix cache hits), swap and recompute preemption.

Each engine costs a child process start-up, so one engine per case serves several scenarios.
"""

from __future__ import annotations

import functools

import pytest

from tests.engine.tiny_models import (
    TinyModel, build_model, greedy, random_prompt, run_to_completion)
from kvfleet.worker.engine.engine import Engine, EngineConfig
from kvfleet.worker.process.tp_rank import launch_engine
from kvfleet.worker.engine.core.model_runner import PlannedChunk, StepPlan
from kvfleet.worker.engine.parallel.tp_group import StepMessage
from kvfleet.worker.engine.parallel.tp_shard import HeadShard, head_shard

# (family, config overrides, preemption, KV heads per rank on ranks 0 and 1): 4 query heads
# over 2 ranks with 4 and 2 KV heads split, 1 replicated onto both ranks; 6 heads in 3 KV
# groups split unevenly (4 + 2 heads)
CASES = [("llama", dict(num_key_value_heads=4), "swap", 2),
         ("qwen2", dict(num_key_value_heads=2), "swap", 1),
         ("llama", dict(num_key_value_heads=1), "recompute", 1),
         ("qwen2", dict(num_attention_heads=6, num_key_value_heads=3, hidden_size=48),
          "recompute", 2)]


def tp_config(preemption: str, tensor_parallel_size: int = 2) -> EngineConfig:
    # 22 blocks of 4 tokens and 8 tokens a step: chunked prefills, and not every stream fits
    return EngineConfig(device="cpu", dtype="float32", num_blocks=22, block_size=4, max_batched_tokens=8,
                        preemption=preemption, tensor_parallel_size=tensor_parallel_size)


@pytest.fixture(scope="module", params=CASES,
                ids=[f"{f}-h{o.get('num_attention_heads', 4)}-kv{o['num_key_value_heads']}-{p}"
                     for f, o, p, _ in CASES])
def case(request):
    family, overrides, preemption, rank0_kv_heads = request.param
    tiny = TinyModel(family, **overrides)
    engine = launch_engine(functools.partial(build_model, family, **overrides),
                           tp_config(preemption), num_threads=1)
    assert engine.ranks.world_size == 2
    assert engine.pool.layout.num_kv_heads == rank0_kv_heads
    try:
        yield tiny, engine, preemption
    finally:
        engine.close()


def scenario():
    """Three prompts sharing a 12-token prefix and one that shares nothing."""
    shared = random_prompt(12, seed=30)
    prompts = [shared + random_prompt(n, seed=31 + i) for i, n in enumerate([14, 6, 10])]
    prompts.append(random_prompt(23, seed=35))
    return prompts, [30, 26, 20, 16]


def serve(engine: Engine, prompts, max_tokens) -> dict[str, list[int]]:
    for i, (prompt, n) in enumerate(zip(prompts, max_tokens)):
        engine.add_request(f"r{i}", prompt, greedy(n))
    return run_to_completion(engine)


def test_two_ranks_match_hf_generate_and_one_rank(case):
    tiny, engine, preemption = case
    prompts, max_tokens = scenario()
    produced = serve(engine, prompts, max_tokens)
    for i, (prompt, n) in enumerate(zip(prompts, max_tokens)):
        assert produced[f"r{i}"] == tiny.reference(prompt, n), f"request r{i}"
    stats = engine.stats()
    assert stats.num_preemptions > 0 and stats.prefix_hit_tokens > 0
    assert (stats.num_swap_preemptions > 0) == (preemption == "swap")
    assert stats.num_blocks_free == stats.num_blocks_total and stats.swap_used_bytes == 0
    single = tiny.engine(num_blocks=22, max_batched_tokens=8, preemption=preemption)
    assert serve(single, prompts, max_tokens) == produced


def test_aborting_preempted_streams_then_serving_on(case):
    """Aborted while preempted (swapped out: the ranks drop their host copies too)."""
    tiny, engine, preemption = case
    before = engine.stats().num_preemptions
    for i, n in enumerate([30, 24, 18]):
        engine.add_request(f"a{i}", random_prompt(n, seed=60 + i), greedy(40))
    while engine.stats().num_preemptions == before:
        engine.step()
    preempted = [s.req_id for s in engine.scheduler.waiting if s.num_output_tokens]
    assert preempted and bool(engine.swapped.held) == (preemption == "swap")
    for req_id in preempted:
        assert engine.abort(req_id).finish_reason == "abort"
    assert engine.stats().swap_used_bytes == 0
    run_to_completion(engine)
    prompt = random_prompt(33, seed=70)  # the ranks are still in step after the drops
    assert serve(engine, [prompt], [12])["r0"] == tiny.reference(prompt, 12)


def test_head_shards_split_or_replicate_kv_heads():
    assert head_shard(8, 8, 1, 2) == HeadShard(4, 4, 4, 4)
    assert [head_shard(8, 4, r, 2).kv_head_start for r in (0, 1)] == [0, 2]
    assert head_shard(8, 4, 1, 2).num_kv_heads == 2
    # 2 KV heads over 4 ranks: ranks 0-1 read KV head 0, ranks 2-3 KV head 1
    shards = [head_shard(8, 2, r, 4) for r in range(4)]
    assert [(s.head_start, s.num_heads, s.kv_head_start, s.num_kv_heads) for s in shards] == \
        [(0, 2, 0, 1), (2, 2, 0, 1), (4, 2, 1, 1), (6, 2, 1, 1)]
    # uneven: 9 heads in 3 KV groups over 2 ranks (SmolLM2-135M's shape) -> 6 + 3 heads
    assert [head_shard(9, 3, r, 2) for r in (0, 1)] == [HeadShard(6, 2, 0, 0), HeadShard(3, 1, 6, 2)]
    assert [head_shard(6, 6, r, 4).num_heads for r in range(4)] == [2, 2, 1, 1]
    with pytest.raises(ValueError, match="do not split"):
        head_shard(12, 3, 0, 4)  # a KV head's 4 query heads over 4/3 ranks
    with pytest.raises(ValueError, match="do not split"):
        head_shard(6, 2, 0, 4)  # 3 query heads of a KV head over 2 ranks


def test_step_message_round_trip():
    plan = StepPlan([PlannedChunk(7, 1, [3, 4], True), PlannedChunk(0, 5, [9, 1], False),
                     PlannedChunk(9, 3, [8, 2, 5], True, num_draft=2)],
                    [11, 12, 13, 14, 15, 16, 17, 18, 19])
    message = StepMessage(plan, swap_out=[(4, [5, 6])], swap_in=[(2, [7]), (3, [])], drops=[1])
    assert StepMessage.decode(message.encode()) == message
    empty = StepMessage(StepPlan([], []))
    assert StepMessage.decode(empty.encode()) == empty


def test_config_refuses_zero_ranks():
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig(tensor_parallel_size=0)



def test_a_second_group_in_one_process_is_refused_before_starting_ranks(case):
    import multiprocessing

    before = multiprocessing.active_children()
    with pytest.raises(RuntimeError, match="one tensor-parallel group at a time"):
        launch_engine(functools.partial(build_model, "llama"), tp_config("swap"))
    assert multiprocessing.active_children() == before


def prompt_logprobs_of(engine: Engine, prompt: list[int]) -> list:
    engine.add_request("p", prompt, greedy(3, prompt_logprobs=2))
    first = None
    while engine.has_unfinished():
        for out in engine.step():
            if out.req_id == "p" and first is None and out.prompt_logprobs is not None:
                first = out.prompt_logprobs
    return first


def test_prompt_logprobs_match_one_rank(case):
    """Rank 0 keeps the prompt positions' logits rows beside the sampled ones (chunked prefill)."""
    tiny, engine, preemption = case
    prompt = random_prompt(21, seed=80)
    got = prompt_logprobs_of(engine, prompt)
    want = prompt_logprobs_of(tiny.engine(num_blocks=22, max_batched_tokens=8), prompt)
    assert len(got) == len(prompt) - 1 == len(want)
    for g, w in zip(got, want):
        assert (g.token_id, g.rank, [t for t, _ in g.top]) == (w.token_id, w.rank, [t for t, _ in w.top])
        assert g.logprob == pytest.approx(w.logprob, abs=1e-4)

