"""The prefill that benchmarks/engine_throughput.py measures against the peak product rate:
seeded random prompts (no shared prefix) and the time kvfleet's engine takes to compute them."""

from __future__ import annotations

import copy
import time

import torch

from kvfleet.shared.wire import SamplingParams
from kvfleet.worker.engine.engine import Engine, EngineConfig


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def prefill_prompts(args) -> list[list[int]]:
    """--prefill-prompts seeded random prompts of --prefill-len tokens (every token computed: no
    prefix is shared; ids below 16,000, inside every vocabulary here)."""
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, 16000, (args.prefill_len,), generator=g).tolist()
            for _ in range(args.prefill_prompts)]


def prefill_seconds(model, prompts: list[list[int]], config: EngineConfig) -> float:
    """Seconds kvfleet's engine takes to compute these prompts (one token out each): the best
    of two runs, each on a fresh engine (an empty prefix cache)."""
    best = float("inf")
    for _ in range(2):
        engine = Engine(copy.deepcopy(model), config)
        engine.generate(prompts[:1], greedy(1))  # first-call costs out of the timing
        engine = Engine(copy.deepcopy(model), config)
        start = time.perf_counter()
        engine.generate(prompts, [greedy(1)] * len(prompts))
        best = min(best, time.perf_counter() - start)
    return best
