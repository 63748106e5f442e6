"""One attention step over a random paged cache, run through the gather + SDPA path and through
a paged kernel, for the kernels' tests: Triton's (interpreter on CPU, compiled on CUDA) and the
CPU's C++ decode kernel."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kvfleet.shared.wire import SamplingParams
from kvfleet.worker.engine.attention import (CONTEXT_KWARG, paged_attention_forward,
                                     resolve_attention_backend)
from kvfleet.worker.engine.attention.backend import AttentionBackend
from kvfleet.worker.engine.memory.kv_cache import KVCachePool, KVLayout
from kvfleet.worker.engine.memory.kv_format import resolve_kv_format
from kvfleet.worker.engine.core.model_runner import ModelRunner, plan_step
from kvfleet.worker.engine.core.scheduler import ScheduledChunk, SchedulerOutput
from kvfleet.worker.engine.core.sequence import Sequence

NUM_KV_HEADS = 2


@dataclass
class ChunkSpec:
    start: int  # tokens already in the cache before this step
    num_tokens: int  # queries of this step (1: a decode)


@dataclass
class PagedCase:
    kv_dtype: str  # pool format
    group: int  # query heads per KV head
    head_dim: int
    chunks: list[ChunkSpec]
    block_size: int = 8
    model_dtype: torch.dtype = torch.float32
    seed: int = 0


class _Layer(torch.nn.Module):
    layer_idx = 0


def run_case(case: PagedCase, device: torch.device,
             backend: str | AttentionBackend = "triton") -> tuple[torch.Tensor, torch.Tensor]:
    """(gather + SDPA output, `backend`'s output), each [T, H, D] in the model dtype; `backend`:
    a name to resolve, or a backend built by the test."""
    torch.manual_seed(case.seed)
    rng = random.Random(case.seed)
    num_heads = NUM_KV_HEADS * case.group
    kv_format = resolve_kv_format(case.kv_dtype, case.model_dtype)
    bs = case.block_size
    blocks_needed = [-(-(c.start + c.num_tokens) // bs) for c in case.chunks]
    num_blocks = sum(blocks_needed) + 3
    pool = KVCachePool(KVLayout(1, NUM_KV_HEADS, case.head_dim, kv_format), num_blocks, bs, device)
    # every slot holds some cached K/V first: the prefixes the chunks attend to
    rows = torch.arange(NUM_KV_HEADS * num_blocks * bs, device=device)
    pool.write(0, rows, torch.randn(len(rows), case.head_dim, device=device),
               torch.randn(len(rows), case.head_dim, device=device))

    free = list(range(num_blocks))
    rng.shuffle(free)  # random, non-contiguous block tables
    chunks = []
    for i, (spec, need) in enumerate(zip(case.chunks, blocks_needed)):
        table, free = free[:need], free[need:]
        tokens = [rng.randrange(3, 100) for _ in range(spec.start + spec.num_tokens)]
        seq = Sequence(f"r{i}", tokens, SamplingParams(max_tokens=1))
        chunks.append(ScheduledChunk(seq, spec.start, spec.num_tokens, table, emits_token=True))
    sched = SchedulerOutput(chunks=chunks)

    model = LlamaForCausalLM(LlamaConfig(
        hidden_size=num_heads * case.head_dim, head_dim=case.head_dim, intermediate_size=16,
        num_hidden_layers=1, num_attention_heads=num_heads, num_key_value_heads=NUM_KV_HEADS,
        vocab_size=128))
    total = sum(c.num_tokens for c in case.chunks)
    dtype = case.model_dtype
    model.to(dtype)  # the runner builds the SDPA masks in the model's dtype
    # [1, H, T, D] as transformers hands it over: a transposed view of [1, T, H, D]
    query = torch.randn(1, total, num_heads, case.head_dim, device=device).to(dtype).transpose(1, 2)
    # K/V already as the pool will hold them: the SDPA path attends a chunk that starts at 0 to
    # its fresh K/V, the kernel to what the pool stored; this way both see the same values
    key = as_stored(pool, torch.randn(1, NUM_KV_HEADS, total, case.head_dim, device=device), dtype)
    value = as_stored(pool, torch.randn(1, NUM_KV_HEADS, total, case.head_dim, device=device), dtype)
    outputs = []
    for name in ("sdpa", backend):
        resolved = name if isinstance(name, AttentionBackend) else resolve_attention_backend(
            name, device, dtype, kv_format, case.head_dim)
        # the runner builds the metadata on the pool's device, wherever the model is
        runner = ModelRunner(model, pool, attention_backend=resolved)
        context = runner.prepare(plan_step(sched, pool.block_size)[0]).context
        # writing the step's K/V again stores the same codes, so both runs see one cache
        out, _ = paged_attention_forward(_Layer(), query, key, value, None,
                                         scaling=case.head_dim ** -0.5, **{CONTEXT_KWARG: context})
        outputs.append(out[0])
    return outputs[0], outputs[1]


def as_stored(pool: KVCachePool, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x rounded to what the pool's format stores, back in the model's dtype (and unrotated)."""
    rotation = pool.rotation(torch.float32)
    rows = x.to(dtype).float().reshape(-1, x.shape[-1])
    rows = rows if rotation is None else rows @ rotation
    codes, scales = pool.kv_format.quantize(rows)
    rows = pool.kv_format.dequantize(codes, scales, torch.float32)
    rows = rows if rotation is None else rows @ rotation.T
    return rows.reshape(x.shape).to(dtype)


# Few launches (each takes ~1 s in the interpreter) that still cover every format, GQA group
# sizes 1/3/4/8, head dims 64/128, ragged contexts, decodes, prefill chunks after a cached prefix
# and from position 0, in mixed and decode-only steps.
MIXED = [ChunkSpec(0, 1), ChunkSpec(8, 1), ChunkSpec(22, 1), ChunkSpec(70, 1),
         ChunkSpec(37, 11), ChunkSpec(0, 13)]
DECODES = [ChunkSpec(5, 1), ChunkSpec(63, 1), ChunkSpec(64, 1), ChunkSpec(100, 1)]
CASES = {
    "fp32-g1-d64-mixed": PagedCase("fp32", 1, 64, MIXED),
    "bf16-g3-d128-mixed": PagedCase("bf16", 3, 128, MIXED, model_dtype=torch.bfloat16, seed=1),
    "fp16-g4-d64-decode": PagedCase("fp16", 4, 64, DECODES, block_size=16,
                                    model_dtype=torch.float16, seed=2),
    "fp8-g8-d128-mixed": PagedCase("fp8", 8, 128, MIXED, seed=3),
    "fp8-g3-d64-decode": PagedCase("fp8", 3, 64, DECODES, block_size=4, seed=4),
    "int8-g4-d128-decode": PagedCase("int8", 4, 128, DECODES, seed=5),
    "int8-g1-d64-mixed": PagedCase("int8", 1, 64, MIXED, block_size=16, seed=6),
    "bf16kv-fp32model-g8-d64-mixed": PagedCase("bf16", 8, 64, MIXED, seed=7),
}
