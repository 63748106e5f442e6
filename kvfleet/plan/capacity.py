"""Capacity arithmetic of the seed design: a memory budget (weights first, KV cache from what is
left), a throughput budget (accelerators for a demand), their cost, and two "what if" levers
(a smaller KV dtype, prefix caching). Pure functions over typed inputs; no I/O."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

KV_DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1, "int8": 1}
KV_DTYPE_LABELS = {4: "fp32", 2: "bf16/fp16", 1: "fp8/int8"}
# --kv-bytes-per-token is quoted at this element size (the seed's 0.5 MB is a 2-byte cache).
REFERENCE_KV_DTYPE_BYTES = 2
# kvfleet's 8-bit formats add one fp16 scale per (token, KV head) row of head_dim values.
SCALE_BYTES_PER_ROW = 2
DEFAULT_HEAD_DIM = 128


def kv_element_bytes(kv_dtype: str, head_dim: int = DEFAULT_HEAD_DIM) -> float:
    """Bytes per cached K or V value as kvfleet stores it, scales included."""
    element = KV_DTYPE_BYTES[kv_dtype]
    return element + (SCALE_BYTES_PER_ROW / head_dim if element == 1 else 0)
SECONDS_PER_HOUR = 3600
TOKENS_PER_MILLION = 1_000_000


class WeightsDoNotFit(ValueError):
    """The model's weights alone exceed the accelerator's memory."""


@dataclass(frozen=True)
class PlanInputs:
    num_params: int
    bytes_per_param: float
    gpu_memory_bytes: int
    kv_bytes_per_token: int  # at kv_dtype
    kv_dtype: str
    contexts: tuple[tuple[int, float | None], ...]  # (context tokens, mix weight or None)
    demand_tokens_per_s: float
    gpu_tokens_per_s: float
    streams_per_gpu: int
    cost_per_gpu_hour: float | None
    prefix_prompts: int
    prefix_opening_tokens: int
    prefix_share: float | None  # fraction of prompt tokens served from a cached opening
    kv_source: str = "--kv-bytes-per-token"  # where kv_bytes_per_token came from
    head_dim: int = DEFAULT_HEAD_DIM  # sizes the 8-bit formats' scale overhead
    tensor_parallel_size: int = 1  # accelerators per worker (one rank each)
    replicated_params: int = 0  # whole on every rank (embeddings, LM head)
    num_kv_heads: int | None = None  # when known: KV heads per rank (else 1/N of the KV)


@dataclass(frozen=True)
class Memory:
    """One accelerator's memory; with tensor parallelism, one rank's (weights, free KV and KV
    bytes per token are per rank; tokens that fit are the worker's)."""

    gpu_memory_bytes: int
    weights_bytes: int
    free_kv_bytes: int
    kv_bytes_per_token: int
    kv_dtype: str
    tokens_that_fit: int
    tensor_parallel_size: int = 1


@dataclass(frozen=True)
class ContextFit:
    context_tokens: float  # a mix average need not be whole
    kv_bytes_per_conversation: int
    conversations_per_gpu: int
    mix_weight: float | None = None


@dataclass(frozen=True)
class Throughput:
    gpu_tokens_per_s: float
    streams_per_gpu: int
    tokens_per_s_per_stream: float
    demand_tokens_per_s: float
    gpus_needed: int  # with tensor parallelism: whole workers of N accelerators
    workers_needed: int = 0


@dataclass(frozen=True)
class Cost:
    cost_per_gpu_hour: float
    fleet_cost_per_hour: float
    cost_per_million_tokens_full_gpu: float  # one accelerator at its full rate
    cost_per_million_tokens_fleet: float  # the rounded-up fleet at this demand


@dataclass(frozen=True)
class KvDtypeWhatIf:
    kv_dtype: str
    kv_bytes_per_token: int
    capacity_factor: float
    contexts: list[ContextFit]


@dataclass(frozen=True)
class PrefixWhatIf:
    prompts: int
    opening_tokens: int
    computations_without_cache: int
    computations_with_cache: int
    computations_saved: int
    prefix_share: float | None
    prefill_fraction_left: float | None  # of prompt-token computations, at prefix_share
    live_kv_unchanged: bool = True  # caching saves prefill work, not decode-time KV memory


@dataclass(frozen=True)
class Plan:
    memory: Memory
    contexts: list[ContextFit]
    mix: ContextFit | None
    throughput: Throughput
    cost: Cost | None
    kv_dtype_what_ifs: list[KvDtypeWhatIf]
    prefix_what_if: PrefixWhatIf
    warnings: list[str] = field(default_factory=list)


def make_plan(inputs: PlanInputs) -> Plan:
    memory = plan_memory(inputs)
    contexts = [fit_context(memory.free_kv_bytes, memory.kv_bytes_per_token, tokens, weight)
                for tokens, weight in inputs.contexts]
    mix = fit_mix(memory, inputs.contexts)
    throughput = plan_throughput(inputs)
    return Plan(memory, contexts, mix, throughput, plan_cost(inputs, throughput),
                kv_dtype_what_ifs(inputs, memory), prefix_what_if(inputs),
                memory_warnings(contexts, mix, inputs.streams_per_gpu))


def plan_memory(inputs: PlanInputs) -> Memory:
    n = inputs.tensor_parallel_size
    replicated = min(inputs.replicated_params, inputs.num_params) if n > 1 else 0
    weights_bytes = math.ceil(((inputs.num_params - replicated) / n + replicated)
                              * inputs.bytes_per_param)
    free_kv_bytes = inputs.gpu_memory_bytes - weights_bytes
    if free_kv_bytes <= 0:
        raise WeightsDoNotFit(weights_bytes, inputs.gpu_memory_bytes)
    kv_bytes_per_token = math.ceil(inputs.kv_bytes_per_token * kv_share_per_rank(inputs))
    return Memory(inputs.gpu_memory_bytes, weights_bytes, free_kv_bytes,
                  kv_bytes_per_token, inputs.kv_dtype,
                  free_kv_bytes // kv_bytes_per_token, n)


def kv_share_per_rank(inputs: PlanInputs) -> float:
    """The largest share of a token's KV one rank holds: whole KV heads split as evenly as
    possible, one replicated head when there are fewer heads than ranks (as the engine does)."""
    n, heads = inputs.tensor_parallel_size, inputs.num_kv_heads
    if n == 1:
        return 1.0
    if heads is None:
        return 1.0 / n
    return (-(-heads // n) if heads >= n else 1) / heads


def fit_context(free_kv_bytes: int, kv_bytes_per_token: int, context_tokens: float,
                mix_weight: float | None = None) -> ContextFit:
    kv_bytes = math.ceil(context_tokens * kv_bytes_per_token)
    return ContextFit(context_tokens, kv_bytes, free_kv_bytes // kv_bytes, mix_weight)


def fit_mix(memory: Memory, contexts: tuple[tuple[int, float | None], ...]) -> ContextFit | None:
    """The mix's average conversation: Σ weight × tokens, then how many such fit."""
    if any(weight is None for _, weight in contexts):
        return None
    mean_tokens = sum(tokens * weight for tokens, weight in contexts)
    return fit_context(memory.free_kv_bytes, memory.kv_bytes_per_token, mean_tokens)


def plan_throughput(inputs: PlanInputs) -> Throughput:
    n = inputs.tensor_parallel_size
    workers = math.ceil(math.ceil(inputs.demand_tokens_per_s / inputs.gpu_tokens_per_s) / n)
    return Throughput(
        gpu_tokens_per_s=inputs.gpu_tokens_per_s,
        streams_per_gpu=inputs.streams_per_gpu,
        tokens_per_s_per_stream=inputs.gpu_tokens_per_s / inputs.streams_per_gpu,
        demand_tokens_per_s=inputs.demand_tokens_per_s,
        gpus_needed=workers * n,
        workers_needed=workers,
    )


def plan_cost(inputs: PlanInputs, throughput: Throughput) -> Cost | None:
    if inputs.cost_per_gpu_hour is None:
        return None
    fleet_cost_per_hour = throughput.gpus_needed * inputs.cost_per_gpu_hour
    return Cost(
        cost_per_gpu_hour=inputs.cost_per_gpu_hour,
        fleet_cost_per_hour=fleet_cost_per_hour,
        cost_per_million_tokens_full_gpu=cost_per_million_tokens(
            inputs.cost_per_gpu_hour, inputs.gpu_tokens_per_s),
        cost_per_million_tokens_fleet=cost_per_million_tokens(
            fleet_cost_per_hour, inputs.demand_tokens_per_s),
    )


def cost_per_million_tokens(cost_per_hour: float, tokens_per_s: float) -> float:
    return cost_per_hour / (tokens_per_s * SECONDS_PER_HOUR) * TOKENS_PER_MILLION


def kv_dtype_what_ifs(inputs: PlanInputs, memory: Memory) -> list[KvDtypeWhatIf]:
    """Every element size smaller than the current one: bytes per token scale with the bytes per
    value (8-bit formats: 1 byte plus their share of a row's scale)."""
    current = kv_element_bytes(inputs.kv_dtype, inputs.head_dim)
    what_ifs = []
    smaller = {KV_DTYPE_BYTES[d]: d for d in KV_DTYPE_BYTES if KV_DTYPE_BYTES[d] < KV_DTYPE_BYTES[inputs.kv_dtype]}
    for dtype_bytes in sorted(smaller, reverse=True):
        element = kv_element_bytes(smaller[dtype_bytes], inputs.head_dim)
        kv_bytes_per_token = max(1, round(memory.kv_bytes_per_token * element / current))
        contexts = [fit_context(memory.free_kv_bytes, kv_bytes_per_token, tokens)
                    for tokens, _ in inputs.contexts]
        what_ifs.append(KvDtypeWhatIf(KV_DTYPE_LABELS[dtype_bytes], kv_bytes_per_token,
                                      current / element, contexts))
    return what_ifs


def prefix_what_if(inputs: PlanInputs) -> PrefixWhatIf:
    """The seed's example: N prompts sharing one opening compute it once instead of N times."""
    without_cache = inputs.prefix_prompts * inputs.prefix_opening_tokens
    with_cache = inputs.prefix_opening_tokens
    share = inputs.prefix_share
    return PrefixWhatIf(inputs.prefix_prompts, inputs.prefix_opening_tokens, without_cache,
                        with_cache, without_cache - with_cache, share,
                        None if share is None else 1.0 - share)


def memory_warnings(contexts: list[ContextFit], mix: ContextFit | None,
                    streams_per_gpu: int) -> list[str]:
    """Where memory, not the throughput figure, caps the group size."""
    fits = contexts + ([mix] if mix else [])
    none_fit = [_context_label(fit, mix) for fit in fits if fit.conversations_per_gpu == 0]
    capped = [f"{_context_label(fit, mix)} ({fit.conversations_per_gpu})" for fit in fits
              if 0 < fit.conversations_per_gpu < streams_per_gpu]
    warnings = []
    if none_fit:
        warnings.append(f"not one conversation fits in the free KV memory at "
                        f"{', '.join(none_fit)}")
    if capped:
        warnings.append(f"memory holds fewer conversations than the {streams_per_gpu} streams "
                        f"behind the per-accelerator rate at {', '.join(capped)}: there memory "
                        f"caps the group and that rate is optimistic")
    return warnings


def _context_label(fit: ContextFit, mix: ContextFit | None) -> str:
    prefix = "the mix average of " if fit is mix else ""
    return f"{prefix}{fit.context_tokens:,.0f} tokens"
