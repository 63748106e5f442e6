"""The CPU's C++ kernels (cpu_attention.py): decodes read K/V in place through their block tables
in one call a layer; prefill chunks take the prefill kernel where it runs here (AVX-512; bf16
with AVX512-BF16; head_dim 64 or 128), else gather + SDPA (sdpa_backend.py). The kernels read
plain K/V in the model's dtype: the registry picks this backend only for such a pool.

Batch-invariant (`--deterministic`, the default): every query row of the step, a decode's or a
prefill chunk's, is computed as one row of the decode kernel, over the keys its position sees.
A row's result is then one function of its query and its keys, whatever else the step computes,
however its prompt was chunked, whether its prefix came from the cache: the decode kernel sums
every row's scores, normaliser and P.V in one order fixed by its context length alone. The
prefill kernel's plain form sums in another order (one running sum per row), so it runs only
with `--no-deterministic`; its row form (bf16 on AVX512-BF16, pages of an even size) sums in
the decode kernel's order with 16 rows across a vector's lanes, its rows equal to the decode
kernel's bit for bit: the invariant steps' prefill chunks take it where it runs, else each of
their rows is a row of the decode kernel. AMX tiles (`amx_tiles`) are a third form, every row
on tiles."""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import accumulate

import torch

from kvfleet.worker.engine.attention.backend import AttentionBackend, AttentionMetadata, StepGeometry
from kvfleet.worker.engine.attention.sdpa_backend import PrefillChunk, prefill_attention, prefill_chunks
from kvfleet.worker.engine.kernels.cpu_attention import (CpuDecodePlan, CpuPrefillPlan, amx_attention,
                                         paged_decode, paged_prefill, write_kv)


@dataclass
class CpuMetadata(AttentionMetadata):
    decode: CpuDecodePlan | None = None  # every decode row; None in a step without decodes
    prefill: CpuPrefillPlan | None = None  # every prefill chunk, where the prefill kernel runs
    rows: bool = False  # `prefill` in the prefill kernel's row form (batch-invariant)
    prefills: list[PrefillChunk] = field(default_factory=list)  # else these, on SDPA
    tiles: CpuPrefillPlan | None = None  # every row, decodes and prefill chunks, on AMX tiles


class CpuBackend(AttentionBackend):
    name = "cpu"
    cpu_kernel = True

    def __init__(self, prefill_kernel: bool, row_invariant: bool = False, amx_tiles: bool = False,
                 prefill_rows: bool = False):
        # every query row through one form (batch-invariant): the AMX tile kernel where it runs
        # here (`amx_tiles`), else the decode kernel's, prefill chunks in the prefill kernel's
        # row form where it runs here (`prefill_rows`); not invariant, prefill chunks take the
        # prefill kernel where it runs here (no dense copy of cached prefixes, and SDPA's bf16
        # products run as converted fp32 sgemm on CPUs without AMX), else SDPA
        self.row_invariant = row_invariant
        self.amx_tiles = amx_tiles and row_invariant
        self.prefill_rows = prefill_rows and row_invariant and not self.amx_tiles
        self.prefill_kernel = prefill_kernel and not row_invariant

    def describe(self) -> str:
        if self.amx_tiles:
            return "cpu (every query row on AMX tiles: batch-invariant)"
        if self.prefill_rows:
            return ("cpu (every query row in the decode kernel's order, prefill chunks 16 rows at "
                    "a time: batch-invariant)")
        if self.row_invariant:
            return "cpu (every query row in the decode kernel: batch-invariant)"
        return ("cpu (decode and prefill kernels)" if self.prefill_kernel
                else "cpu (decode kernel; prefill chunks on SDPA)")

    def build_metadata(self, geometry: StepGeometry, write_index: torch.Tensor,
                       decodes: list, prefills: list) -> CpuMetadata:
        bs = geometry.block_size
        if self.amx_tiles:  # a decode is a chunk of one row, first in the flattened order
            return CpuMetadata(self, geometry.pool, write_index, tiles=prefill_plan(
                decodes + prefills, bs, q_start=0))
        if self.prefill_rows and bs % 2 == 0:
            return CpuMetadata(self, geometry.pool, write_index, decode=decode_plan(decodes, bs),
                               prefill=prefill_plan(prefills, bs, q_start=len(decodes)),
                               rows=True)
        if self.row_invariant:
            return CpuMetadata(self, geometry.pool, write_index,
                               decode=rows_plan(decodes, prefills, bs))
        metadata = CpuMetadata(self, geometry.pool, write_index, decode=decode_plan(decodes, bs))
        if self.prefill_kernel:
            metadata.prefill = prefill_plan(prefills, bs, q_start=len(decodes))
        else:
            metadata.prefills = prefill_chunks(geometry, prefills, q_start=len(decodes))
        return metadata

    def forward(self, layer, query, key, value, metadata: CpuMetadata, scaling, out) -> None:
        pool = metadata.pool
        head_dim = query.shape[3]
        pool.write(layer, metadata.write_index, key[0].reshape(-1, head_dim),
                   value[0].reshape(-1, head_dim))
        scale = scaling if scaling is not None else head_dim ** -0.5
        if metadata.tiles is not None:
            amx_attention(query[0], pool, layer, metadata.tiles, scale, out)
        if metadata.decode is not None:
            paged_decode(query[0], pool, layer, metadata.decode, scale, out)
        if metadata.prefill is not None:
            paged_prefill(query[0], pool, layer, metadata.prefill, scale, out, metadata.rows)
        for chunk in metadata.prefills:
            prefill_attention(chunk, query, key, value, pool, layer, scaling, out)

    def fused_forward(self, layer, query, key, value, metadata: CpuMetadata,
                      scaling) -> torch.Tensor:
        """The new K/V go into the pool in one C++ copy (no intermediate copy), the rows through
        the kernels. -> [T, H, D]"""
        pool = metadata.pool
        write_kv(pool, layer, key, value, metadata.write_index)
        out = query.new_empty(query.shape)
        if metadata.tiles is not None:
            amx_attention(query.transpose(0, 1), pool, layer, metadata.tiles, scaling, out)
        if metadata.decode is not None:
            paged_decode(query.transpose(0, 1), pool, layer, metadata.decode, scaling, out)
        if metadata.prefill is not None:
            paged_prefill(query.transpose(0, 1), pool, layer, metadata.prefill, scaling, out,
                          metadata.rows)
        if metadata.prefills:
            # [1, heads, T, D], as transformers hands them over
            q4, k4, v4 = (x.transpose(0, 1).unsqueeze(0) for x in (query, key, value))
            for chunk in metadata.prefills:
                prefill_attention(chunk, q4, k4, v4, pool, layer, scaling, out)
        return out


def padded_tables(chunks: list, block_size: int) -> torch.Tensor:
    """[len(chunks), width] int32: each chunk's pages up to its last key, padded with its first
    page to the longest."""
    width = max(-(-c.end // block_size) for c in chunks)
    return torch.tensor([padded(c.block_table, width) for c in chunks], dtype=torch.int32)


def padded(table: list[int], width: int) -> list[int]:
    """The first `width` pages of `table`, padded with its first page (never read) to `width`."""
    row = table[:width]
    return row + [table[0]] * (width - len(row))


def decode_plan(decodes: list, block_size: int) -> CpuDecodePlan | None:
    """Every decode's block table and context length."""
    if not decodes:
        return None
    ctx_lens = [c.end for c in decodes]
    return CpuDecodePlan(len(decodes), padded_tables(decodes, block_size),
                         torch.tensor(ctx_lens, dtype=torch.int32), sum(ctx_lens))


def rows_plan(decodes: list, prefills: list, block_size: int) -> CpuDecodePlan | None:
    """Every query row of the step as one decode row, in flattened order: a decode over its
    context, a prefill chunk's row at position p over keys [0, p]."""
    chunks = decodes + prefills
    if not chunks:
        return None
    width = max(-(-c.end // block_size) for c in chunks)
    tables, ctx_lens = [], []
    for chunk in chunks:  # a chunk's table padded once, its rows sharing it
        tables.extend([padded(chunk.block_table, width)] * chunk.num_tokens)
        ctx_lens.extend(range(chunk.start + 1, chunk.end + 1))
    return CpuDecodePlan(len(ctx_lens), torch.tensor(tables, dtype=torch.int32),
                         torch.tensor(ctx_lens, dtype=torch.int32), sum(ctx_lens))


def prefill_plan(prefills: list, block_size: int, q_start: int) -> CpuPrefillPlan | None:
    """Every prefill chunk's block table, rows and keys."""
    if not prefills:
        return None
    lens = [c.num_tokens for c in prefills]
    starts = list(accumulate(lens[:-1], initial=q_start))
    return CpuPrefillPlan(padded_tables(prefills, block_size),
                          torch.tensor(starts, dtype=torch.int32),
                          torch.tensor(lens, dtype=torch.int32),
                          torch.tensor([c.end for c in prefills], dtype=torch.int32))
