"""What the parts of benchmarks/kv_tiers.py share: the model and its block geometry (`Setup`), a
fresh engine over it, case (a)'s pool (also the soak's), a batch of requests run to completion,
a prompt's block hashes and a ratio's verdict. Not run itself: `python -m benchmarks.kv_tiers`."""

from __future__ import annotations

import copy
import sys
from dataclasses import dataclass

import torch

from benchmarks.engine_throughput import load_model
from benchmarks.prefix_cache import run_at_once
from kvfleet.shared.models import resolve_model_path
from kvfleet.shared.wire.prefix_hash import BlockHash, block_hashes
from kvfleet.worker.engine.engine import Engine, EngineConfig


def verdict(ratio: float, target: float) -> str:
    return "MET" if ratio >= target else "MISSED"


class Setup:
    """What the parts share: the model in the engine's dtype, its block size and block bytes."""

    def __init__(self, args):
        path = resolve_model_path(args.model)
        probe = Engine(load_model(path, torch.float32),
                       EngineConfig(device="cpu", dtype=args.dtype, num_blocks=4))
        self.dtype, self.block_size = probe.dtype, probe.config.block_size
        self.block_bytes, self.vocab_size = probe.pool.block_bytes, probe.model.config.vocab_size
        self.max_model_len = probe.max_model_len
        del probe
        self.model = load_model(path, self.dtype)

    def blocks(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def gib(self, num_blocks: int) -> float:
        return num_blocks * self.block_bytes / (1 << 30)


def working_set_pool(args, setup: Setup) -> tuple[int, int]:
    """Case (a)'s working set (tokens) and the pool (blocks) it is `--working-set-ratio` times."""
    working_set = args.tenants * args.prefix_tokens
    num_blocks = int(working_set / args.working_set_ratio) // setup.block_size
    request_blocks = setup.blocks(args.prefix_tokens + args.question_tokens + args.max_tokens)
    if num_blocks <= request_blocks:
        sys.exit(f"a pool of {num_blocks} blocks would not hold one request ({request_blocks}): "
                 f"more tenants, or a smaller --working-set-ratio")
    return working_set, num_blocks


# ---- the parts that run requests by hand: one batch at a time ------------------------------------


@dataclass
class Batch:
    """Requests added at once and run to completion."""

    seconds: float  # from the first add to the step that finished the last one
    ttft_s: list[float]  # each one's add to the step that returned its first token
    outputs: list[list[int]]

    @property
    def output_tokens(self) -> int:
        return sum(len(o) for o in self.outputs)


def run_batch(engine: Engine, label: str, prompts: list[list[int]], max_tokens: int) -> Batch:
    """`prompts` added at once (greedy, `max_tokens` each) and stepped until every one ends."""
    seconds, ttft, outputs = run_at_once(engine, label, prompts, [max_tokens] * len(prompts))
    return Batch(seconds, list(ttft), outputs)


def prompt_hashes(engine: Engine, prompt: list[int]) -> list[BlockHash]:
    """The block hashes of `prompt` a lookup could hit: its full blocks but one token's."""
    block_size = engine.config.cache.block_size
    return block_hashes(prompt, block_size, engine.block_manager.root,
                        (len(prompt) - 1) // block_size)


def fresh(setup: Setup, config: EngineConfig) -> Engine:
    return Engine(copy.deepcopy(setup.model), config)
