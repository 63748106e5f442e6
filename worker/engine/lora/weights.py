"""An adapter's weights as the engine computes with them: read from PEFT's safetensors after
`shared.lora.inspect_adapter` checked them against the base model, cast to the engine's dtype,
its scale folded into B, cut to this rank's share under tensor parallelism; kept in host memory
(the device holds only the slots' copies, slots.py).

The term a linear gets for input rows x: (x @ A.T) @ B.T * scale, with PEFT's A [r, in] and
B [out, r]. Under tensor parallelism (tp_shard.py) a column-parallel linear (q/k/v, gate/up)
computes this rank's output features: B's rows of them, A whole; a row-parallel one (o, down)
reads this rank's input features: A's columns of them, B whole, and its partial term is summed
over the ranks with the product's partial output.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from kvfleet.shared.lora import (
    WEIGHTS_FILE, AdapterError, AdapterInfo, inspect_adapter, linear_shapes, lora_tensor_key)
from kvfleet.worker.engine.core.lora_request import LoraLoadError
from kvfleet.worker.engine.parallel.tp_shard import HeadShard, even_split

COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW_PARALLEL = ("o_proj", "down_proj")


@dataclass(frozen=True)
class LinearDims:
    """One decoder linear as this rank computes it: x [.., in_features] -> [.., out_features]."""

    in_features: int
    out_features: int


@dataclass(frozen=True)
class ShardSlices:
    """This rank's share of each linear (module name -> (start, size)): output features of the
    column-parallel ones, input features of the row-parallel ones. Empty: one rank."""

    out_features: dict[str, tuple[int, int]]
    in_features: dict[str, tuple[int, int]]

    @classmethod
    def whole(cls) -> ShardSlices:
        return cls({}, {})

    @classmethod
    def of_rank(cls, model_config: dict, shard: HeadShard, rank: int,
                world_size: int) -> ShardSlices:
        """The slices tp_shard.shard_model cuts for `rank` (the same arithmetic)."""
        heads = int(model_config["num_attention_heads"])
        head_dim = int(model_config.get("head_dim") or int(model_config["hidden_size"]) // heads)
        q = (shard.head_start * head_dim, shard.num_heads * head_dim)
        kv = (shard.kv_head_start * head_dim, shard.num_kv_heads * head_dim)
        mlp = even_split(int(model_config["intermediate_size"]), rank, world_size)
        return cls({"q_proj": q, "k_proj": kv, "v_proj": kv, "gate_proj": mlp, "up_proj": mlp},
                   {"o_proj": q, "down_proj": mlp})

    def dims(self, model_config: dict) -> dict[str, LinearDims]:
        """Each decoder linear's (in, out) on this rank."""
        dims = {}
        for module, shape in linear_shapes(model_config).items():
            in_features = self.in_features.get(module, (0, shape.in_features))[1]
            out_features = self.out_features.get(module, (0, shape.out_features))[1]
            dims[module] = LinearDims(in_features, out_features)
        return dims


@dataclass(frozen=True)
class LoraPair:
    """One linear's LoRA factors, in the engine's dtype on the host."""

    a: torch.Tensor  # [r, in]: PEFT's lora_A (this rank's input columns)
    b: torch.Tensor  # [out, r]: lora_B x scale (this rank's output rows)

    @property
    def rank(self) -> int:
        return self.a.shape[0]


@dataclass(frozen=True)
class AdapterWeights:
    """A loaded adapter: its factors per "layers.<i>.<module>" (the linears it targets)."""

    name: str
    path: str
    info: AdapterInfo
    pairs: dict[str, LoraPair]

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for p in self.pairs.values() for t in (p.a, p.b))


def check_adapter(path: str, model_config: dict, max_rank: int) -> AdapterInfo:
    """`inspect_adapter`, its refusals as LoraLoadError."""
    try:
        return inspect_adapter(path, model_config, max_rank)
    except AdapterError as exc:
        raise LoraLoadError(f"adapter {path}: {exc}") from exc


def load_adapter(name: str, path: str, model_config: dict, max_rank: int, dtype: torch.dtype,
                 slices: ShardSlices) -> AdapterWeights:
    """Read, check and convert one adapter (LoraLoadError when it cannot be served)."""
    from safetensors.torch import load_file

    info = check_adapter(path, model_config, max_rank)
    try:
        tensors = load_file(str(Path(path) / WEIGHTS_FILE), device="cpu")
    except (OSError, RuntimeError, ValueError) as exc:  # changed or damaged since inspected
        raise LoraLoadError(f"adapter {path}: cannot read {WEIGHTS_FILE}: {exc}") from exc
    factors: dict[str, dict[str, torch.Tensor]] = {}
    for tensor_name, tensor in tensors.items():
        key = lora_tensor_key(tensor_name)
        if key is None:
            raise LoraLoadError(f"adapter {path}: unexpected tensor {tensor_name}")
        factors.setdefault(key[0], {})[key[1]] = tensor
    if factors.keys() != info.modules.keys():
        raise LoraLoadError(f"adapter {path}: {WEIGHTS_FILE} changed while it was loaded")
    pairs = {key: _pair(key, f["A"], f["B"], info.scale, dtype, slices)
             for key, f in sorted(factors.items())}
    return AdapterWeights(name, path, info, pairs)


def _pair(key: str, a: torch.Tensor, b: torch.Tensor, scale: float, dtype: torch.dtype,
          slices: ShardSlices) -> LoraPair:
    module = key.rsplit(".", 1)[1]
    if module in slices.in_features:
        start, size = slices.in_features[module]
        a = a[:, start:start + size]
    if module in slices.out_features:
        start, size = slices.out_features[module]
        b = b[start:start + size]
    # scale folded into B in fp32, then one rounding to the engine's dtype
    return LoraPair(a.to(dtype).contiguous(), (b.float() * scale).to(dtype).contiguous())
