"""On a GPU: the host tier of the prefix cache is pinned, and a prefix evicted from the pool and
brought back from it gives the answers of an engine without the tier, bit for bit (bf16)."""

from __future__ import annotations

import pytest

from tests.engine.test_kv_tier import PREFIX, SMALL_POOL, TENANTS, prefixes, run_turns, tier_gib
from tests.engine.tiny_models import TinyModel

pytestmark = pytest.mark.cuda


def test_the_tier_is_pinned_and_its_blocks_come_back_exact(gpu):
    tiny = TinyModel("llama")
    config = dict(device=str(gpu), dtype="bfloat16", cuda_graphs="off")
    block_bytes = tiny.engine(num_blocks=4, **config).pool.block_bytes
    work = prefixes(TENANTS)
    without = run_turns(tiny.engine(num_blocks=SMALL_POOL, **config), work)
    engine = tiny.engine(num_blocks=SMALL_POOL, kv_offloading_size=tier_gib(64, block_bytes),
                         **config)
    assert engine.tier.values.is_pinned()
    with_tier = run_turns(engine, work)
    assert [r[:2] for r in with_tier] == [r[:2] for r in without]
    assert engine.stats().prefix_host_hit_tokens == TENANTS * PREFIX
