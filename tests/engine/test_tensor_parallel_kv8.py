"""8-bit KV with 2 gloo ranks: each rank quantises the rows of its own KV heads (one scale per
token and KV head, as with one rank), and the greedy tokens are the 1-rank engine's.

A module of its own: one process holds one tensor-parallel group at a time, and
test_tensor_parallel.py keeps its engines for the whole of its module.
"""

from __future__ import annotations

import functools

from tests.engine.test_tensor_parallel import scenario, serve
from tests.engine.tiny_models import build_model
from kvfleet.worker.engine.engine import EngineConfig
from kvfleet.worker.process.tp_rank import launch_engine


def test_int8_kv_with_two_ranks_gives_the_one_rank_tokens(tiny_llama):
    config = dict(num_blocks=22, block_size=4, max_batched_tokens=8, preemption="swap",
                  kv_dtype="int8")
    engine = launch_engine(functools.partial(build_model, "llama"),
                           EngineConfig(device="cpu", dtype="float32", tensor_parallel_size=2, **config),
                           num_threads=1)
    try:
        assert engine.pool.kv_format.name == "int8" and engine.pool.layout.num_kv_heads == 1
        prompts, max_tokens = scenario()
        produced = serve(engine, prompts, max_tokens)
        assert engine.stats().num_swap_preemptions > 0
    finally:
        engine.close()
    assert serve(tiny_llama.engine(**config), prompts, max_tokens) == produced
