"""The disk tier behind the host tier (`kv_offloading_disk`): blocks the host tier drops for room
are kept in a memory-mapped file and come back with the same bytes (answers bit for bit as if the
prefix never left the pool), counted as disk hits; the file leaves nothing in its directory; the
tiers stay within their sizes; a block moved from host to disk stays announced, one dropped from
disk is removed; and the settings are checked."""

from __future__ import annotations

import os

import pytest

from kvfleet.shared.wire import SamplingParams
from kvfleet.shared.wire.prefix_hash import block_hashes
from kvfleet.worker.engine.engine import EngineConfig
from kvfleet.worker.engine.memory.block_manager import DISK
from tests.engine.tiny_models import random_prompt
from tests.engine.test_kv_tier import (BS, PREFIX, SMALL_POOL, TENANTS, block_bytes_of, prefixes,
                                       run_turns, tier_gib)

HOST_BLOCKS = 10  # one prefix (8 blocks) fits the host tier, not the working set (4 x 8)


def disk_engine(tiny, tmp_path, host_blocks: int = HOST_BLOCKS, disk_blocks: int = 64,
                **config):
    block_bytes = block_bytes_of(tiny, **config)
    return tiny.engine(num_blocks=SMALL_POOL,
                       kv_offloading_size=tier_gib(host_blocks, block_bytes),
                       kv_offloading_disk=str(tmp_path),
                       kv_offloading_disk_size=tier_gib(disk_blocks, block_bytes), **config)


@pytest.mark.parametrize("dtype,kv_dtype", [("float32", "auto"), ("bfloat16", "auto"),
                                            ("float32", "int8")])
def test_prefixes_the_host_tier_dropped_come_back_from_disk_with_the_same_answers(
        tiny, tmp_path, dtype, kv_dtype):
    config = dict(dtype=dtype, kv_dtype=kv_dtype)
    work = prefixes(TENANTS)
    with_disk = disk_engine(tiny, tmp_path, **config)
    host_size = tier_gib(HOST_BLOCKS, block_bytes_of(tiny, **config))
    host_only = tiny.engine(num_blocks=SMALL_POOL, kv_offloading_size=host_size, **config)
    never_left = tiny.engine(num_blocks=256, **config)
    runs = {name: run_turns(engine, work) for name, engine in
            (("disk", with_disk), ("host", host_only), ("pool", never_left))}
    answers = {name: [(t, lp) for t, lp, _ in run] for name, run in runs.items()}
    assert answers["disk"] == answers["pool"]  # tokens and logprobs, bit for bit
    if dtype == "float32" and kv_dtype == "auto":
        assert [t for t, _ in answers["disk"]] == [
            tiny.reference(p + random_prompt(5, seed=100 + 10 * r + i), 6)
            for r in range(2) for i, p in enumerate(work)]
    second = slice(TENANTS, None)
    # every prefix came back whole with the disk tier; the host tier alone held too few
    assert [cached for _, _, cached in runs["disk"][second]] == [PREFIX] * TENANTS
    assert sum(cached for _, _, cached in runs["host"][second]) < TENANTS * PREFIX  # control
    stats = with_disk.stats()
    assert stats.prefix_disk_hit_tokens > 0
    assert stats.prefix_host_hit_tokens == TENANTS * PREFIX  # host and disk together
    assert stats.kv_disk_restored_blocks * BS == stats.prefix_disk_hit_tokens
    assert stats.kv_disk_spilled_blocks > 0
    with_disk.block_manager.check_invariants()


def test_seeded_answers_at_the_default_settings_are_the_same_with_the_disk_tier(tiny_llama,
                                                                                tmp_path):
    seeded = SamplingParams(max_tokens=6, temperature=0.9, top_p=0.95, seed=7, ignore_eos=True)
    work = prefixes(TENANTS)
    plain = run_turns(tiny_llama.engine(num_blocks=256), work, params=seeded)
    tiered = run_turns(disk_engine(tiny_llama, tmp_path), work, params=seeded)
    assert [(t, lp) for t, lp, _ in tiered] == [(t, lp) for t, lp, _ in plain]


def test_the_file_leaves_nothing_behind_and_the_tiers_stay_within_their_sizes(tiny_llama,
                                                                             tmp_path):
    disk_blocks = 12  # fewer than the working set's 32 prefix blocks: the disk tier drops too
    engine = disk_engine(tiny_llama, tmp_path, disk_blocks=disk_blocks)
    assert os.listdir(tmp_path) == []  # mapped, then unlinked at once
    disk = engine.tier.disk
    assert disk.capacity_blocks == disk_blocks and disk.values.shape[0] == disk_blocks
    for rnd in range(3):
        run_turns(engine, prefixes(TENANTS), rounds=1)
        stats = engine.stats()
        assert stats.kv_offload_used_bytes <= stats.kv_offload_capacity_bytes
        assert stats.kv_disk_used_bytes <= stats.kv_disk_capacity_bytes
    stats = engine.stats()
    assert stats.kv_disk_evicted_blocks > 0  # it was full and dropped its oldest
    assert len(disk.index) == disk_blocks
    assert stats.kv_disk_capacity_bytes == disk_blocks * engine.pool.block_bytes
    assert os.listdir(tmp_path) == []
    assert any("disk tier" in line for line in engine.budget_report())


def test_a_block_moved_to_disk_stays_announced_and_one_dropped_from_disk_is_removed(
        tiny_llama, tmp_path):
    engine = disk_engine(tiny_llama, tmp_path, disk_blocks=12)
    bm = engine.block_manager
    work = prefixes(8)
    run_turns(engine, work[:1], rounds=1)  # the first prefix, then pushed out by the others
    first = block_hashes(work[0], BS, bm.root)
    engine.drain_block_announcements()
    on_disk, removed = [], []
    for prefix in work[1:4]:
        run_turns(engine, [prefix], rounds=1)
        removed += bm.drain_announcements().peek()[1]
        on_disk = [h for h in first if (bm.locate(h) or ("",))[0] == DISK]
        if on_disk:
            break
    assert on_disk  # the host tier (10 blocks) dropped some of the first prefix to disk
    assert not set(on_disk) & set(removed)  # still held: not announced removed
    assert set(on_disk) <= set(bm.host_hashes())
    run_turns(engine, work[4:], rounds=1)  # 32 more blocks: the disk tier (12) drops them
    removed += bm.drain_announcements().peek()[1]
    gone = [h for h in first if bm.locate(h) is None]
    assert gone and set(gone) <= set(removed)


def test_a_prefix_on_disk_is_exported_to_a_peer_with_its_bytes(tiny_llama, tmp_path):
    engine = disk_engine(tiny_llama, tmp_path)
    work = prefixes(TENANTS)
    run_turns(engine, work[:1], rounds=1)
    hashes = block_hashes(work[0], BS, engine.block_manager.root)
    in_pool = engine.prefixes.export(hashes)
    run_turns(engine, work[1:], rounds=1)  # pushed to the host tier, then partly to disk
    places = {engine.block_manager.locate(h)[0] for h in hashes}
    assert DISK in places
    from_tiers = engine.prefixes.export(hashes)
    assert from_tiers.num_blocks == in_pool.num_blocks == len(hashes)
    assert from_tiers.values.equal(in_pool.values)


def test_the_disk_tier_settings_are_checked(tiny_llama, tmp_path):
    with pytest.raises(ValueError, match="kv_offloading_size"):
        EngineConfig(kv_offloading_disk=str(tmp_path), kv_offloading_disk_size=0.01)
    with pytest.raises(ValueError, match="kv_offloading_disk_size"):
        EngineConfig(kv_offloading_disk=str(tmp_path), kv_offloading_size=0.01)
    with pytest.raises(ValueError, match="needs kv_offloading_disk"):
        EngineConfig(kv_offloading_size=0.01, kv_offloading_disk_size=0.01)
    with pytest.raises(ValueError, match="not a directory"):
        tiny_llama.engine(num_blocks=SMALL_POOL, kv_offloading_size=0.001,
                          kv_offloading_disk=str(tmp_path / "missing"),
                          kv_offloading_disk_size=0.001)
    with pytest.raises(ValueError, match="holds no KV block"):
        tiny_llama.engine(num_blocks=SMALL_POOL, kv_offloading_size=0.001,
                          kv_offloading_disk=str(tmp_path), kv_offloading_disk_size=1e-9)
    assert EngineConfig().kv_offloading_disk == ""  # off by default
