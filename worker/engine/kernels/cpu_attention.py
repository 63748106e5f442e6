"""Paged attention on the CPU through small C++ kernels: `cpu_attention.cpp` for decodes,
`cpu_prefill.cpp` for prefill chunks (built and bound by cpu_kernels.py, each on its own).

Every decoding sequence's query (all query heads of a KV head together) attends over its K/V read
in place from the pool's blocks through its block table, with fp32 accumulation and an exact
softmax. Against the SDPA path it saves the dense copy of every group's K/V (`index_select`), the
padding of length groups and their masks. Where the compiler targets AVX512-BF16 (`-march=native`
on such a CPU), bf16 K/V take a path of pair dot products (vdpbf16ps) with the keys' sums reduced
16 at a time, instead of one horizontal sum per key and query head; float32 K/V, where it has AVX2
and FMA, one of 8 keys at a time (8 FMA chains in flight, their sums reduced 8 at a time). Without a compiler the worker
keeps gather + SDPA (`resolve_attention_backend` says why at start-up).

Prefill chunks take the prefill kernel on CPUs with AVX-512 (bf16 with AVX512-BF16): each
chunk attends causally over its keys in place, its 16-token query tiles against 8 keys at a time
(bf16 in pair dot products). SDPA's CPU flash kernel needs a dense copy of a cached prefix and a
mask, and where MKL has no bf16 instructions to use (AMD's AVX512-BF16, no AMX) its bf16 products
run as fp32 sgemm on converted copies. CPUs without AVX-512, or where the prefill kernel does not
build, keep SDPA.

Batch-invariant steps (`--deterministic`) compute every query row, a decode's or a prompt's, in
one form whose result for a row depends on that row alone: on CPUs with AMX-BF16 tiles, bf16,
the tile kernel of cpu_amx.cpp (`amx_attention`: scores and P.V as TDPBF16PS sums, whole
prompts' 16-row tiles at once); with AVX512-BF16, bf16, decodes in the decode kernel and prefill
chunks in the prefill kernel's row form (`paged_prefill(..., rows=True)`), which sums every
row in the decode kernel's order, so its rows equal the decode kernel's bit for bit while 16 of
them share each key read; elsewhere the decode kernel row by row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvfleet.worker.engine.kernels import cpu_kernels
from kvfleet.worker.engine.kernels.cpu_kernels import (amx_kernel, decode_kernel, layer_ops_kernel,
                                                      prefill_kernel)
from kvfleet.worker.engine.kernels.kernel_build import KernelUnavailable
from kvfleet.worker.engine.memory.device import is_cpu
from kvfleet.worker.engine.memory.kv_cache import KVCachePool
from kvfleet.worker.engine.kernels.torch_private import named_while_profiling

__all__ = ["DTYPE_CODES", "CpuDecodePlan", "CpuPrefillPlan", "KernelUnavailable", "amx_attention",
           "amx_attention_supported", "paged_decode", "paged_prefill", "prefill_rows_supported",
           "prefill_supported", "supports", "unavailable_reason", "write_kv"]

DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}  # the kernels' `dtype` argument

# K/V elements a step's decode rows read per layer (keys x KV heads x head_dim) below which the
# decode kernel runs on the calling thread alone. Each (row, KV head) pair is computed by one
# thread whatever the count, so the result is the same; at these sizes (a few tens of
# microseconds of reading) waking the other threads and waiting for them at the region's end
# costs more than the work, most of all where another process holds their cores.
SERIAL_DECODE_ELEMENTS = 1 << 18


@dataclass
class CpuDecodePlan:
    """The decoding sequences of a step, rows [0, num_seqs) of the flattened queries."""

    num_seqs: int
    block_tables: torch.Tensor  # [num_seqs, width] int32: the pages of each sequence's keys
    ctx_lens: torch.Tensor  # [num_seqs] int32: keys [0, ctx_len) including the step's token
    num_keys: int = -1  # the sum of ctx_lens (-1: not counted: the kernel runs on every thread)

    def threads(self, num_kv_heads: int, head_dim: int) -> int:
        """The decode kernel's thread count for this plan: 1 where its keys are few
        (SERIAL_DECODE_ELEMENTS), else torch's."""
        if 0 <= self.num_keys * num_kv_heads * head_dim < SERIAL_DECODE_ELEMENTS:
            return 1
        return torch.get_num_threads()


@dataclass
class CpuPrefillPlan:
    """The prefill chunks of a step, for the prefill kernel (cpu_prefill.cpp)."""

    block_tables: torch.Tensor  # [num_chunks, width] int32: the pages of each chunk's keys
    q_starts: torch.Tensor  # [num_chunks] int32: the chunk's first row of the flattened queries
    q_lens: torch.Tensor  # [num_chunks] int32: its query tokens
    ctx_ends: torch.Tensor  # [num_chunks] int32: keys [0, ctx_end); queries at the last q_len


def unavailable_reason() -> str | None:
    """None when the decode kernel builds and loads here, else why not."""
    return cpu_kernels.unavailable_reason("decode")


def supports(pool: KVCachePool, dtype: torch.dtype) -> bool:
    """The kernel reads plain float K/V in the model's own dtype (float32 or bfloat16); 8-bit
    formats and a K/V dtype other than the model's keep gather + SDPA."""
    fmt = pool.kv_format
    return (is_cpu(pool.device) and dtype in DTYPE_CODES and not fmt.is_quantized
            and fmt.storage == dtype and pool.rotation(dtype) is None)


def prefill_supported(pool: KVCachePool, dtype: torch.dtype, head_dim: int) -> bool:
    """The prefill kernel computes this pool's chunks here: K/V the decode kernel reads
    (`supports`), head_dim 64 or 128, a build for AVX-512 (float32) or AVX512-BF16 (bf16).
    Elsewhere prefill chunks keep SDPA."""
    if not supports(pool, dtype):
        return False
    try:
        prefill = prefill_kernel()
        return bool(prefill.kvfleet_prefill_supported(DTYPE_CODES[dtype], head_dim))
    except KernelUnavailable:
        return False


def prefill_rows_supported(pool: KVCachePool, dtype: torch.dtype, head_dim: int) -> bool:
    """The prefill kernel's row form (rows equal to the decode kernel's) runs here for this pool's
    format: bf16 K/V the decode kernel reads (`supports`), head_dim 64 or 128, a build for
    AVX512-BF16. It also needs pages of an even number of keys (the decode kernel pairs keys for
    P.V within a page): the backend checks each step's (cpu_backend.py)."""
    if dtype != torch.bfloat16 or not supports(pool, dtype):
        return False
    try:
        return bool(prefill_kernel().kvfleet_prefill_rows_supported(head_dim))
    except KernelUnavailable:
        return False


def amx_attention_supported(pool: KVCachePool, dtype: torch.dtype, head_dim: int) -> bool:
    """The tile kernel computes this pool's rows here: bf16 K/V the decode kernel reads
    (`supports`), head_dim 32, 64, 96 or 128, and AMX tiles this process may use."""
    if dtype != torch.bfloat16 or head_dim not in (32, 64, 96, 128) or not supports(pool, dtype):
        return False
    try:  # 1: the CPU has the tiles and Linux granted their state (cpu_amx.h; 3: bf16 on tiles)
        return int(amx_kernel().kvfleet_amx_supported(3)) == 1
    except KernelUnavailable:
        return False


def amx_attention(query: torch.Tensor, pool: KVCachePool, layer: int, plan: CpuPrefillPlan,
                  scaling: float, out: torch.Tensor, kernel=None) -> None:
    """Causal attention of every chunk of `plan` (a decode: a chunk of one row) on AMX tiles:
    query [H, T, D] (last dim contiguous), out [T, H, D] contiguous; each row's result is the
    same whatever rows share the step (cpu_amx.cpp, "Attention on tiles"). `kernel`: another
    build of cpu_amx.cpp (the tests' emulation)."""
    if query.stride(-1) != 1:
        query = query.contiguous()
    num_heads, _, head_dim = query.shape
    kv = pool.layer(layer)  # [2, KVH, NB, bs, D], contiguous
    with named_while_profiling("attention (amx tiles)"):
        status = (kernel or amx_kernel()).kvfleet_amx_attention(
            query.data_ptr(), query.stride(0), query.stride(1), kv.data_ptr(), out.data_ptr(),
            plan.block_tables.data_ptr(), plan.block_tables.shape[1], plan.q_starts.data_ptr(),
            plan.q_lens.data_ptr(), plan.ctx_ends.data_ptr(), plan.q_starts.shape[0], num_heads,
            pool.layout.num_kv_heads, head_dim, pool.num_blocks, pool.block_size, scaling,
            torch.get_num_threads())
    if status != 0:
        raise RuntimeError(f"kvfleet_amx_attention failed with status {status}")


def paged_decode(query: torch.Tensor, pool: KVCachePool, layer: int, plan: CpuDecodePlan,
                 scaling: float, out: torch.Tensor) -> None:
    """Attention of the step's decode rows: query [H, T, D] (rows [0, num_seqs) are the
    decodes), written to out[:num_seqs] ([T, H, D], contiguous)."""
    if query.stride(-1) != 1:
        query = query.contiguous()
    num_heads, _, head_dim = query.shape
    num_kv_heads = pool.layout.num_kv_heads
    kv = pool.layer(layer)  # [2, KVH, NB, bs, D], contiguous
    with named_while_profiling("attention (cpu kernel)"):
        status = decode_kernel().kvfleet_paged_decode(
            DTYPE_CODES[query.dtype], query.data_ptr(), query.stride(0), query.stride(1),
            kv.data_ptr(), out.data_ptr(), plan.block_tables.data_ptr(), plan.block_tables.shape[1],
            plan.ctx_lens.data_ptr(), plan.num_seqs, num_heads, num_kv_heads,
            head_dim, pool.num_blocks, pool.block_size, scaling,
            plan.threads(num_kv_heads, head_dim))
    if status != 0:
        raise RuntimeError(f"kvfleet_paged_decode failed with status {status}")


def paged_prefill(query: torch.Tensor, pool: KVCachePool, layer: int, plan: CpuPrefillPlan,
                  scaling: float, out: torch.Tensor, rows: bool = False) -> None:
    """Causal attention of the step's prefill chunks over their keys in the pool (their own K/V
    already written): query [H, T, D] (last dim contiguous), out [T, H, D] contiguous; rows
    outside the chunks are left as they are. `rows`: the row form (`prefill_rows_supported`),
    every row equal to the decode kernel's for it."""
    if query.stride(-1) != 1:
        query = query.contiguous()
    num_heads, _, head_dim = query.shape
    kv = pool.layer(layer)  # [2, KVH, NB, bs, D], contiguous
    tables, width, num_chunks = plan.block_tables.data_ptr(), plan.block_tables.shape[1], \
        plan.q_starts.shape[0]
    if rows:
        with named_while_profiling("attention (cpu prefill kernel, row form)"):
            status = prefill_kernel().kvfleet_paged_prefill_rows(
                query.data_ptr(), query.stride(0), query.stride(1), kv.data_ptr(), out.data_ptr(),
                tables, width, plan.q_starts.data_ptr(), plan.q_lens.data_ptr(),
                plan.ctx_ends.data_ptr(), num_chunks, num_heads, pool.layout.num_kv_heads,
                head_dim, pool.num_blocks, pool.block_size, scaling, torch.get_num_threads())
    else:
        with named_while_profiling("attention (cpu prefill kernel)"):
            status = prefill_kernel().kvfleet_paged_prefill(
                DTYPE_CODES[query.dtype], query.data_ptr(), query.stride(0), query.stride(1),
                kv.data_ptr(), out.data_ptr(), tables, width, plan.q_starts.data_ptr(),
                plan.q_lens.data_ptr(), plan.ctx_ends.data_ptr(), num_chunks, num_heads,
                pool.layout.num_kv_heads, head_dim, pool.num_blocks, pool.block_size, scaling,
                torch.get_num_threads())
    if status != 0:
        raise RuntimeError(f"kvfleet_paged_prefill{'_rows' if rows else ''} failed with status "
                           f"{status}")


def write_kv(pool: KVCachePool, layer: int, key: torch.Tensor, value: torch.Tensor,
             rows: torch.Tensor) -> None:
    """The step's K and V ([T, KVH, D] views of one buffer, same strides, last two dims dense)
    into the pool at `rows` ([KVH * T] int64: h * slots + slot, AttentionMetadata.write_index),
    copied by the kernel library: no intermediate copy, no index_copy_."""
    assert key.stride() == value.stride() and key.stride(2) == 1 and key.stride(1) == key.shape[2]
    assert key.dtype == pool.kv_format.storage and rows.dtype == torch.int64 and rows.is_contiguous()
    kv = pool.layer(layer)  # [2, KVH, NB, bs, D]
    status = layer_ops_kernel().kvfleet_write_kv(
        DTYPE_CODES[key.dtype], key.data_ptr(), value.data_ptr(), key.stride(0), key.shape[0],
        key.shape[1], key.shape[2], rows.data_ptr(), kv.shape[1] * kv.shape[2] * kv.shape[3],
        kv.data_ptr())
    if status != 0:
        raise RuntimeError(f"kvfleet_write_kv failed with status {status}")
