"""Paged attention over the KV block pool, plugged into transformers through AttentionInterface.

The model runs one flattened forward per step: all scheduled tokens of all sequences side by side
in a batch of 1 (`input_ids` [1, T]). Each layer's attention call
  1. writes the step's new K/V into the pool at their slots, then
  2. attends, for every sequence, over that sequence's blocks:
     - decoding sequences (1 query each), on CPUs where the C++ kernel builds, in one call that
       reads K/V in place through the block tables (cpu_attention.py); elsewhere in a few batched
       SDPA calls, one per group of similar
       context lengths: the group's blocks are gathered in one index_select to
       [2, kv_heads, B, L, D] (L = longest context of the group, padding masked out) and the
       query heads are packed per KV head, so SDPA sees batch = kv_heads, heads = B,
       queries = n_rep and no K/V is repeated for GQA;
     - prefill chunks one sequence at a time, causal with an offset against the cached prefix
       (a chunk at position 0 attends to its own fresh K/V with no gather). A chunk after a
       cached prefix needs a mask; its query heads are packed per KV head (queries = n_rep x n)
       and the mask repeated to match, so SDPA never gets a mask together with GQA (on CUDA
       that pair falls back to the math kernel, which materialises every score).
The pool stores K/V in its format (`--kv-dtype`): writes convert or quantise, and gathers
dequantise into the query's dtype, so attention itself always runs in the model's dtype.
Everything that depends only on the step (slots, gather indices, masks) is built once in
`AttentionContext` and reused by every layer; it reaches this function through the forward's
keyword arguments, never through a global.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from worker.engine.cpu_attention import (CpuDecodePlan, CpuPrefillPlan, paged_decode,
                                         paged_prefill, write_kv)
from worker.engine.kv_cache import KVCachePool
from worker.engine.triton_attention import PagedAttentionPlan, paged_attention

ATTENTION_NAME = "kvfleet_paged"
CONTEXT_KWARG = "kvfleet_attention"


@dataclass
class DecodeGroup:
    """Decoding sequences whose queries sit at flattened positions [q_start, q_start + num_seqs)."""

    q_start: int
    num_seqs: int
    context_len: int  # L: a whole number of blocks >= the longest context in the group
    gather_index: torch.Tensor  # [2 * KVH * B * L / bs]: rows of the pool's block view
    mask: torch.Tensor  # [1, B, 1, L] additive, the model's dtype: 0 where a key takes part, else -inf


@dataclass
class PrefillChunk:
    """One sequence's prefill chunk: queries at flattened positions [q_start, q_end)."""

    q_start: int
    q_end: int
    context_len: int  # keys are the sequence's positions [0, context_len), context_len = start + n
    gather_index: torch.Tensor | None  # [2 * KVH * num_blocks]; None when the chunk starts at 0
    # [n_rep * n, context_len] additive (0 / -inf, the model's dtype) causal with offset, the
    # [n, context_len] mask once per query head of a KV head's group (row r * n + i is query i);
    # None when start == 0
    mask: torch.Tensor | None


@dataclass
class AttentionContext:
    """Per-step attention metadata, shared read-only by every layer of one forward."""

    pool: KVCachePool
    write_index: torch.Tensor  # [KVH * T]: row (h * num_slots + slot) of each new token's K or V
    decode_groups: list[DecodeGroup] = field(default_factory=list)
    prefills: list[PrefillChunk] = field(default_factory=list)
    # set on accelerators: one Triton launch covers every query of the step (triton_attention.py)
    kernel_plan: PagedAttentionPlan | None = None
    # set on CPUs with the C++ kernel: it takes every decode row in place of decode_groups
    cpu_decode: CpuDecodePlan | None = None
    # set where the C++ prefill kernel runs (AVX-512; bf16 with AVX512-BF16): every prefill
    # chunk in one call, in place of `prefills`
    cpu_prefill: CpuPrefillPlan | None = None
    # the step runs on the C++ kernel's pool (plain K/V in the model's dtype): fused layers write
    # their K/V into it directly; a model fused by an earlier engine may run under another
    cpu_kernel: bool = False


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, H, T, D]
    key: torch.Tensor,  # [1, KVH, T, D]
    value: torch.Tensor,  # [1, KVH, T, D]
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Returns ([1, T, H, D], None), as transformers' attention functions do."""
    # `sliding_window` (Mistral, Qwen2) is ignored: the engine caps the context at the window.
    ctx: AttentionContext = kwargs[CONTEXT_KWARG]
    pool, layer = ctx.pool, module.layer_idx
    num_tokens, head_dim = query.shape[2], query.shape[3]
    # the pool converts (or quantises) the new K/V to its storage format
    pool.write(layer, ctx.write_index, key[0].reshape(-1, head_dim), value[0].reshape(-1, head_dim))

    out = query.new_empty(num_tokens, query.shape[1], head_dim)  # [T, H, D]
    if ctx.kernel_plan is not None:
        paged_attention(query[0], pool, layer, ctx.kernel_plan, scaling, out)
        return out.unsqueeze(0), None
    if ctx.cpu_decode is not None:
        scale = scaling if scaling is not None else head_dim ** -0.5
        paged_decode(query[0], pool, layer, ctx.cpu_decode, scale, out)
    if ctx.cpu_prefill is not None:
        scale = scaling if scaling is not None else head_dim ** -0.5
        paged_prefill(query[0], pool, layer, ctx.cpu_prefill, scale, out)
    for group in ctx.decode_groups:
        _decode_attention(group, query, pool, layer, scaling, out)
    for chunk in ctx.prefills:
        _prefill_attention(chunk, query, key, value, pool, layer, scaling, out)
    return out.unsqueeze(0), None


def fused_layer_attention(layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          ctx: AttentionContext, scaling: float) -> torch.Tensor:
    """What paged_attention_forward computes, for a fused CPU layer (cpu_layers.py) whose q, k, v
    ([T, H, D], [T, KVH, D] x 2) are views into its q/k/v product: the new K/V go into the pool
    in one C++ copy, the decodes through the C++ kernel, prefill chunks through the C++ prefill
    kernel where it runs, else SDPA. -> [T, H, D]"""
    if not ctx.cpu_kernel:  # another pool format or backend: the generic path
        out, _ = paged_attention_forward(
            SimpleNamespace(layer_idx=layer), *(x.transpose(0, 1).unsqueeze(0) for x in (query, key, value)),
            None, scaling=scaling, **{CONTEXT_KWARG: ctx})
        return out[0]
    pool = ctx.pool
    write_kv(pool, layer, key, value, ctx.write_index)
    out = query.new_empty(query.shape)
    if ctx.cpu_decode is not None:
        paged_decode(query.transpose(0, 1), pool, layer, ctx.cpu_decode, scaling, out)
    if ctx.cpu_prefill is not None:
        paged_prefill(query.transpose(0, 1), pool, layer, ctx.cpu_prefill, scaling, out)
    if ctx.prefills:
        q4, k4, v4 = (x.transpose(0, 1).unsqueeze(0) for x in (query, key, value))  # [1, heads, T, D]
        for chunk in ctx.prefills:
            _prefill_attention(chunk, q4, k4, v4, pool, layer, scaling, out)
    return out


def _decode_attention(group: DecodeGroup, query, pool: KVCachePool, layer: int, scaling, out) -> None:
    num_seqs, length = group.num_seqs, group.context_len
    _, num_heads, _, head_dim = query.shape
    num_kv_heads = pool.layout.num_kv_heads
    end = group.q_start + num_seqs
    # [H, B, D] -> [KVH, n_rep, B, D] -> [KVH, B, n_rep, D]: head h reads KV head h // n_rep
    q = query[0, :, group.q_start:end].view(num_kv_heads, -1, num_seqs, head_dim).transpose(1, 2)
    kv = pool.gather(layer, group.gather_index, query.dtype).view(
        2, num_kv_heads, num_seqs, length, head_dim)
    o = _cached_attention(pool, q, kv[0], kv[1], group.mask, scaling)
    # [KVH, B, n_rep, D] -> [B, KVH, n_rep, D] -> [B, H, D]
    out[group.q_start:end] = o.transpose(0, 1).reshape(num_seqs, num_heads, head_dim)


def _prefill_attention(chunk: PrefillChunk, query, key, value, pool: KVCachePool, layer: int,
                       scaling, out) -> None:
    q = query[:, :, chunk.q_start:chunk.q_end]  # [1, H, n, D]
    if chunk.gather_index is None:  # nothing cached before the chunk: its own K/V suffice
        k = key[:, :, chunk.q_start:chunk.q_end]  # [1, KVH, n, D]
        v = value[:, :, chunk.q_start:chunk.q_end]
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling, enable_gqa=True)
    else:
        _, num_heads, num_queries, head_dim = q.shape
        num_kv_heads = pool.layout.num_kv_heads
        kv = pool.gather(layer, chunk.gather_index, query.dtype).view(
            2, num_kv_heads, -1, head_dim)
        k = kv[0, :, :chunk.context_len].unsqueeze(0)  # [1, KVH, ctx, D]
        v = kv[1, :, :chunk.context_len].unsqueeze(0)
        # [1, H, n, D] -> [1, KVH, n_rep * n, D]: head h reads KV head h // n_rep (as the mask)
        packed = q.reshape(1, num_kv_heads, -1, head_dim)
        o = _cached_attention(pool, packed, k, v, chunk.mask, scaling)
        o = o.view(1, num_heads, num_queries, head_dim)
    out[chunk.q_start:chunk.q_end] = o[0].transpose(0, 1)  # [n, H, D]


def _cached_attention(pool: KVCachePool, q, k, v, mask, scaling):
    """SDPA over K/V read from the pool, q's heads already packed per KV head (no GQA). When the
    pool stores rows rotated by R (int8), q.k = (qR).(kR) and p.V = (p.VR)R^T: rotate q,
    un-rotate the output, never the cache."""
    rotation = pool.rotation(q.dtype)
    if rotation is not None:
        q = q @ rotation
    if mask.dtype != q.dtype:  # a model whose attention runs in another dtype than its weights
        mask = mask.to(q.dtype)
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling)
    return o if rotation is None else o @ rotation.T


def register_paged_attention() -> str:
    """Make the function available to transformers under ATTENTION_NAME (idempotent)."""
    AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
    return ATTENTION_NAME
