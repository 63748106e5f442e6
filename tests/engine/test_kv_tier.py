"""The host tier of the prefix cache (`kv_offloading_size`): blocks evicted from the pool come
back for the next request with that prefix, hold the same bytes (answers bit for bit as without
the tier, and as if the prefix never left the pool), the tier stays within its size, and it
costs nothing when off."""

from __future__ import annotations

import pytest

from kvfleet.shared.wire import SamplingParams
from kvfleet.worker.engine.memory.block_manager import BlockManager
from kvfleet.worker.engine.engine import EngineConfig
from kvfleet.worker.engine.memory.kv_cache import KVCachePool
from kvfleet.worker.engine.memory.kv_tier import TierIndex
from kvfleet.worker.engine.tiers.offloading import Offloading, paired_runs
from tests.engine.tiny_models import greedy, random_prompt

BS = 4
PREFIX = 32  # 8 blocks
SMALL_POOL = 24  # blocks: a prefix and its answer (11) fit, two do; three requests later
TENANTS = 4  # a prefix is gone from the pool by its next turn (evicted tail first, then the rest)


def tier_gib(num_blocks: int, block_bytes: int) -> float:
    """kv_offloading_size (GiB) holding `num_blocks` blocks of `block_bytes`."""
    return num_blocks * block_bytes / (1 << 30)


def run_turns(engine, prefixes: list[list[int]], rounds: int = 2,
              params: SamplingParams | None = None) -> list[tuple[list[int], list, int]]:
    """Each prefix with a fresh tail, one request at a time, `rounds` times over: each request's
    tokens, logprobs and num_cached_tokens."""
    results = []
    for rnd in range(rounds):
        for i, prefix in enumerate(prefixes):
            req_id = f"r{rnd}-{i}"
            engine.add_request(req_id, prefix + random_prompt(5, seed=100 + 10 * rnd + i),
                               params or greedy(6, logprobs=2))
            tokens, logprobs, cached = [], [], None
            while engine.has_unfinished():
                for out in engine.step():
                    tokens += out.new_token_ids
                    logprobs += [(lp.token_id, lp.logprob, lp.top)
                                 for lp in out.new_logprobs or []]
                    cached = out.num_cached_tokens
            engine.block_manager.check_invariants()
            results.append((tokens, logprobs, cached))
    return results


def prefixes(count: int) -> list[list[int]]:
    return [random_prompt(PREFIX, seed=s) for s in range(count)]


def block_bytes_of(tiny, **config) -> int:
    return tiny.engine(num_blocks=4, **config).pool.block_bytes


@pytest.mark.parametrize("dtype,kv_dtype", [("float32", "auto"), ("bfloat16", "auto"),
                                            ("float32", "int8")])
def test_evicted_prefix_comes_back_from_the_tier_with_the_same_answers(tiny, dtype, kv_dtype):
    config = dict(dtype=dtype, kv_dtype=kv_dtype)
    size = tier_gib(64, block_bytes_of(tiny, **config))
    work = prefixes(TENANTS)
    without = tiny.engine(num_blocks=SMALL_POOL, **config)
    with_tier = tiny.engine(num_blocks=SMALL_POOL, kv_offloading_size=size, **config)
    never_left = tiny.engine(num_blocks=256, **config)  # every prefix stays in the pool
    runs = {name: run_turns(engine, work) for name, engine in
            (("without", without), ("tier", with_tier), ("pool", never_left))}
    answers = {name: [(tokens, logprobs) for tokens, logprobs, _ in run]
               for name, run in runs.items()}
    assert answers["tier"] == answers["pool"]  # tokens and logprobs, bit for bit
    if kv_dtype == "auto":  # batch-invariant attention: a recomputed prefix gives them too
        assert answers["without"] == answers["tier"]
    if dtype == "float32" and kv_dtype == "auto":
        assert [tokens for tokens, _ in answers["tier"]] == [
            tiny.reference(p + random_prompt(5, seed=100 + 10 * r + i), 6)
            for r in range(2) for i, p in enumerate(work)]  # and HF's greedy tokens
    # the second round: each prefix had left the pool; with the tier its 8 blocks came back,
    # without it nothing was cached
    hit = PREFIX
    second = slice(TENANTS, None)
    assert [cached for _, _, cached in runs["tier"][second]] == [hit] * TENANTS
    assert [cached for _, _, cached in runs["without"][second]] == [0] * TENANTS
    assert [cached for _, _, cached in runs["pool"][second]] == [hit] * TENANTS
    tier, plain = with_tier.stats(), without.stats()
    assert tier.prefix_hit_tokens == tier.prefix_host_hit_tokens == TENANTS * hit
    assert tier.num_prefill_tokens_computed == plain.num_prefill_tokens_computed - TENANTS * hit
    assert tier.kv_offload_restored_blocks == TENANTS * hit // BS
    assert tier.kv_offloaded_blocks > 0 and tier.kv_offload_evicted_blocks == 0
    assert plain.prefix_host_hit_tokens == plain.kv_offloaded_blocks == 0


def test_seeded_answers_at_the_default_settings_are_the_same_with_the_tier(tiny_llama):
    config = dict(dtype="auto")  # the engine's defaults: bf16 where the CPU has it
    seeded = SamplingParams(max_tokens=6, temperature=0.9, top_p=0.95, seed=7, ignore_eos=True)
    size = tier_gib(64, block_bytes_of(tiny_llama, **config))
    work = prefixes(TENANTS)
    without = run_turns(tiny_llama.engine(num_blocks=SMALL_POOL, **config), work, params=seeded)
    engine = tiny_llama.engine(num_blocks=SMALL_POOL, kv_offloading_size=size, **config)
    assert run_turns(engine, work, params=seeded) == [
        (tokens, logprobs, cached + PREFIX * (i >= TENANTS))
        for i, (tokens, logprobs, cached) in enumerate(without)]
    assert engine.stats().prefix_host_hit_tokens == TENANTS * PREFIX


def test_device_hits_are_not_counted_as_host_hits(tiny_llama):
    engine = tiny_llama.engine(num_blocks=256,
                               kv_offloading_size=tier_gib(16, block_bytes_of(tiny_llama)))
    run_turns(engine, prefixes(2))
    stats = engine.stats()
    assert stats.prefix_hit_tokens == 2 * PREFIX  # the second round, in the pool
    assert stats.prefix_host_hit_tokens == stats.kv_offloaded_blocks == 0


def test_the_tier_never_holds_more_than_its_size_and_counts_what_it_drops(tiny_llama):
    capacity = 10  # blocks: one prefix (8) fits, the working set does not
    block_bytes = block_bytes_of(tiny_llama)
    engine = tiny_llama.engine(num_blocks=SMALL_POOL,
                               kv_offloading_size=tier_gib(capacity, block_bytes))
    tier = engine.tier
    assert tier.capacity_blocks == capacity and tier.num_bytes == capacity * block_bytes
    assert tier.values.shape[0] == capacity  # allocated once, at its size
    peak = 0
    work = prefixes(5)
    for rnd in range(3):
        for i, prefix in enumerate(work):
            engine.add_request(f"r{rnd}-{i}", prefix + random_prompt(3, seed=rnd * 7 + i),
                               greedy(4))
            while engine.has_unfinished():
                engine.step()
                peak = max(peak, len(tier.index))
                assert engine.stats().kv_offload_used_bytes <= tier.num_bytes
    stats = engine.stats()
    assert peak == capacity
    assert stats.kv_offload_evicted_blocks > 0
    assert stats.kv_offloaded_blocks == len(tier.index) + stats.kv_offload_evicted_blocks
    assert stats.kv_offload_used_bytes == len(tier.index) * block_bytes


def test_off_by_default_allocates_and_copies_nothing(tiny_llama, monkeypatch):
    assert EngineConfig().kv_offloading_size == 0
    engine = tiny_llama.engine(num_blocks=SMALL_POOL)
    assert engine.tier is None and engine.block_manager.tier is None
    assert not any(isinstance(f, Offloading) for f in engine.features.all)

    def no_copy(*args):
        raise AssertionError("a block was copied with the tier off")

    monkeypatch.setattr(KVCachePool, "block_range", no_copy)
    run_turns(engine, prefixes(TENANTS))  # evicts every prefix once
    stats = engine.stats()
    assert stats.kv_offload_capacity_bytes == stats.kv_offloaded_blocks == 0
    assert stats.prefix_hit_tokens == 0


def test_concurrent_requests_with_swaps_and_the_tier_answer_as_without(tiny_llama):
    """Several requests at once over a pool too small for them: preemption (swap) and the tier
    move blocks in the same steps; every answer is still the plain one."""
    work = prefixes(4)
    prompts = [p + random_prompt(6, seed=50 + i) for i, p in enumerate(work * 2)]
    size = tier_gib(40, block_bytes_of(tiny_llama))

    def answers(**config):
        engine = tiny_llama.engine(num_blocks=30, preemption="swap", max_batched_tokens=24,
                                   **config)
        out = engine.generate(prompts[:4], greedy(12))
        out += engine.generate(prompts[4:], greedy(12))
        engine.block_manager.check_invariants()
        return out, engine.stats()

    plain, _ = answers()
    tiered, stats = answers(kv_offloading_size=size)
    assert tiered == plain
    assert stats.prefix_host_hit_tokens > 0


def test_tier_index_pins_slots_being_read_and_cancels_a_load_never_filled():
    saved: list[tuple[int, int]] = []
    index = TierIndex(2, lambda block, slot: saved.append((block, slot)))
    index.offload(b"a", 5)
    index.offload(b"b", 6)
    assert saved == [(5, 0), (6, 1)] and len(index) == 2
    index.offload(b"a", 7)  # held already: touched, nothing copied
    assert saved == [(5, 0), (6, 1)]
    index.restore(b"b", 9)  # b's slot is read before the step: pinned
    index.offload(b"c", 3)  # the tier is full: the least recently used unpinned slot goes (a's)
    assert saved[-1] == (3, 0) and not index.holds(b"a") and index.num_evicted_blocks == 1
    index.offload(b"d", 4)  # only b's pinned slot and c's (just used) are left: c's goes
    assert saved[-1] == (4, 0) and index.holds(b"b")
    index.restore(b"d", 11)
    index.offload(b"e", 8)  # both slots pinned: nothing to overwrite, e is dropped
    assert index.num_dropped_blocks == 1 and not index.holds(b"e")
    index.offload(b"d", 11)  # block 11 evicted before its load ran: the load is cancelled
    assert index.take_loads() == [(1, 9)]
    assert index.take_loads() == []


def test_block_manager_brings_blocks_back_from_the_tier_and_counts_them_when_taken():
    saved: list[tuple[int, int]] = []
    bm = BlockManager(6, 2, tier=TierIndex(8, lambda block, slot: saved.append((block, slot))))
    a = [1, 2, 3, 4, 5, 6, 7, 8]
    bm.allocate_slots("a", 8)
    bm.cache_full_blocks("a", a, 8)
    bm.free("a")
    bm.allocate_slots("b", 12)  # the 2 never-cached blocks, then a's 4 cached ones: to the tier
    assert len(saved) == 4 and bm.num_cached_blocks == 0
    bm.free("b")
    hits = bm.find_cached_prefix("c", a + [99])  # 9 tokens: 5 blocks fit beside the pool's 6
    assert len(hits) == 4 and bm.num_cached_blocks == 4
    assert bm.prefix_host_hit_tokens == 0  # brought back, not yet taken by a request
    assert sorted(block for _, block in bm.tier.take_loads()) == sorted(hits)
    assert bm.allocate_slots("c", 9, hits) is not None
    assert bm.prefix_host_hit_tokens == 8
    assert bm.find_cached_prefix("d", a + [98]) == hits  # now device hits: nothing brought back
    assert bm.tier.take_loads() == []
    bm.check_invariants()


def test_a_block_is_not_brought_back_when_the_request_cannot_fit_or_the_tier_lost_it():
    saved: list[tuple[int, int]] = []
    bm = BlockManager(2, 2, tier=TierIndex(1, lambda block, slot: saved.append((block, slot))))
    bm.allocate_slots("a", 3)
    bm.cache_full_blocks("a", [1, 2, 3], 3)  # a's first block published
    bm.free("a")
    bm.allocate_slots("b", 4)  # the never-cached block, then a's: a's goes to the tier
    bm.cache_full_blocks("b", [5, 6, 7, 8], 4)
    bm.free("b")
    assert bm.find_cached_prefix("c", [1, 2, 3, 4, 5]) == []  # 3 blocks: never fits, not fetched
    assert bm.tier.take_loads() == [] and len(saved) == 1
    # taking a free block for a's evicts one of b's into the 1-block tier, pushing a's out
    assert bm.find_cached_prefix("d", [1, 2, 9]) == []
    assert len(saved) == 2 and bm.tier.take_loads() == [] and bm.tier.num_evicted_blocks == 1
    bm.check_invariants()


def test_paired_runs_copy_consecutive_slots_and_blocks_at_once():
    assert paired_runs([(4, 10), (5, 11), (6, 13), (0, 12)]) == [(4, 10, 2), (0, 12, 1),
                                                                  (6, 13, 1)]
    assert paired_runs([]) == []


def test_a_tier_too_small_for_one_block_or_beside_what_it_cannot_follow_is_refused(tiny_llama):
    with pytest.raises(ValueError, match="holds no KV block"):
        tiny_llama.engine(kv_offloading_size=1e-9)
    spec = {"method": "draft_model", "model": "unused", "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match="draft model"):
        EngineConfig(kv_offloading_size=1, speculative_config=spec)
    with pytest.raises(ValueError, match="tensor parallelism"):
        EngineConfig(kv_offloading_size=1, tensor_parallel_size=2)
    EngineConfig(kv_offloading_size=1, speculative_config={"method": "ngram"})  # no draft pool


def test_budget_report_names_the_tier(tiny_llama):
    engine = tiny_llama.engine(kv_offloading_size=tier_gib(12, block_bytes_of(tiny_llama)))
    assert any(line.startswith("host tier (--kv-offloading-size):") and "12 blocks" in line
               for line in engine.budget_report())
