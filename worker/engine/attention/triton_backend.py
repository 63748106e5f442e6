"""The Triton paged kernel (triton_attention.py): one launch a layer covers every query of the
step, decodes and prefill chunks alike, K/V read in place in any pool format.

Batch-invariant (`--deterministic`): every step takes the decode steps' tile (the same products
of the same shapes, whatever the step holds), and the keys are visited in blocks of BLOCK_N from
the first, so a row's online softmax adds the same blocks in the same order whether it is a
decode or a prefill chunk's row (the blocks past its position are masked: exact no-ops). Without
it, steps with a prefill chunk take taller tiles (more K/V reuse)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvfleet.worker.engine.attention.backend import AttentionBackend, AttentionMetadata, StepGeometry
from kvfleet.worker.engine.kernels.triton_attention import (PagedAttentionPlan, build_plan, paged_attention,
                                            queries_per_tile)


@dataclass
class TritonMetadata(AttentionMetadata):
    plan: PagedAttentionPlan


class TritonBackend(AttentionBackend):
    name = "triton"
    decode_graphs = True
    triton_kernels = True

    def __init__(self, row_invariant: bool = False):
        self.row_invariant = row_invariant

    def describe(self) -> str:
        return "triton (one tile shape for every step: batch-invariant)" if self.row_invariant \
            else "triton"

    def build_metadata(self, geometry: StepGeometry, write_index: torch.Tensor,
                       decodes: list, prefills: list) -> TritonMetadata:
        """Every chunk in flattened order, its blocks so far."""
        chunks = decodes + prefills
        bs = geometry.block_size
        block_q = queries_per_tile(geometry.num_heads, geometry.num_kv_heads,
                                   has_prefill=bool(prefills) and not self.row_invariant)
        plan = build_plan([c.num_tokens for c in chunks], [c.end for c in chunks],
                          [c.block_table[:-(-c.end // bs)] for c in chunks], block_q,
                          geometry.device)
        return TritonMetadata(self, geometry.pool, write_index, plan)

    def forward(self, layer, query, key, value, metadata: TritonMetadata, scaling, out) -> None:
        pool = metadata.pool
        head_dim = query.shape[3]
        pool.write(layer, metadata.write_index, key[0].reshape(-1, head_dim),
                   value[0].reshape(-1, head_dim))
        paged_attention(query[0], pool, layer, metadata.plan, scaling, out)
