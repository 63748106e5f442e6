"""Gather + SDPA: attention over K/V copied out of the pool, on any device and pool format.

- Decoding sequences (1 query each) in a few batched SDPA calls, one per group of similar context
  lengths: the group's blocks are gathered in one index_select to [2, kv_heads, B, L, D]
  (L = longest context of the group, padding masked out) and the query heads are packed per KV
  head, so SDPA sees batch = kv_heads, heads = B, queries = n_rep and no K/V is repeated for GQA.
- Prefill chunks one sequence at a time, causal with an offset against the cached prefix (a chunk
  at position 0 attends to its own fresh K/V with no gather). A chunk after a cached prefix needs
  a mask; its query heads are packed per KV head (queries = n_rep x n) and the mask repeated to
  match, so SDPA never gets a mask together with GQA (on CUDA that pair falls back to the math
  kernel, which materialises every score).
Gather indices and masks are built once a step and reused by every layer. The CPU backend
(cpu_backend.py) takes its prefill chunks from here where its prefill kernel does not run.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kvfleet.worker.engine.attention.backend import AttentionBackend, AttentionMetadata, StepGeometry
from kvfleet.worker.engine.memory.kv_cache import KVCachePool

# a decode group costs about as much as gathering this many padded tokens (call overhead)
DECODE_GROUP_COST_TOKENS = 512


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
class SdpaMetadata(AttentionMetadata):
    decode_groups: list[DecodeGroup] = field(default_factory=list)
    prefills: list[PrefillChunk] = field(default_factory=list)


class SdpaBackend(AttentionBackend):
    """Gather + SDPA. `name` is "cpu" where the CPU kernel was asked for but cannot read the
    pool's format (`note` says why, for the start-up report)."""

    def __init__(self, name: str = "sdpa", note: str | None = None,
                 decode_group_cost_tokens: int = DECODE_GROUP_COST_TOKENS):
        self.name = name
        self.note = note
        self.decode_group_cost_tokens = decode_group_cost_tokens

    def describe(self) -> str:
        return self.name if self.note is None else f"{self.name} ({self.note})"

    def build_metadata(self, geometry: StepGeometry, write_index: torch.Tensor,
                       decodes: list, prefills: list) -> SdpaMetadata:
        return SdpaMetadata(
            self, geometry.pool, write_index,
            decode_groups=decode_groups(geometry, decodes, self.decode_group_cost_tokens),
            prefills=prefill_chunks(geometry, prefills, q_start=len(decodes)))

    def forward(self, layer, query, key, value, metadata: SdpaMetadata, scaling, out) -> None:
        pool = metadata.pool
        head_dim = query.shape[3]
        # the pool converts (or quantises) the new K/V to its storage format
        pool.write(layer, metadata.write_index, key[0].reshape(-1, head_dim),
                   value[0].reshape(-1, head_dim))
        for group in metadata.decode_groups:
            decode_attention(group, query, pool, layer, scaling, out)
        for chunk in metadata.prefills:
            prefill_attention(chunk, query, key, value, pool, layer, scaling, out)


def decode_groups(geometry: StepGeometry, decodes: list,
                  group_cost_tokens: int) -> list[DecodeGroup]:
    """Split the decodes (sorted by length) where that saves more padding than a call costs."""
    bs = geometry.block_size
    num_blocks = [-(-c.end // bs) for c in decodes]
    groups, q_start = [], 0
    for first, last in split_sorted(num_blocks, group_cost_tokens // bs):
        members = decodes[first:last + 1]
        width = num_blocks[last]  # blocks per sequence after padding
        blocks: list[int] = []
        for chunk, used in zip(members, num_blocks[first:last + 1]):
            blocks.extend(chunk.block_table[:used])
            blocks.extend([chunk.block_table[0]] * (width - used))  # padding, masked out
        length = width * bs
        lengths = torch.tensor([c.end for c in members], dtype=torch.int64)
        mask = torch.arange(length).unsqueeze(0) < lengths.unsqueeze(1)  # [B, L]
        groups.append(DecodeGroup(
            q_start=q_start, num_seqs=len(members), context_len=length,
            gather_index=gather_index(geometry, blocks),
            mask=additive(geometry, mask.view(1, len(members), 1, length))))
        q_start += len(members)
    return groups


def prefill_chunks(geometry: StepGeometry, prefills: list, q_start: int) -> list[PrefillChunk]:
    """Every prefill chunk's queries, keys, gather index and causal mask with its offset."""
    bs = geometry.block_size
    result = []
    for chunk in prefills:
        q_end = q_start + chunk.num_tokens
        if chunk.start == 0:
            result.append(PrefillChunk(q_start, q_end, chunk.end, None, None))
        else:
            query_pos = torch.arange(chunk.start, chunk.end).unsqueeze(1)  # [n, 1]
            mask = torch.arange(chunk.end).unsqueeze(0) <= query_pos  # [n, ctx]
            mask = mask.repeat(geometry.group_size, 1)  # [n_rep * n, ctx]: per packed head
            blocks = chunk.block_table[:-(-chunk.end // bs)]
            result.append(PrefillChunk(q_start, q_end, chunk.end, gather_index(geometry, blocks),
                                       additive(geometry, mask)))
        q_start = q_end
    return result


def additive(geometry: StepGeometry, keep: torch.Tensor) -> torch.Tensor:
    """A bool mask (True where a key takes part) as SDPA's additive mask in the model's dtype:
    0 or -inf. SDPA converts a bool mask to exactly this on every call; built once a step,
    every layer reuses it."""
    mask = torch.zeros(keep.shape, dtype=geometry.dtype).masked_fill_(~keep, float("-inf"))
    return mask.to(geometry.device, non_blocking=True)


def gather_index(geometry: StepGeometry, blocks: list[int]) -> torch.Tensor:
    """Rows of K then V of every KV head for `blocks`: [2 * KVH * len(blocks)]."""
    rows = geometry.head_block_rows + torch.tensor(blocks, dtype=torch.int64)
    return rows.view(-1).to(geometry.device, non_blocking=True)


def split_sorted(sizes: list[int], group_cost: int) -> list[tuple[int, int]]:
    """Split ascending `sizes` into runs [first, last] minimising padded total + cost per run.

    A run is padded to its last (largest) size: cost(run) = sizes[last] * len(run) + group_cost.
    O(n^2) dynamic programme; n is at most the running group.
    """
    n = len(sizes)
    if n == 0:
        return []
    best = [0] + [None] * n  # best[i]: cheapest split of sizes[:i]
    cut = [0] * (n + 1)
    for end in range(1, n + 1):
        for start in range(end):
            cost = best[start] + sizes[end - 1] * (end - start) + group_cost
            if best[end] is None or cost < best[end]:
                best[end], cut[end] = cost, start
    runs, end = [], n
    while end > 0:
        runs.append((cut[end], end - 1))
        end = cut[end]
    return runs[::-1]


def decode_attention(group: DecodeGroup, query, pool: KVCachePool, layer: int, scaling, out) -> None:
    num_seqs, length = group.num_seqs, group.context_len
    _, num_heads, _, head_dim = query.shape
    num_kv_heads = pool.layout.num_kv_heads
    end = group.q_start + num_seqs
    # [H, B, D] -> [KVH, n_rep, B, D] -> [KVH, B, n_rep, D]: head h reads KV head h // n_rep
    q = query[0, :, group.q_start:end].view(num_kv_heads, -1, num_seqs, head_dim).transpose(1, 2)
    kv = pool.gather(layer, group.gather_index, query.dtype).view(
        2, num_kv_heads, num_seqs, length, head_dim)
    o = cached_attention(pool, q, kv[0], kv[1], group.mask, scaling)
    # [KVH, B, n_rep, D] -> [B, KVH, n_rep, D] -> [B, H, D]
    out[group.q_start:end] = o.transpose(0, 1).reshape(num_seqs, num_heads, head_dim)


def prefill_attention(chunk: PrefillChunk, query, key, value, pool: KVCachePool, layer: int,
                      scaling, out) -> None:
    """One chunk's causal attention: query [1, H, T, D], key and value [1, KVH, T, D]."""
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
        o = cached_attention(pool, packed, k, v, chunk.mask, scaling)
        o = o.view(1, num_heads, num_queries, head_dim)
    out[chunk.q_start:chunk.q_end] = o[0].transpose(0, 1)  # [n, H, D]


def cached_attention(pool: KVCachePool, q, k, v, mask, scaling):
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
