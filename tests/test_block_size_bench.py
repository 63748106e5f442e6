"""benchmarks/block_size.py's fragmented pool: every block free again, in an order a fresh pool
never hands out, and the engine's greedy output over such a pool unchanged."""

from __future__ import annotations

from benchmarks.block_size import fragment
from tests.engine.tiny_models import TinyModel, greedy, random_prompt


def test_a_fragmented_pool_scatters_a_prompts_pages_and_changes_no_token():
    tiny = TinyModel("llama")
    prompt = random_prompt(4 * 12 + 1, seed=9)  # 13 blocks of 4
    fresh = tiny.engine(num_blocks=64)
    fresh.add_request("fresh", prompt, greedy(5))
    fresh.step()
    assert fresh.block_manager.block_table("fresh") == list(range(13))  # in order
    fresh.abort("fresh")

    engine = tiny.engine(num_blocks=64)
    fragment(engine, seed=1)
    assert engine.block_manager.num_free_blocks == 64
    engine.block_manager.check_invariants()
    engine.add_request("scattered", prompt, greedy(5))
    engine.step()
    table = engine.block_manager.block_table("scattered")
    assert len(table) == 13 and table != sorted(table)
    engine.abort("scattered")
    assert engine.generate([prompt], greedy(8)) == [tiny.reference(prompt, 8)]
