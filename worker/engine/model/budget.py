"""What the engine's memory and time are planned on at start-up: the KV pool's size (profiled on an
accelerator, agreed between tensor-parallel ranks) and the preemption cost model's priors (a timed
swap round trip, a prefill rate guessed from the model's size)."""

from __future__ import annotations

import time
from dataclasses import replace

import torch

from kvfleet.worker.engine.attention import AttentionBackend
from kvfleet.worker.engine.core.config import EngineConfig
from kvfleet.worker.engine.memory.device import is_cuda
from kvfleet.worker.engine.memory.kv_cache import KVCachePool, KVLayout, MemoryBudget, plan_budget
from kvfleet.worker.engine.model.memory_profile import profile_step
from kvfleet.worker.engine.model.model_prep import PreparedModel
from kvfleet.worker.engine.core.preemption import PreemptionCostModel
from kvfleet.worker.engine.parallel.tp_group import RankGroup


def plan_kv_budget(prepared: PreparedModel, layout: KVLayout, config: EngineConfig,
                   max_model_len: int, attention_backend: AttentionBackend,
                   ranks: RankGroup | None = None,
                   draft_layout: KVLayout | None = None) -> MemoryBudget:
    """The pool's blocks: `cache.num_blocks`, else what the device holds beside the weights
    (and, on CUDA, the peak of the largest step, profiled); the smallest of every rank's. With a
    draft model its pool has as many blocks, and the KV bytes are shared out between the two."""
    model, device, cache = prepared.module, prepared.device, config.cache
    step_peak_bytes = 0
    if is_cuda(device) and cache.num_blocks is None:
        num_heads = prepared.num_heads if ranks is not None else None
        spec = config.speculative_config
        step_peak_bytes = profile_step(
            model, layout, cache.block_size, config.scheduler.max_batched_tokens,
            config.scheduler.max_running, device, attention_backend, num_heads=num_heads,
            num_speculative_tokens=0 if spec is None else spec.num_speculative_tokens).peak_bytes
    budget = plan_budget(
        model, layout, cache.block_size, max_model_len, device, cache.num_blocks,
        cache.kv_memory_bytes, cache.gpu_memory_utilization,
        activation_reserve_bytes=step_peak_bytes)
    if draft_layout is not None and cache.num_blocks is None:
        both = layout.bytes_per_token + draft_layout.bytes_per_token
        num_blocks = max(budget.num_blocks * layout.bytes_per_token // both, 1)
        budget = replace(budget, num_blocks=num_blocks,
                         kv_bytes=num_blocks * layout.bytes_per_token * cache.block_size,
                         source=budget.source + ", shared with the draft model's KV")
    if ranks is None:
        return budget
    num_blocks = ranks.agree_min(budget.num_blocks)  # every rank's pool has the same blocks
    return replace(budget, num_blocks=num_blocks,
                   kv_bytes=num_blocks * budget.bytes_per_token * cache.block_size,
                   source=budget.source + f", smallest of {ranks.world_size} ranks")


def preemption_cost_model(mode: str, pool: KVCachePool, model: torch.nn.Module) -> PreemptionCostModel:
    """The cost model with its priors: until steps and swaps are timed, a calibration round trip
    and 2 FLOPs per weight per token (counted before the CPU packs its weights)."""
    return PreemptionCostModel(mode, pool.block_bytes, calibrate_swap_bytes_per_s(pool),
                               prior_prefill_s_per_token(model, pool.device))


def calibrate_swap_bytes_per_s(pool: KVCachePool) -> float:
    """Time a round trip of a few blocks through host memory."""
    blocks = list(range(min(8, pool.num_blocks)))
    start = time.perf_counter()
    pool.copy_in(pool.copy_out(blocks), blocks)
    if is_cuda(pool.device):
        torch.cuda.synchronize(pool.device)
    seconds = max(time.perf_counter() - start, 1e-6)
    return 2 * len(blocks) * pool.block_bytes / seconds


def prior_prefill_s_per_token(model: torch.nn.Module, device: torch.device) -> float:
    """2 FLOPs per weight per token at a modest rate for the device."""
    num_params = sum(p.numel() for p in model.parameters())
    flops_per_s = 2e13 if is_cuda(device) else 5e10
    return 2 * num_params / flops_per_s
