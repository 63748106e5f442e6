"""Where a prepared model's adapter terms go: each decoder linear product, and for the fused ones
which output columns belong to which of the adapter's modules.

A prepared model computes a Llama-family layer's linears in one of three shapes (model_prep.py):
HF's own (`self_attn.q_proj`, ..., `mlp.down_proj`; also cpu_linear.py's sibling linears and
tp_shard.py's row-parallel ones under those names), or the fused CPU layer's four products
(cpu_layers.py: `qkv` = q, k, v outputs side by side, `o_proj`, `gate_up` = gate, up, `down_proj`).
Each gets one update (model_prep.add_linear_update) that adds, for the step's adapter rows, every
part's term into that part's columns.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from torch import nn

from kvfleet.shared.lora import SUPPORTED_MODULES
from kvfleet.worker.engine.lora.weights import LinearDims
from kvfleet.worker.engine.model.model_prep import linear_products

FUSED_PARTS = {"qkv": ("q_proj", "k_proj", "v_proj"), "gate_up": ("gate_proj", "up_proj")}
_PRODUCT_NAME = re.compile(r"(?:^|\.)layers\.(?P<layer>\d+)\.(?:self_attn\.|mlp\.)?"
                           r"(?P<product>[a-z_]+)$")


@dataclass(frozen=True)
class TargetPart:
    """One adapter module's share of a product: output columns [start, end)."""

    key: str  # "layers.<i>.<module>": AdapterInfo.modules' and the slots' key
    start: int
    end: int


@dataclass(frozen=True)
class LoraTarget:
    """A product of the prepared model that adapters add to."""

    name: str  # its module name in the prepared model
    module: nn.Module
    parts: tuple[TargetPart, ...]


def lora_targets(model: nn.Module, dims: dict[str, LinearDims],
                 num_layers: int) -> list[LoraTarget]:
    """Every decoder linear of `model` (dims: each module's shape on this rank), each layer's
    seven modules covered once; ValueError for a model whose linears are laid out otherwise."""
    targets, covered = [], set()
    for name, module in linear_products(model).items():
        match = _PRODUCT_NAME.search(name)
        if match is None:
            continue
        modules = FUSED_PARTS.get(match["product"], (match["product"],))
        if not set(modules) <= set(SUPPORTED_MODULES):
            continue
        parts, column = [], 0
        for m in modules:
            key = f"layers.{int(match['layer'])}.{m}"
            parts.append(TargetPart(key, column, column + dims[m].out_features))
            column += dims[m].out_features
            covered.add(key)
        if column != module.out_features:
            raise ValueError(f"LoRA: {name} computes {module.out_features} features, not the "
                             f"{column} of {'+'.join(modules)}")
        targets.append(LoraTarget(name, module, tuple(parts)))
    missing = {f"layers.{i}.{m}" for i in range(num_layers) for m in SUPPORTED_MODULES} - covered
    if missing:
        raise ValueError(f"LoRA needs Llama-family decoder linears; this model has none for "
                         f"{', '.join(sorted(missing)[:4])}{' ...' if len(missing) > 4 else ''}")
    return targets
