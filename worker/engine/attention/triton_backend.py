"""The Triton paged kernel (triton_attention.py): one launch a layer covers every query of the
step, decodes and prefill chunks alike, K/V read in place in any pool format."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from worker.engine.attention.backend import AttentionBackend, AttentionMetadata, StepGeometry
from worker.engine.triton_attention import (PagedAttentionPlan, build_plan, paged_attention,
                                            queries_per_tile)


@dataclass
class TritonMetadata(AttentionMetadata):
    plan: PagedAttentionPlan


class TritonBackend(AttentionBackend):
    name = "triton"
    decode_graphs = True

    def build_metadata(self, geometry: StepGeometry, write_index: torch.Tensor,
                       decodes: list, prefills: list) -> TritonMetadata:
        """Every chunk in flattened order, its blocks so far."""
        chunks = decodes + prefills
        bs = geometry.block_size
        block_q = queries_per_tile(geometry.num_heads, geometry.num_kv_heads,
                                   has_prefill=bool(prefills))
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
