"""Tensor-parallel sharding of a Llama/Qwen2-style decoder (Megatron layout), in place on the
engine's own copy of the model (model_prep.py).

Each rank keeps:
- q/k/v projections column-parallel: the rows of its query heads and of the KV heads those
  heads read (whole KV groups split over the ranks, unevenly when their number does not divide;
  one replicated KV head per rank when there are fewer KV heads than ranks);
- gate/up projections column-parallel: its slice of the intermediate size (within one row);
- o_proj and down_proj row-parallel: the matching input columns, their partial outputs summed by
  an all_reduce over the ranks (a bias is added once, after the sum);
- embeddings, norms and the LM head whole (replicated), so every rank holds the full hidden
  state between layers and rank 0 alone computes the logits it samples.

transformers' attention modules reshape with `-1` heads, so the sharded layers run the unchanged
forward: each rank's attention sees its local heads, and the paged attention its own KV pool.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.hooks import RemovableHandle


@dataclass(frozen=True)
class HeadShard:
    """The attention heads one rank computes (global indices start at the `*_start` fields)."""

    num_heads: int  # query heads of this rank
    num_kv_heads: int  # KV heads of this rank (1 when they are replicated)
    head_start: int
    kv_head_start: int


def even_split(total: int, rank: int, world_size: int) -> tuple[int, int]:
    """(start, size) of rank's share of `total` items: sizes differ by at most one."""
    base, extra = divmod(total, world_size)
    return rank * base + min(rank, extra), base + (rank < extra)


def head_shard(num_heads: int, num_kv_heads: int, rank: int, world_size: int) -> HeadShard:
    """Whole KV groups (a KV head and the query heads reading it) per rank, as evenly as their
    number allows (9 heads / 3 KV heads over 2 ranks: 6 + 3); with fewer KV heads than ranks,
    each KV head is replicated on the ranks that split its query heads."""
    group = num_heads // num_kv_heads  # query heads per KV head
    if num_kv_heads >= world_size:
        kv_start, num_kv = even_split(num_kv_heads, rank, world_size)
        return HeadShard(num_kv * group, num_kv, kv_start * group, kv_start)
    ranks_per_kv = world_size // num_kv_heads
    if world_size % num_kv_heads or group % ranks_per_kv:
        raise ValueError(f"{num_heads} attention heads and {num_kv_heads} KV heads do not split "
                         f"over {world_size} ranks")
    local = group // ranks_per_kv
    start = rank * local
    return HeadShard(local, 1, start, start // group)


def model_head_shard(config, rank: int, world_size: int) -> HeadShard:
    num_kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return head_shard(config.num_attention_heads, num_kv_heads, rank, world_size)


class RowParallelLinear(nn.Module):
    """A linear layer over a slice of its input features; the ranks' outputs are summed."""

    def __init__(self, linear: nn.Linear, start: int, size: int, group, comm_timer=None):
        super().__init__()
        self.in_features, self.out_features = size, linear.out_features
        self.weight = nn.Parameter(linear.weight.data[:, start:start + size].clone(),
                                   requires_grad=False)  # [out, size]
        self.bias = (None if linear.bias is None
                     else nn.Parameter(linear.bias.data.clone(), requires_grad=False))
        self.group = group
        self.comm_timer = comm_timer  # CommTimer or None: seconds spent in the all_reduce
        # (x, partial out) -> partial out with a term added (model_prep.add_linear_update):
        # applied before the all_reduce, so the ranks' partial terms are summed with the product
        self._partial_updates: OrderedDict[int, Callable] = OrderedDict()  # weakly referable

    def __deepcopy__(self, memo) -> RowParallelLinear:
        """A copy that sums over the same process group, timed by the same timer."""
        memo[id(self.group)], memo[id(self.comm_timer)] = self.group, self.comm_timer
        clone = type(self).__new__(type(self))
        memo[id(self)] = clone
        clone.__dict__.update(copy.deepcopy(self.__dict__, memo))
        return clone

    def add_partial_update(self, update: Callable) -> RemovableHandle:
        """Apply `update(x, partial)` to this rank's partial output before the sum."""
        handle = RemovableHandle(self._partial_updates)
        self._partial_updates[handle.id] = update
        return handle

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight)  # [..., out]: this rank's partial sum
        for update in self._partial_updates.values():
            updated = update(x, out)
            out = out if updated is None else updated
        if self.comm_timer is None:
            dist.all_reduce(out, group=self.group)
        else:
            with self.comm_timer:
                dist.all_reduce(out, group=self.group)
        return out if self.bias is None else out + self.bias


def keep_rows(linear: nn.Linear, start: int, size: int) -> None:
    """Column parallel: keep output features [start, start + size) (and their bias)."""
    linear.weight = nn.Parameter(linear.weight.data[start:start + size].clone(),
                                 requires_grad=False)
    if linear.bias is not None:
        linear.bias = nn.Parameter(linear.bias.data[start:start + size].clone(),
                                   requires_grad=False)
    linear.out_features = size


def shard_model(model: nn.Module, rank: int, world_size: int, group=None,
                comm_timer=None) -> HeadShard:
    """Cut `model`'s decoder layers down to this rank's shard, in place; its heads."""
    shard = model_head_shard(model.config, rank, world_size)
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise ValueError("tensor parallelism needs a Llama/Qwen2-style model (model.model.layers)")
    for layer in layers:
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if not all(hasattr(attn, p) for p in ("q_proj", "k_proj", "v_proj", "o_proj")) or \
                not all(hasattr(mlp, p) for p in ("gate_proj", "up_proj", "down_proj")):
            raise ValueError(f"tensor parallelism supports Llama/Qwen2-style layers, not "
                             f"{type(layer).__name__}")
        head_dim = attn.head_dim
        keep_rows(attn.q_proj, shard.head_start * head_dim, shard.num_heads * head_dim)
        for proj in (attn.k_proj, attn.v_proj):
            keep_rows(proj, shard.kv_head_start * head_dim, shard.num_kv_heads * head_dim)
        attn.o_proj = RowParallelLinear(attn.o_proj, shard.head_start * head_dim,
                                        shard.num_heads * head_dim, group, comm_timer)
        # read by transformers' own attention functions (eager, sdpa); ours reads the pool
        attn.num_key_value_groups = shard.num_heads // shard.num_kv_heads
        start, size = even_split(mlp.gate_proj.out_features, rank, world_size)
        keep_rows(mlp.gate_proj, start, size)
        keep_rows(mlp.up_proj, start, size)
        mlp.down_proj = RowParallelLinear(mlp.down_proj, start, size, group, comm_timer)
    return shard
