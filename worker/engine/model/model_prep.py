"""The engine's model: loaded, then prepared as the engine's own copy, never the caller's.

Preparation happens in two steps, each a function that returns a new `PreparedModel`:
- `prepare_model`: a copy of the caller's model cut to this rank's tensor-parallel shard and put
  on the engine's device in its dtype (what the KV budget is planned against);
- `pack_for_cpu`: on a CPU, a copy of that whose Llama-family layers are fused around the C++
  kernels (cpu_layers.py), whose other q/k/v and gate/up linears compute as one product each,
  whose MoE experts compute through packed products of their own (cpu_experts.py) and
  whose linears (the tied LM head too: a second copy of the embedding matrix) compute through
  packed weights (cpu_linear.py).
Every copy has new module objects (and its own model config, where the runner installs its
attention) but shares the tensors it does not change with the model it came from: no weight is
held twice unless a step replaces it (sharding, packing, a dtype or device change). A draft model
goes through the same two steps (`Engine(draft_model=...)`).

The seam for adapters: every linear a prepared model computes (an nn.Linear, or a module that
replaces one: packed, sibling, fused layer products, row-parallel) is a `LinearProduct`, and
`add_linear_term(linear, term)` adds `term(x)` ([..., in] -> [..., out], e.g. LoRA's
x @ A @ B * scale) to its output, per row, until the returned handle is removed
(`add_linear_update`: the same, the term added in place by the caller, or not at all). In a fused layer
q/k/v are one product (`qkv`, outputs side by side) and gate/up another (`gate_up`): a term for
one of them is zero outside its columns. Terms are torch forward hooks: a linear without one costs
nothing more, and a CUDA graph captured before a term was added replays without it. KV computed
under a term goes into the prefix cache like any other: per-request adapters need its block
hashes keyed by the adapter.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Protocol, runtime_checkable

import torch
from torch import nn

from kvfleet.shared.model_shapes import random_model
from kvfleet.worker.engine.kernels.cpu_experts import pack_cpu_experts
from kvfleet.worker.engine.model.cpu_layers import FUSED_DTYPES, fuse_decoder_layers
from kvfleet.worker.engine.kernels.cpu_linear import fuse_sibling_linears, pack_cpu_linears
from kvfleet.worker.engine.memory.device import is_cpu, place_model, resolve_device, resolve_dtype
from kvfleet.worker.engine.parallel.tp_group import RankGroup
from kvfleet.worker.engine.parallel.tp_shard import HeadShard, RowParallelLinear, shard_model

log = logging.getLogger(__name__)


def load_pretrained(model_path: str, dtype_name: str, device_name: str,
                    load_format: str = "auto") -> nn.Module:
    """The model on the CPU in the engine's dtype (module-level: the ranks' picklable loader);
    `load_format="dummy"`: the directory's config with seeded random weights (every rank and
    every start the same), its weight files never read."""
    from transformers import AutoConfig, AutoModelForCausalLM

    dtype = resolve_dtype(dtype_name, resolve_device(device_name))
    if load_format == "dummy":
        return random_model(AutoConfig.from_pretrained(model_path), dtype=dtype)
    if load_format != "auto":
        raise ValueError(f"load_format {load_format!r}: expected auto or dummy")
    return AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype, device_map=None)


@dataclass(frozen=True)
class PreparedModel:
    """A model the engine owns, ready for its runner."""

    module: nn.Module
    device: torch.device
    dtype: torch.dtype
    shard: HeadShard | None = None  # this rank's heads under tensor parallelism
    num_fused_layers: int = 0  # decoder layers fused around the C++ kernels (cpu_layers.py)

    @property
    def num_heads(self) -> int:
        """Query heads this model's attention computes (a tensor-parallel rank's share)."""
        return self.shard.num_heads if self.shard else self.module.config.num_attention_heads


def shared_copy(model: nn.Module) -> nn.Module:
    """A deep copy of `model` that shares its tensors: parameters become new Parameter objects
    over the same memory (a cast or move of the copy's leaves the original's alone), buffers and
    tensor attributes are the same tensors, packed weights are shared (cpu_linear.py's copies)."""
    memo: dict[int, object] = {}
    for module in model.modules():
        for param in module._parameters.values():
            if param is not None and id(param) not in memo:  # tied weights stay tied
                memo[id(param)] = nn.Parameter(param.data, requires_grad=param.requires_grad)
        for value in [*module._buffers.values(), *vars(module).values()]:
            if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter):
                memo[id(value)] = value
    return copy.deepcopy(model, memo)


def prepare_model(model: nn.Module, device: torch.device, dtype: torch.dtype,
                  ranks: RankGroup | None = None) -> PreparedModel:
    """A copy of `model`: this rank's shard (before it reaches the device), on `device` in
    `dtype` (fp32 buffers such as RoPE's stay fp32)."""
    module = shared_copy(model)
    shard = None
    if ranks is not None:
        shard = shard_model(module, ranks.rank, ranks.world_size, ranks.group, ranks.comm_timer)
    return PreparedModel(place_model(module, device, dtype), device, dtype, shard)


def pack_for_cpu(prepared: PreparedModel, fuse_layers: bool,
                 invariant: bool = False) -> PreparedModel:
    """On a CPU, a copy of `prepared` with fused layers (where `fuse_layers`: the C++ attention
    kernel reads the pool; never on a tensor-parallel shard), sibling linears as one product and
    weights packed where their dtype packs here (batch-invariant products where `invariant`).
    Elsewhere `prepared` itself: CUDA keeps HF's layers."""
    if not is_cpu(prepared.device):
        return prepared
    module = shared_copy(prepared.module)
    num_fused = 0
    if (fuse_layers and prepared.dtype in FUSED_DTYPES
            and prepared.num_heads == module.config.num_attention_heads):
        num_fused = fuse_decoder_layers(module, invariant)
    fuse_sibling_linears(module, invariant)  # q/k/v and gate/up: one product each, where they pack
    pack_cpu_experts(module, invariant)  # an MoE layer's router and experts, packed
    pack_cpu_linears(module, shared=True, invariant=invariant)  # the tied LM head too (a copy)
    return replace(prepared, module=module, num_fused_layers=num_fused)


@runtime_checkable
class LinearProduct(Protocol):
    """What computes one linear of a prepared model: forward(x) [..., in] -> [..., out]."""

    in_features: int
    out_features: int

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...


Term = Callable[[torch.Tensor], torch.Tensor]  # [..., in] -> [..., out], added to the product
# (x [..., in], out [..., out]) -> the output with a term added (`out` itself, changed in place,
# or a new tensor), or None: unchanged (what a step without an adapter costs: one call)
Update = Callable[[torch.Tensor, torch.Tensor], torch.Tensor | None]


def linear_products(model: nn.Module) -> dict[str, nn.Module]:
    """Every linear of `model` by its module name: where an adapter's terms go."""
    return {name: m for name, m in model.named_modules()
            if isinstance(m, nn.Module) and isinstance(m, LinearProduct)}


def add_linear_term(linear: nn.Module, term: Term) -> torch.utils.hooks.RemovableHandle:
    """Add `term(x)` to what `linear` computes for input x until the handle is removed."""
    return add_linear_update(linear, lambda x, out: out + term(x))


def add_linear_update(linear: nn.Module, update: Update) -> torch.utils.hooks.RemovableHandle:
    """Let `update(x, out)` add a term to what `linear` computes (in place where it likes) until
    the handle is removed. On a row-parallel linear (tp_shard.py) x is this rank's share of the
    input and the update applies to the partial output, before the ranks' sum."""
    if not isinstance(linear, LinearProduct):
        raise TypeError(f"{type(linear).__name__} is not a linear (no in_features/out_features)")
    if isinstance(linear, RowParallelLinear):
        return linear.add_partial_update(update)

    def hook(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor | None:
        return update(args[0], output)

    return linear.register_forward_hook(hook)


def eos_token_ids_of(model: nn.Module) -> list[int]:
    """EOS ids from the generation config (else the model config); an int or a list there."""
    for cfg in (getattr(model, "generation_config", None), model.config):
        eos = getattr(cfg, "eos_token_id", None) if cfg is not None else None
        if eos is not None:
            return [eos] if isinstance(eos, int) else list(eos)
    return []


def max_model_len_of(config) -> int:
    """The context the engine serves: the model's positions, capped at its sliding window."""
    length = getattr(config, "max_position_embeddings", None) or 2048
    window = getattr(config, "sliding_window", None)
    if window and getattr(config, "use_sliding_window", True) and window < length:
        log.warning("sliding window %d not supported: context capped at %d tokens", window, window)
        length = window
    return length
