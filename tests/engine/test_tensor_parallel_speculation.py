"""Speculative decoding under tensor parallelism (a module of its own: one rank group per
process at a time, and test_tensor_parallel.py keeps one per case)."""

from __future__ import annotations

import dataclasses
import functools

from tests.engine.test_tensor_parallel import serve, tp_config
from tests.engine.tiny_models import TinyModel, build_model, random_prompt
from kvfleet.worker.process.tp_rank import launch_engine


def test_verified_proposals_on_two_ranks_equal_hf_generate():
    """Speculation under tensor parallelism: rank 0 proposes and verifies, every rank computes
    the proposals' rows (the step message carries them)."""
    tiny = TinyModel("llama")
    config = dataclasses.replace(tp_config("recompute"), num_blocks=64, speculative_config={
        "method": "ngram", "num_speculative_tokens": 3, "adaptive": False})
    engine = launch_engine(functools.partial(build_model, "llama"), config, num_threads=1)
    try:
        prompts = [random_prompt(5, seed=60) * 3, random_prompt(4, seed=61) * 4]
        produced = serve(engine, prompts, [24, 24])
        assert [produced["r0"], produced["r1"]] == [tiny.reference(p, 24) for p in prompts]
        assert engine.speculation.speculator.stats.num_drafts > 0
    finally:
        engine.close()
