"""Whether an engine computes every query row batch-invariantly (`--deterministic`), and if not,
why: the one verdict the start-up report, the worker's log and its metric give.

A row is batch-invariant when what it computes depends only on its own tokens and the keys its
position sees: not on the other rows of the step, their number, how its prompt was chunked, or
whether its prefix came from the cache. That takes, for every kernel a row passes through, a
reduction order fixed per row: the attention backend's (`row_invariant`), the linears' (kvfleet's
product, cpu_matmul.cpp) and the fused layers' element-wise passes (cpu_layer_ops.cpp, one row
at a time); in a mixture-of-experts layer also its router's product and its experts'
(cpu_experts.py), the routing being a function of the row's own scores. Sampling is a function of the row's logits, its seed and its position already.
"""

from __future__ import annotations

import torch

from kvfleet.worker.engine.attention import AttentionBackend
from kvfleet.worker.engine.model.cpu_layers import FusedDecoderLayer
from kvfleet.worker.engine.kernels.cpu_experts import PackedExperts, PackedRouter
from kvfleet.worker.engine.kernels.cpu_linear import KernelLinear, SiblingLinear
from kvfleet.worker.engine.memory.device import is_cpu
from kvfleet.worker.engine.model.model_prep import PreparedModel, linear_products


def invariance_gap(prepared: PreparedModel, backend: AttentionBackend,
                   deterministic: bool) -> str | None:
    """None when every row of this engine is computed batch-invariantly, else why not."""
    if not deterministic:
        return "--no-deterministic"
    if not backend.row_invariant:
        return f"attention {backend.describe()} is not batch-invariant"
    if not is_cpu(prepared.device):
        return (f"linears on {prepared.device.type} run in the vendor's library, whose kernels "
                f"depend on the batch's shape")
    layers = getattr(getattr(prepared.module, "model", None), "layers", None)
    # fused here, or already in the model it was handed (a prepared model run again)
    if layers is None or not all(isinstance(layer, FusedDecoderLayer) for layer in layers):
        return "decoder layers in HF's torch ops (not fused around kvfleet's kernels)"
    if any(layer.mlp is not None and not (isinstance(layer.mlp.gate, PackedRouter)
                                          and isinstance(layer.mlp.experts, PackedExperts))
           for layer in layers):
        return ("mixture-of-experts layers whose router or experts are transformers' own code "
                "(F.linear, whose kernels depend on the batch's shape)")
    others = sorted({type(_computing(m)).__name__
                     for m in linear_products(prepared.module).values()
                     if not isinstance(_computing(m), KernelLinear)})
    if others:
        return (f"linears in {', '.join(others)} (oneDNN or F.linear), whose kernels depend on "
                f"the batch's shape")
    return None


def _computing(module: torch.nn.Module) -> torch.nn.Module:
    """The module whose kernel computes `module`'s product."""
    return module.group.product if isinstance(module, SiblingLinear) else module
