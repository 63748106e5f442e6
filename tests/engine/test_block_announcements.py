"""The block manager's announcements (prefix-affinity routing): what its prefix cache stored and
evicted since the last drain, as a net change, hashed like the gateways' router hashes prompts."""

from __future__ import annotations

import pytest

from kvfleet.shared.wire.prefix_hash import block_hashes, root_hash
from tests.engine.tiny_models import greedy, random_prompt, run_to_completion
from kvfleet.worker.engine.memory.block_manager import HOST, BlockManager, NetChange
from kvfleet.worker.engine.memory.kv_tier import TierIndex

BS = 4


def tokens(n: int, start: int = 100) -> list[int]:
    return list(range(start, start + n))


def drained(bm: BlockManager) -> tuple[list[bytes], list[bytes], list[bytes]]:
    """(stored, removed, host) since the last drain: the announcement's wire form."""
    return bm.drain_announcements().peek()


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
    assert drained(bm) == (block_hashes(toks, BS, root), [], [])
    assert drained(bm) == ([], [], [])  # drained
    _run(bm, "b", toks + [5, 6])  # hits both blocks, publishes the third
    assert drained(bm) == (block_hashes(toks + [5, 6], BS, root)[2:], [], [])


def test_evicted_blocks_are_announced_as_removed():
    bm = BlockManager(num_blocks=3, block_size=BS)
    old = tokens(8, start=100)
    _run(bm, "old", old)
    bm.free("old")
    stored, _, _ = drained(bm)
    bm.allocate_slots("x", 8)  # 1 never-cached block, then old's tail block is evicted
    assert drained(bm) == ([], [stored[1]], [])
    assert bm.num_cached_leading_blocks(old) == 1


def test_a_block_stored_and_evicted_between_drains_is_not_announced():
    bm = BlockManager(num_blocks=2, block_size=BS)
    _run(bm, "a", tokens(8, start=100))
    bm.free("a")
    _run(bm, "b", tokens(8, start=200))  # evicts both of a's blocks
    b_hashes = block_hashes(tokens(8, start=200), BS, bm.root)
    assert drained(bm) == (b_hashes, [], [])


def test_a_block_evicted_and_stored_again_between_drains_cancels_out():
    bm = BlockManager(num_blocks=2, block_size=BS)
    first = tokens(8, start=100)
    _run(bm, "a", first)
    bm.free("a")
    bm.drain_announcements()
    _run(bm, "b", tokens(8, start=200))  # evicts a's blocks ...
    bm.free("b")
    _run(bm, "c", first)  # ... which come back, evicting b's
    assert drained(bm) == ([], [], [])  # as announced last time: a's blocks
    assert bm.num_cached_leading_blocks(first) == 2
    assert bm.num_cached_leading_blocks(tokens(8, start=200)) == 0


def test_nothing_is_announced_without_prefix_caching():
    bm = BlockManager(num_blocks=8, block_size=BS, enable_prefix_caching=False)
    _run(bm, "a", tokens(9))
    assert drained(bm) == ([], [], [])
    assert bm.num_cached_leading_blocks(tokens(9)) == 0


def test_net_change_merges_a_later_change():
    change, later = NetChange(), NetChange()
    change.add(b"a"), change.add(b"b"), change.remove(b"x")
    later.add(b"x"), later.remove(b"a"), later.remove(b"y")  # x back, a gone again, y gone
    change.merge(later)
    assert change.peek() == ([b"b"], [b"y"], [])
    assert change.drain().peek() == ([b"b"], [b"y"], []) and not change


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
    stored, removed, host = engine.drain_block_announcements().peek()
    # prompt + generated tokens: 12 positions computed (the last sampled token is not)
    assert stored == block_hashes(prompt + outputs["a"], BS, root)[:3] and removed == host == []
    assert engine.num_cached_prefix_blocks(prompt) == 2


# ---- tiers: a block the pool evicts into the host tier is still held ------------------------

def test_net_change_keeps_only_where_an_item_was_and_where_it_is():
    change = NetChange()
    change.add(b"a"), change.offload(b"a")  # new, straight into the host tier: stored and host
    change.offload(b"b")  # moved: host only
    change.offload(b"c"), change.restore(b"c")  # there and back: cancels
    change.offload(b"d"), change.remove(b"d", HOST)  # moved, then dropped from the tier: removed
    change.restore(b"e")  # brought back: on device again
    change.add(b"f"), change.offload(b"f"), change.remove(b"f", HOST)  # came and went: cancels
    change.remove(b"g", HOST), change.add(b"g")  # dropped from the tier, then computed again
    assert change.peek() == ([b"a", b"e", b"g"], [b"d"], [b"a", b"b"])


def test_net_change_merges_tier_moves_across_drains():
    change = NetChange()
    change.offload(b"a"), change.add(b"b")
    later = NetChange()
    later.restore(b"a")  # back on device: as the unsent change found it, nothing to send
    later.offload(b"b"), later.remove(b"b", HOST)  # b came and went
    later.remove(b"c", HOST)
    change.merge(later)
    assert change.peek() == ([], [b"c"], [])


def tiered(num_blocks: int, capacity: int) -> BlockManager:
    return BlockManager(num_blocks=num_blocks, block_size=BS,
                        tier=TierIndex(capacity, lambda block, slot: None))


def test_a_block_evicted_into_the_host_tier_is_announced_as_moved_not_removed():
    bm = tiered(num_blocks=2, capacity=4)
    a = tokens(8, start=100)
    _run(bm, "a", a)
    bm.free("a")
    a_hashes = block_hashes(a, BS, bm.root)
    assert drained(bm) == (a_hashes, [], [])
    _run(bm, "b", tokens(8, start=200))  # evicts both of a's blocks into the tier
    b_hashes = block_hashes(tokens(8, start=200), BS, bm.root)
    assert drained(bm) == (b_hashes, [], a_hashes[::-1])  # a's tail block is evicted first
    assert set(bm.host_hashes()) == set(a_hashes) and bm.cached_hashes() == b_hashes
    bm.free("b")
    # a's prompt again: its first block comes back into the pool (the last token is computed)
    _run(bm, "a2", a)
    stored, removed, host = drained(bm)
    assert stored[0] == a_hashes[0] and removed == [] and b_hashes[1] in host
    bm.check_invariants()


def test_a_block_the_host_tier_drops_is_announced_as_removed():
    bm = tiered(num_blocks=2, capacity=2)
    _run(bm, "a", tokens(8, start=100))
    bm.free("a")
    _run(bm, "b", tokens(8, start=200))  # a's two blocks into the tier (now full)
    bm.free("b")
    drained(bm)
    _run(bm, "c", tokens(8, start=300))  # b's two into the tier, which drops a's two
    a_hashes = block_hashes(tokens(8, start=100), BS, bm.root)
    b_hashes = block_hashes(tokens(8, start=200), BS, bm.root)
    stored, removed, host = drained(bm)
    assert sorted(removed) == sorted(a_hashes) and sorted(host) == sorted(b_hashes)
    assert set(stored) == set(block_hashes(tokens(8, start=300), BS, bm.root))


def test_a_block_the_tier_drops_while_the_pool_holds_it_stays_on_device():
    bm = tiered(num_blocks=2, capacity=2)
    a, b = tokens(8, start=100), tokens(8, start=200)
    a_hashes, b_hashes = block_hashes(a, BS, bm.root), block_hashes(b, BS, bm.root)
    _run(bm, "a", a)
    bm.free("a")
    _run(bm, "b", b)  # a's blocks into the tier
    bm.free("b")
    drained(bm)
    # a's first block comes back; the pool block it takes was b's tail, evicted into the full
    # tier, which drops a's tail for room
    assert bm.find_cached_prefix("a2", a) == [bm._cached[a_hashes[0]]]
    assert drained(bm) == ([a_hashes[0]], [a_hashes[1]], [b_hashes[1]])
    bm.tier.take_loads()  # the step copied it in: its slot is no longer pinned
    bm.tier._free_slot(), bm.tier._free_slot()  # the tier drops b's tail, then a's first block
    assert not bm.tier.holds(a_hashes[0])
    assert drained(bm) == ([], [b_hashes[1]], [])  # a's first block: still on device
    bm.check_invariants()
