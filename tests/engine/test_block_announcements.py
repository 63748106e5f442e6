"""The block manager's announcements (prefix-affinity routing): what its prefix cache stored and
evicted since the last drain, as a net change, hashed like the gateways' router hashes prompts."""

from __future__ import annotations

import pytest

from kvfleet.shared.wire.prefix_hash import block_hashes, root_hash
from tests.engine.tiny_models import greedy, random_prompt, run_to_completion
from kvfleet.worker.engine.memory.block_manager import BlockManager, NetChange

BS = 4


def tokens(n: int, start: int = 100) -> list[int]:
    return list(range(start, start + n))


def _run(bm: BlockManager, req_id: str, toks: list[int]) -> None:
    """Admit with whatever is cached, compute everything, publish."""
    hits = bm.find_cached_prefix(req_id, toks)
    assert bm.allocate_slots(req_id, len(toks), hits) is not None
    bm.cache_full_blocks(req_id, toks, len(toks))


def test_published_blocks_are_announced_as_stored_with_the_routers_hashes():
    root = root_hash("model-a")
    bm = BlockManager(num_blocks=8, block_size=BS, root=root)
    toks = tokens(10)
    _run(bm, "a", toks)
    assert bm.drain_announcements() == (block_hashes(toks, BS, root), [])
    assert bm.drain_announcements() == ([], [])  # drained
    _run(bm, "b", toks + [5, 6])  # hits both blocks, publishes the third
    assert bm.drain_announcements() == (block_hashes(toks + [5, 6], BS, root)[2:], [])


def test_evicted_blocks_are_announced_as_removed():
    bm = BlockManager(num_blocks=3, block_size=BS)
    old = tokens(8, start=100)
    _run(bm, "old", old)
    bm.free("old")
    stored, _ = bm.drain_announcements()
    bm.allocate_slots("x", 8)  # 1 never-cached block, then old's tail block is evicted
    assert bm.drain_announcements() == ([], [stored[1]])
    assert bm.num_cached_leading_blocks(old) == 1


def test_a_block_stored_and_evicted_between_drains_is_not_announced():
    bm = BlockManager(num_blocks=2, block_size=BS)
    _run(bm, "a", tokens(8, start=100))
    bm.free("a")
    _run(bm, "b", tokens(8, start=200))  # evicts both of a's blocks
    b_hashes = block_hashes(tokens(8, start=200), BS, bm.root)
    assert bm.drain_announcements() == (b_hashes, [])


def test_a_block_evicted_and_stored_again_between_drains_cancels_out():
    bm = BlockManager(num_blocks=2, block_size=BS)
    first = tokens(8, start=100)
    _run(bm, "a", first)
    bm.free("a")
    bm.drain_announcements()
    _run(bm, "b", tokens(8, start=200))  # evicts a's blocks ...
    bm.free("b")
    _run(bm, "c", first)  # ... which come back, evicting b's
    assert bm.drain_announcements() == ([], [])  # as announced last time: a's blocks
    assert bm.num_cached_leading_blocks(first) == 2
    assert bm.num_cached_leading_blocks(tokens(8, start=200)) == 0


def test_nothing_is_announced_without_prefix_caching():
    bm = BlockManager(num_blocks=8, block_size=BS, enable_prefix_caching=False)
    _run(bm, "a", tokens(9))
    assert bm.drain_announcements() == ([], [])
    assert bm.num_cached_leading_blocks(tokens(9)) == 0


def test_net_change_merges_a_later_change():
    change = NetChange()
    change.merge([b"a", b"b"], [b"x"])
    change.merge([b"x"], [b"a", b"y"])  # x back, a gone again, y gone
    assert change.peek() == ([b"b"], [b"y"])
    assert change.drain() == ([b"b"], [b"y"]) and not change


def test_the_root_changes_only_before_anything_is_hashed():
    bm = BlockManager(num_blocks=8, block_size=BS)
    bm.set_root(root_hash("m"))
    assert bm.root == root_hash("m")
    _run(bm, "a", tokens(8))
    bm.set_root(root_hash("m"))  # the same root: nothing to change
    with pytest.raises(ValueError):
        bm.set_root(root_hash("other"))


def test_the_engine_announces_what_its_steps_cached(tiny_llama):
    engine = tiny_llama.engine(block_size=BS)
    root = root_hash("tiny")
    engine.set_prefix_root(root)
    prompt = random_prompt(10, seed=5)
    engine.add_request("a", prompt, greedy(3))
    outputs = run_to_completion(engine)
    stored, removed = engine.drain_block_announcements()
    # prompt + generated tokens: 12 positions computed (the last sampled token is not)
    assert stored == block_hashes(prompt + outputs["a"], BS, root)[:3] and removed == []
    assert engine.num_cached_prefix_blocks(prompt) == 2
