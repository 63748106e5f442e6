"""What the engine tells its operator: counters for the metrics (`EngineStats`) and the start-up
lines on its device and its KV budget."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvfleet.shared.cpu_features import cpu_features
from kvfleet.worker.engine.kernels import cpu_kernels, cpu_linear
from kvfleet.worker.engine.attention import AttentionBackend
from kvfleet.worker.engine.memory.block_manager import BlockManager
from kvfleet.worker.engine.memory.device import is_cpu
from kvfleet.worker.engine.memory.kv_cache import KVCachePool, KVLayout, MemoryBudget, format_bytes
from kvfleet.worker.engine.memory.kv_format import resolve_kv_format
from kvfleet.worker.engine.core.model_runner import ModelRunner
from kvfleet.worker.engine.core.preemption import PreemptionCostModel, SwapSpace
from kvfleet.worker.engine.core.scheduler import Scheduler
from kvfleet.worker.engine.speculation.speculator import SpeculationStats
from kvfleet.worker.structured.requests import ConstrainedRequests


@dataclass
class EngineStats:
    num_blocks_total: int
    num_blocks_free: int  # incl. evictable prefix-cache blocks
    num_running: int
    num_waiting: int
    num_preemptions: int
    prefix_queried_tokens: int
    prefix_hit_tokens: int
    num_cached_blocks: int
    num_generated_tokens: int
    num_prefill_tokens_computed: int
    num_swap_preemptions: int = 0  # of num_preemptions, those that swapped the KV out
    swap_used_bytes: int = 0  # host memory held by swapped-out streams
    num_constrained: int = 0  # requests with an output constraint
    grammar_compiles: int = 0  # constraints compiled (cache misses)
    grammar_cache_hits: int = 0
    num_cuda_graph_steps: int = 0  # decode steps replayed from a captured CUDA graph
    # speculative decoding (speculation/speculator.py: SpeculationStats)
    spec_num_drafts: int = 0  # streams' steps that verified proposals
    spec_num_draft_tokens: int = 0  # proposals verified
    spec_num_accepted_tokens: int = 0  # of which accepted
    spec_accepted_per_position: tuple[int, ...] = ()  # [i]: proposals i + 1 accepted
    # the host tier of evicted prefix blocks (offloading.py; zeros when off)
    prefix_host_hit_tokens: int = 0  # of prefix_hit_tokens, those brought back from the tier
    prefix_peer_hit_tokens: int = 0  # of prefix_hit_tokens, those installed from a peer
    kv_offload_capacity_bytes: int = 0
    kv_offload_used_bytes: int = 0
    kv_offloaded_blocks: int = 0  # blocks copied into the tier
    kv_offload_evicted_blocks: int = 0  # blocks dropped from the full tier
    kv_offload_restored_blocks: int = 0  # blocks copied back into the pool
    # the disk tier behind it (`--kv-offloading-disk`; zeros when off)
    prefix_disk_hit_tokens: int = 0  # of prefix_host_hit_tokens, those read from the disk tier
    kv_disk_capacity_bytes: int = 0
    kv_disk_used_bytes: int = 0
    kv_disk_spilled_blocks: int = 0  # blocks the host tier dropped, kept on disk
    kv_disk_evicted_blocks: int = 0  # blocks dropped from the full disk tier
    kv_disk_restored_blocks: int = 0  # blocks read back into the pool
    # a simulated engine (worker/sim/): its cost model ("" for a real one), steps played, and
    # those that ended later than modelled (clock.py)
    simulated: str = ""
    sim_steps: int = 0
    sim_lagged_steps: int = 0


def engine_stats(bm: BlockManager, sched: Scheduler, runner: ModelRunner, swap_used_bytes: int,
                 constrained: ConstrainedRequests,
                 speculation: SpeculationStats | None = None) -> EngineStats:
    graphs, compiler = runner.decode_graphs, constrained.compiler
    spec = speculation or SpeculationStats()
    return EngineStats(
        num_blocks_total=bm.num_blocks, num_blocks_free=bm.num_free_blocks,
        num_running=len(sched.running), num_waiting=len(sched.waiting),
        num_preemptions=sched.num_preemptions, prefix_queried_tokens=bm.prefix_queried_tokens,
        prefix_hit_tokens=bm.prefix_hit_tokens, prefix_host_hit_tokens=bm.prefix_host_hit_tokens,
        prefix_peer_hit_tokens=bm.prefix_peer_hit_tokens,
        prefix_disk_hit_tokens=bm.prefix_disk_hit_tokens,
        num_cached_blocks=bm.num_cached_blocks,
        num_generated_tokens=sched.num_generated_tokens,
        num_prefill_tokens_computed=sched.num_prefill_tokens_computed,
        num_swap_preemptions=sched.num_swap_preemptions, swap_used_bytes=swap_used_bytes,
        num_constrained=len(constrained),
        grammar_compiles=compiler.misses if compiler else 0,
        grammar_cache_hits=compiler.hits if compiler else 0,
        num_cuda_graph_steps=graphs.num_replays if graphs is not None else 0,
        spec_num_drafts=spec.num_drafts, spec_num_draft_tokens=spec.num_draft_tokens,
        spec_num_accepted_tokens=spec.num_accepted_tokens,
        spec_accepted_per_position=tuple(spec.accepted_per_position))


def device_report(device: torch.device, dtype: torch.dtype, backend: AttentionBackend,
                  dtype_name: str, deterministic: bool = False,
                  invariance_gap: str | None = "not asked for") -> str:
    """Device, dtype (and what --dtype said), and on CPU the model and ISA behind `auto`; whether
    rows are computed batch-invariantly (invariance.py)."""
    line = f"{device}, {str(dtype).removeprefix('torch.')} (--dtype {dtype_name})"
    if is_cpu(device):
        line += f"; CPU {cpu_features().describe()}; {torch.get_num_threads()} torch threads"
    line += f"; attention {backend.describe()}"
    if is_cpu(device):
        line += (f"; linears {cpu_linear.products_report(dtype, deterministic)}; "
                 f"{cpu_kernels.report()}")
    verdict = "batch-invariant" if invariance_gap is None else f"not batch-invariant: {invariance_gap}"
    return f"{line}; {verdict}"


def budget_report(budget: MemoryBudget, pool: KVCachePool, dtype: torch.dtype,
                  swap_space: SwapSpace, preemption: PreemptionCostModel,
                  world_size: int | None = None) -> list[str]:
    """The KV budget's lines, what the same bytes hold in each format, preemption and swap."""
    swap = swap_space.capacity_blocks * pool.block_bytes
    lines = budget.report()
    if world_size is not None:
        lines.insert(0, f"tensor parallel over {world_size} ranks: weights, KV cache, bytes per "
                        f"token and swap space are rank 0's (each rank holds its own share); "
                        f"blocks and tokens are the worker's")
    return lines + [
        "tokens that fit by --kv-dtype: " + " · ".join(
            f"{name} {tokens:,}" for name, tokens in tokens_by_kv_dtype(budget, pool, dtype).items()),
        f"preemption: {preemption.mode}; host swap space {format_bytes(swap)} = "
        f"{swap_space.capacity_blocks} blocks"]


def tokens_by_kv_dtype(budget: MemoryBudget, pool: KVCachePool,
                       dtype: torch.dtype) -> dict[str, int]:
    """What the same KV bytes would hold in each storage format, for a model in `dtype`."""
    layout = pool.layout
    result = {}
    for name in ("fp32", "bf16", "fp8", "int8"):
        per_token = KVLayout(layout.num_layers, layout.num_kv_heads, layout.head_dim,
                             resolve_kv_format(name, dtype)).bytes_per_token
        result[name] = budget.kv_bytes // (per_token * budget.block_size) * budget.block_size
    return result
