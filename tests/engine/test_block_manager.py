"""Unit tests of the block manager: tables, reference counts, free list and prefix cache (no model)."""

from __future__ import annotations

import pytest

from kvfleet.shared.wire.prefix_hash import hash_block, root_hash
from kvfleet.worker.engine.memory.block_manager import BlockManager

BS = 4


def tokens(n: int, start: int = 100) -> list[int]:
    return list(range(start, start + n))


def test_allocate_and_free_return_every_block():
    bm = BlockManager(num_blocks=8, block_size=BS)
    assert bm.allocate_slots("a", 9) is not None  # 3 blocks
    assert bm.allocate_slots("b", 4) is not None  # 1 block
    assert bm.num_free_blocks == 4
    assert len(bm.block_table("a")) == 3
    table_before = list(bm.block_table("a"))
    bm.allocate_slots("a", 13)  # grows by one, append-only
    assert bm.block_table("a")[:3] == table_before and len(bm.block_table("a")) == 4
    bm.check_invariants()
    assert bm.free("a") == 4 and bm.free("b") == 1
    assert bm.num_free_blocks == 8
    bm.check_invariants()


def test_allocation_returns_none_and_changes_nothing_when_short():
    bm = BlockManager(num_blocks=4, block_size=BS)
    bm.allocate_slots("a", 12)
    assert bm.allocate_slots("b", 8) is None
    assert not bm.holds("b")
    assert bm.allocate_slots("a", 20) is None  # needs 2 more, 1 free
    assert len(bm.block_table("a")) == 3 and bm.num_free_blocks == 1
    bm.check_invariants()


def test_hash_chain_depends_on_every_earlier_token():
    root = root_hash()
    a = hash_block(root, [1, 2, 3, 4])
    assert a == hash_block(root, [1, 2, 3, 4])
    assert hash_block(a, [5, 6, 7, 8]) != hash_block(hash_block(root, [1, 2, 3, 9]), [5, 6, 7, 8])
    assert hash_block(root, [1, 2, 3, 4]) != hash_block(root, [4, 3, 2, 1])
    assert hash_block(root_hash("other"), [1, 2, 3, 4]) != a
    assert len(a) == 16


def _run(bm: BlockManager, req_id: str, toks: list[int]) -> list[int]:
    """Admit with whatever is cached, compute everything, publish; returns the cache hits."""
    hits = bm.find_cached_prefix(req_id, toks)
    assert bm.allocate_slots(req_id, len(toks), hits) is not None
    bm.cache_full_blocks(req_id, toks, len(toks))
    return hits


def test_prefix_hit_shares_full_blocks_only_and_leaves_the_last_token_to_compute():
    bm = BlockManager(num_blocks=16, block_size=BS)
    first = tokens(10)  # 2 full blocks + 2 tokens
    assert _run(bm, "a", first) == []
    table_a = list(bm.block_table("a"))
    # same 10 tokens: both full blocks hit (10 - 1 = 9 tokens -> 2 blocks)
    assert bm.find_cached_prefix("b", first) == table_a[:2]
    # exactly 8 tokens: only 1 block may hit, so the last token (in block 2) is computed and no
    # shared block is ever written
    assert bm.find_cached_prefix("c", first[:8]) == table_a[:1]
    # an edit in block 0 breaks the chain even though block 1 is equal
    edited = [999] + first[1:]
    assert bm.find_cached_prefix("d", edited) == []
    bm.check_invariants()


def test_shared_blocks_are_reference_counted():
    bm = BlockManager(num_blocks=16, block_size=BS)
    toks = tokens(12)
    _run(bm, "a", toks)
    hits = _run(bm, "b", toks + [7])
    assert hits == bm.block_table("a")[:3]
    assert bm.num_used_blocks == 4  # 3 shared + b's own 4th block
    bm.free("a")
    bm.check_invariants()
    assert bm.block_table("b")[:3] == hits and bm.num_used_blocks == 4
    bm.free("b")
    assert bm.num_free_blocks == 16 and bm.num_cached_blocks == 3
    bm.check_invariants()


def test_freed_cached_blocks_stay_until_a_new_block_needs_them_lru_first():
    bm = BlockManager(num_blocks=6, block_size=BS)
    old, new = tokens(8, start=100), tokens(8, start=200)
    _run(bm, "old", old)
    bm.free("old")
    _run(bm, "new", new)
    bm.free("new")
    assert bm.num_cached_blocks == 4 and bm.num_free_blocks == 6
    # 2 never-cached blocks are used before any cached one is evicted
    bm.allocate_slots("x", 8)
    assert bm.num_cached_blocks == 4
    # the next block evicts from the least recently used request ("old"), its tail block first
    bm.allocate_slots("x", 12)
    assert bm.num_cached_blocks == 3
    assert len(bm.find_cached_prefix("q1", old + [1])) == 1  # old's tail gone, its head cached
    assert len(bm.find_cached_prefix("q3", new + [1])) == 2
    bm.check_invariants()


def test_reviving_an_evictable_block_counts_against_free_blocks():
    bm = BlockManager(num_blocks=3, block_size=BS)
    toks = tokens(8)
    _run(bm, "a", toks)
    bm.free("a")
    hits = bm.find_cached_prefix("b", toks + [1])
    assert len(hits) == 2
    assert bm.num_blocks_to_take("b", 9, hits) == 3  # 2 revived + 1 new
    assert bm.allocate_slots("b", 9, hits) is not None
    assert bm.num_free_blocks == 0
    assert bm.allocate_slots("c", 1) is None
    bm.check_invariants()


def test_duplicate_content_computed_twice_keeps_one_cache_entry():
    bm = BlockManager(num_blocks=8, block_size=BS)
    toks = tokens(8)
    for req_id in ("a", "b"):  # both admitted before either published
        assert bm.allocate_slots(req_id, 8) is not None
    bm.cache_full_blocks("a", toks, 8)
    bm.cache_full_blocks("b", toks, 8)
    assert bm.num_cached_blocks == 2
    bm.free("a")
    bm.free("b")
    assert bm.num_free_blocks == 8
    bm.check_invariants()


def test_prefix_caching_switched_off_never_hits():
    bm = BlockManager(num_blocks=8, block_size=BS, enable_prefix_caching=False)
    toks = tokens(9)
    _run(bm, "a", toks)
    assert bm.find_cached_prefix("b", toks) == [] and bm.num_cached_blocks == 0
    bm.free("a")
    assert bm.num_free_blocks == 8


def test_cached_blocks_only_start_a_table():
    bm = BlockManager(num_blocks=8, block_size=BS)
    toks = tokens(8)
    _run(bm, "a", toks)
    bm.allocate_slots("b", 1)
    with pytest.raises(ValueError):
        bm.allocate_slots("b", 9, bm.block_table("a"))
