"""The attention backend interface, and the function transformers' layers call through it.

The model runs one flattened forward per step: all scheduled tokens of all sequences side by side
in a batch of 1 (`input_ids` [1, T]), decoding sequences first (by context length), then prefill
chunks. A backend turns the step's chunks into its own metadata once a step
(`build_metadata`); every layer's attention call then
  1. writes the step's new K/V into the pool at their slots (`write_index`), and
  2. attends, for every query, over its sequence's cached K/V,
through `backend.forward` of the metadata it is handed. The pool stores K/V in its format
(`--kv-dtype`): writes convert or quantise, and reads dequantise into the query's dtype, so the
attention itself runs in the model's dtype. The metadata reaches the layers through the forward's
keyword arguments (CONTEXT_KWARG), never through a global; which backend runs is fixed once, at
start-up (registry.py).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from types import SimpleNamespace

import torch
from transformers import AttentionInterface

from kvfleet.worker.engine.memory.kv_cache import KVCachePool

ATTENTION_NAME = "kvfleet_paged"
CONTEXT_KWARG = "kvfleet_attention"


@dataclass(frozen=True)
class StepGeometry:
    """What a backend's metadata depends on besides the step's chunks: fixed for one runner.
    Plain fields, read many times a step."""

    pool: KVCachePool
    num_heads: int  # query heads this runner's attention computes (a tensor-parallel rank's share)
    num_kv_heads: int  # the pool's
    group_size: int  # query heads per KV head
    block_size: int
    device: torch.device  # the pool's: the metadata indexes it
    dtype: torch.dtype  # the model's: additive masks are built in it
    # [2 * KVH, 1]: row offsets of K (then V) of each KV head in the pool's [2 * KVH * NB, ...]
    # block view
    head_block_rows: torch.Tensor

    @classmethod
    def of(cls, pool: KVCachePool, num_heads: int, dtype: torch.dtype) -> StepGeometry:
        num_kv_heads = pool.layout.num_kv_heads
        rows = torch.arange(2 * num_kv_heads) * pool.num_blocks
        return cls(pool, num_heads, num_kv_heads, num_heads // num_kv_heads, pool.block_size,
                   pool.device, dtype, rows.unsqueeze(1))


@dataclass
class AttentionMetadata:
    """Per-step attention metadata, shared read-only by every layer of one forward; each backend
    extends it with what its kernels read."""

    backend: AttentionBackend
    pool: KVCachePool
    write_index: torch.Tensor  # [KVH * T]: row (h * num_slots + slot) of each new token's K or V


class AttentionBackend(ABC):
    """One way to run paged attention. Stateless after construction: one instance serves every
    runner of an engine (the profiling step's and the real one)."""

    name: str  # what --attention-backend names it (and the start-up report says)
    # runs the C++ kernels over its own pool: fused CPU layers (cpu_layers.py) are built for it and
    # write their K/V into the pool directly, and a bf16 pool takes longer pages
    cpu_kernel = False
    decode_graphs = False  # decode steps can replay CUDA graphs over its metadata (cuda_graphs.py)
    # runs Triton kernels (compiled, or Triton's interpreter in tests): the engine's other
    # kernels (LoRA's, lora/sgmv.py) run in Triton beside it
    triton_kernels = False
    # one query row's result depends only on its query and its keys: not on the other rows of
    # the step, their number, or how its prompt was chunked (--deterministic)
    row_invariant = False

    @abstractmethod
    def build_metadata(self, geometry: StepGeometry, write_index: torch.Tensor,
                       decodes: list, prefills: list) -> AttentionMetadata:
        """The step's metadata from its chunks (model_runner.PlannedChunk: decodes, sorted by
        context length, then prefill chunks, in flattened query order)."""

    @abstractmethod
    def forward(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                metadata: AttentionMetadata, scaling: float | None, out: torch.Tensor) -> None:
        """Write the step's K/V of `layer` into the pool and attend: query [1, H, T, D], key and
        value [1, KVH, T, D] (as transformers hands them over) -> out [T, H, D]."""

    def fused_forward(self, layer: int, query: torch.Tensor, key: torch.Tensor,
                      value: torch.Tensor, metadata: AttentionMetadata,
                      scaling: float) -> torch.Tensor:
        """`forward` for a fused CPU layer (cpu_layers.py) whose q, k, v ([T, H, D],
        [T, KVH, D] x 2) are views into its q/k/v product -> [T, H, D]. Here the generic path:
        the layout transformers hands over."""
        q, k, v = (x.transpose(0, 1).unsqueeze(0) for x in (query, key, value))  # [1, heads, T, D]
        out, _ = paged_attention_forward(SimpleNamespace(layer_idx=layer), q, k, v, None,
                                         scaling=scaling, **{CONTEXT_KWARG: metadata})
        return out[0]

    def describe(self) -> str:
        """The start-up report's words for it."""
        return self.name


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
    """transformers' attention function: the metadata's backend computes it.
    Returns ([1, T, H, D], None), as transformers' attention functions do."""
    # `sliding_window` (Mistral, Qwen2) is ignored: the engine caps the context at the window.
    metadata: AttentionMetadata = kwargs[CONTEXT_KWARG]
    out = query.new_empty(query.shape[2], query.shape[1], query.shape[3])  # [T, H, D]
    metadata.backend.forward(module.layer_idx, query, key, value, metadata, scaling, out)
    return out.unsqueeze(0), None


def fused_layer_attention(layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          metadata: AttentionMetadata, scaling: float) -> torch.Tensor:
    """What paged_attention_forward computes, for a fused CPU layer (cpu_layers.py): q, k, v
    ([T, H, D], [T, KVH, D] x 2) are views into its q/k/v product. -> [T, H, D]. A model fused
    by an earlier engine may run under another backend: that backend's generic path takes it."""
    return metadata.backend.fused_forward(layer, query, key, value, metadata, scaling)


def register_paged_attention() -> str:
    """Make the function available to transformers under ATTENTION_NAME (idempotent)."""
    AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
    return ATTENTION_NAME
