"""An engine's parts, built in the order their memory and their choices need, and its features
registered in the order of the step lifecycle (lifecycle.py).

The order: the model placed (and sharded) on the device; a draft model placed beside it
(speculation/feature.py) and the LoRA slots allocated before the KV budget is planned (on CUDA
both are memory in use); the pools; the scheduler with its stop rules, the sampler and the
output constraints; the model packed for the device, the runner and its decode graphs; the
draft's runner. The features then: tensor parallelism (its step goes to the other ranks before
anything else touches the pools), swapping, the host tier of evicted prefix blocks (its copies
into the pool after the swaps have read theirs), speculation, LoRA adapters, the pace.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace

import torch

from kvfleet.worker.engine.attention import AttentionBackend, resolve_attention_backend
from kvfleet.worker.engine.memory.block_manager import BlockManager
from kvfleet.worker.engine.model.budget import plan_kv_budget, preemption_cost_model
from kvfleet.worker.engine.core.config import CacheConfig, EngineConfig
from kvfleet.worker.engine.core.cuda_graphs import DecodeGraphs
from kvfleet.worker.engine.memory.device import (
    is_cuda, resolve_block_size, resolve_device, resolve_dtype, select_device)
from kvfleet.worker.engine.model.invariance import invariance_gap
from kvfleet.worker.engine.memory.kv_cache import KVCachePool, KVLayout, MemoryBudget
from kvfleet.worker.engine.memory.kv_format import KVFormat, resolve_kv_format
from kvfleet.worker.engine.core.lifecycle import Feature, Features
from kvfleet.worker.engine.lora.feature import Adapters, NoAdapters
from kvfleet.worker.engine.lora.manager import LoraManager
from kvfleet.worker.engine.model.model_prep import (
    PreparedModel, eos_token_ids_of, max_model_len_of, pack_for_cpu, prepare_model)
from kvfleet.worker.engine.core.model_runner import ModelRunner
from kvfleet.worker.engine.moves import SequenceMoves
from kvfleet.worker.engine.model.numerics import Numerics, engine_numerics
from kvfleet.worker.engine.tiers.offloading import DiskTier, HostTier, Offloading
from kvfleet.worker.engine.tiers.prefix_copies import PrefixCopies
from kvfleet.worker.engine.core.pace import Pace
from kvfleet.worker.engine.pacing import Pacing
from kvfleet.worker.engine.core.preemption import PreemptionCostModel, SwapSpace
from kvfleet.worker.engine.core.sampler import Sampler
from kvfleet.worker.engine.core.scheduler import Scheduler
from kvfleet.worker.engine.speculation.feature import Speculation
from kvfleet.worker.engine.core.stopping import StopChecker
from kvfleet.worker.engine.tiers.swapping import SwappedKV, Swapping
from kvfleet.worker.engine.parallel.tp_group import RankGroup
from kvfleet.worker.engine.parallel.tp_steps import RankSteps
from kvfleet.worker.structured.compiler import GrammarCompiler
from kvfleet.worker.structured.requests import ConstrainedRequests

log = logging.getLogger(__name__)


@dataclass(eq=False, repr=False)  # an engine compares and hashes by identity
class EngineParts:
    """What an engine is made of (engine.Engine holds them as its attributes)."""

    config: EngineConfig  # with the block size resolved
    ranks: RankGroup | None  # tensor parallelism: this rank's group
    device: torch.device
    dtype: torch.dtype
    max_model_len: int
    kv_format: KVFormat
    attention_backend: AttentionBackend
    budget: MemoryBudget
    pool: KVCachePool
    block_manager: BlockManager
    swap_space: SwapSpace
    preemption: PreemptionCostModel
    swapped: SwappedKV
    pace: Pace  # fits the step cost always; binds only with a target
    scheduler: Scheduler
    sampler: Sampler
    constrained: ConstrainedRequests  # one grammar matcher per constrained request
    prepared: PreparedModel  # the engine's own copy of the model; `model` is its module
    model: torch.nn.Module
    invariance_gap: str | None  # None: every row is computed batch-invariantly
    numerics: Numerics  # what decides how this engine rounds
    runner: ModelRunner
    lora: LoraManager | None
    speculation: Speculation | None
    features: Features
    moves: SequenceMoves  # its sequences out to and in from other engines (handoffs)
    tier: HostTier | None  # the host tier of evicted prefix blocks (`--kv-offloading-size`)
    prefixes: PrefixCopies  # prefix blocks out to and in from peers' caches


def assemble(model: torch.nn.Module, config: EngineConfig, tokenizer, ranks: RankGroup | None,
             draft_model: torch.nn.Module | None) -> EngineParts:
    device = ranks.device if ranks is not None else resolve_device(config.model.device)
    select_device(device)  # cuda:N is the current device from here on
    dtype = resolve_dtype(config.model.dtype, device)
    layout = KVLayout.from_model_config(model.config,
                                        resolve_kv_format(config.cache.kv_dtype, dtype))
    placed = prepare_model(model, device, dtype, ranks)
    if placed.shard is not None:
        layout = replace(layout, num_kv_heads=placed.shard.num_kv_heads)
    speculation = Speculation.load(config, draft_model, ranks is not None, device, dtype,
                                   layout.kv_format)
    max_model_len = max_model_len_of(placed.module.config)
    backend = resolve_attention_backend(
        config.model.attention_backend, device, dtype, layout.kv_format, layout.head_dim,
        deterministic=config.model.deterministic)
    lora = None if not config.lora.enable_lora else LoraManager.for_engine(
        config.lora, model, dtype, device, backend, config.model.deterministic, ranks,
        placed.shard)
    config = replace(config, block_size=resolve_block_size(
        config.cache.block_size, backend.cpu_kernel, dtype, layout.kv_format.storage))
    cache, scheduling = config.cache, config.scheduler  # the block size resolved
    graphs_mode = _graphs_mode(config, device, ranks, backend)
    budget = plan_kv_budget(placed, layout, config, max_model_len, backend, ranks,
                            None if speculation is None else speculation.kv_layout)
    pool = KVCachePool(layout, budget.num_blocks, cache.block_size, device)
    if speculation is not None:
        speculation.allocate(budget.num_blocks, cache.block_size, device)
    # with decode graphs the pool's last block is their padding rows' scratch, never handed out
    num_usable_blocks = budget.num_blocks - (graphs_mode is not None)
    if num_usable_blocks < 1:
        raise ValueError("the KV budget holds no block beside the CUDA graphs' scratch block")
    tier = _host_tier(cache, pool)
    block_manager = BlockManager(num_usable_blocks, cache.block_size, cache.enable_prefix_caching,
                                 tier=None if tier is None else tier.index,
                                 disk=None if tier is None or tier.disk is None
                                 else tier.disk.index)
    swap_space = SwapSpace(cache.swap_space_bytes // pool.block_bytes)
    preemption = preemption_cost_model(cache.preemption, pool, placed.module)
    swapped = SwappedKV(pool, preemption)
    eos = eos_token_ids_of(placed.module)
    pace = Pace(config.pace, scheduling.max_batched_tokens)
    scheduler = Scheduler(
        block_manager, StopChecker(eos, max_model_len, tokenizer), scheduling.max_batched_tokens,
        scheduling.max_running, cache.watermark, preemption=preemption, swap_space=swap_space,
        max_loras=config.lora.max_loras if lora else 0,
        adapter_ready=lora.is_ready if lora else None, pace=pace if pace.enabled else None)
    constrained = ConstrainedRequests(
        GrammarCompiler(tokenizer, placed.module.config.vocab_size, eos,
                        config.model.grammar_cache_size) if tokenizer is not None else None)
    # fused layers where the C++ attention kernel reads this pool
    prepared = pack_for_cpu(placed, backend.cpu_kernel, config.model.deterministic)
    gap = invariance_gap(prepared, backend, config.model.deterministic)
    if config.model.deterministic and gap is not None and (ranks is None or ranks.is_driver):
        log.warning("--deterministic: answers may depend on the batch: %s", gap)
    numerics = engine_numerics(device, dtype, backend, layout.kv_format.name, cache.block_size,
                               prepared.module, gap, ranks)
    if lora is not None:  # before any graph is captured: captured without terms
        lora.install(prepared.module)
    runner = ModelRunner(prepared.module, pool, attention_backend=backend,
                         decode_graphs=_decode_graphs(graphs_mode, config, prepared.module, pool,
                                                      budget.num_blocks, max_model_len),
                         num_heads=prepared.num_heads, lora=lora)
    if graphs_mode == "capture":  # after the runner installed its attention on the model
        started = time.perf_counter()
        runner.decode_graphs.capture()
        graphs = runner.decode_graphs
        log.info("captured decode CUDA graphs for batch sizes %s x proposals %s in %.1f s",
                 graphs.buckets, graphs.proposal_buckets, time.perf_counter() - started)
    features: list[Feature] = [] if ranks is None else [RankSteps(ranks, runner, cache.block_size)]
    features.append(Swapping(swapped))
    if tier is not None:
        features.append(Offloading(tier, tier.disk))
    if speculation is not None:
        speculation.start(config.model, device, dtype, max_model_len,
                          prepared.module.config.vocab_size)
        swapped.followers += [] if speculation.draft is None else [speculation.draft]
        features.append(speculation)
    features += [NoAdapters() if lora is None else Adapters(lora), Pacing(pace)]
    registered = Features(features)
    moves = SequenceMoves(pool, block_manager, swapped, registered,
                          prepared.module.config.vocab_size, dtype)
    return EngineParts(config, ranks, device, dtype, max_model_len, layout.kv_format, backend,
                       budget, pool, block_manager, swap_space, preemption, swapped, pace,
                       scheduler, Sampler(eos), constrained, prepared, prepared.module, gap,
                       numerics, runner, lora, speculation, registered, moves, tier,
                       PrefixCopies(pool, block_manager, tier, moves.layout, moves.gap))


def _host_tier(cache: CacheConfig, pool: KVCachePool) -> HostTier | None:
    """The host tier of evicted prefix blocks (`--kv-offloading-size`), or None (off: nothing
    is allocated, and the block manager drops what it evicts as before)."""
    if not cache.kv_offloading_size_bytes or not cache.enable_prefix_caching:
        return None
    tier = HostTier(pool, cache.kv_offloading_size_bytes)
    if cache.kv_offloading_disk:  # behind it: what it drops (`--kv-offloading-disk`)
        tier.disk = DiskTier(pool, cache.kv_offloading_disk_size_bytes, cache.kv_offloading_disk,
                             tier)
    return tier


def _graphs_mode(config: EngineConfig, device: torch.device, ranks: RankGroup | None,
                 backend: AttentionBackend) -> str | None:
    """'capture' (CUDA graphs), 'eager' (their static buffers, no capture) or None (off)."""
    mode = config.model.cuda_graphs
    if mode == "off" or (mode == "auto" and not is_cuda(device)):
        return None
    if ranks is not None:  # a step's collectives are not captured: ranks run eagerly
        if mode == "auto":
            return None
        raise ValueError("cuda_graphs 'eager' is not supported with tensor parallelism")
    if not backend.decode_graphs:
        if mode == "auto":
            return None
        raise ValueError("cuda_graphs 'eager' needs the triton attention backend")
    return "capture" if mode == "auto" else "eager"


def _decode_graphs(graphs_mode: str | None, config: EngineConfig, model: torch.nn.Module,
                   pool: KVCachePool, num_blocks: int, max_model_len: int) -> DecodeGraphs | None:
    if graphs_mode is None:
        return None
    spec = config.speculative_config
    return DecodeGraphs(model, pool, scratch_block=num_blocks - 1,
                        max_batch=config.scheduler.max_running, max_model_len=max_model_len,
                        max_proposals=0 if spec is None else spec.num_speculative_tokens)
