"""LoRA adapters in PEFT's format, inspected without loading them: what a gateway checks when an
adapter is registered and a worker checks again before it loads one (docs/OPERATIONS.md,
"LoRA adapters").

An adapter directory holds `adapter_config.json` and `adapter_model.safetensors` (what PEFT's
`save_pretrained` writes). Only the file's header is read here (its tensor names and shapes), so a
gateway checks a 100 MB adapter in milliseconds and never needs torch. The engine applies LoRA to
the linears of Llama-family decoder layers (`SUPPORTED_MODULES`); an adapter with anything else
(other modules, trained biases, DoRA, modules_to_save, embedding LoRA) is refused here, before a
worker ever sees a request for it.
"""

from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

# The linears of a Llama-family decoder layer, by the name PEFT targets them with.
ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
SUPPORTED_MODULES = ATTENTION_MODULES + MLP_MODULES

# PEFT's tensor names: base_model.model.<module path>.lora_A.weight (and lora_B)
_TENSOR_NAME = re.compile(
    r"^base_model\.model\.(?P<path>.+\.layers\.(?P<layer>\d+)\.(?:self_attn|mlp)\."
    r"(?P<module>[a-z_]+))\.lora_(?P<part>[AB])(?:\.[^.]+)?\.weight$")
_MAX_HEADER_BYTES = 64 * 1024 * 1024  # safetensors' own limit is 100 MB; headers are KBs


class AdapterError(ValueError):
    """An adapter kvfleet will not serve; the message says why (the gateway's 400)."""


@dataclass(frozen=True)
class LinearShape:
    """One linear of the base model: x [.., in_features] -> [.., out_features]."""

    in_features: int
    out_features: int


@dataclass(frozen=True)
class AdapterInfo:
    """What an adapter directory holds, checked against its base model."""

    path: str  # the directory, as given
    rank: int  # r: the largest rank over its modules (rank_pattern may lower some)
    alpha: float
    scale: float  # alpha / r (alpha / sqrt(r) with rslora): what B·A is multiplied by
    target_modules: tuple[str, ...]  # sorted subset of SUPPORTED_MODULES
    num_layers: int  # decoder layers it changes
    weights_bytes: int
    base_model_name: str = ""  # base_model_name_or_path as PEFT recorded it (informative)
    # per tensor: "layers.<i>.<module>" -> (rank, in_features, out_features)
    modules: dict[str, tuple[int, int, int]] = field(default_factory=dict, compare=False)


def lora_tensor_key(name: str) -> tuple[str, str] | None:
    """("layers.<i>.<module>", "A" or "B") of a PEFT LoRA tensor name (what `AdapterInfo.modules`
    is keyed by); None for any other name."""
    match = _TENSOR_NAME.match(name)
    if match is None:
        return None
    return f"layers.{int(match['layer'])}.{match['module']}", match["part"]


def linear_shapes(model_config: dict) -> dict[str, LinearShape]:
    """The decoder layer's linears of a Llama-family model, from its config.json."""
    hidden = int(model_config["hidden_size"])
    heads = int(model_config["num_attention_heads"])
    kv_heads = int(model_config.get("num_key_value_heads") or heads)
    head_dim = int(model_config.get("head_dim") or hidden // heads)
    inter = int(model_config["intermediate_size"])
    return {
        "q_proj": LinearShape(hidden, heads * head_dim),
        "k_proj": LinearShape(hidden, kv_heads * head_dim),
        "v_proj": LinearShape(hidden, kv_heads * head_dim),
        "o_proj": LinearShape(heads * head_dim, hidden),
        "gate_proj": LinearShape(hidden, inter),
        "up_proj": LinearShape(hidden, inter),
        "down_proj": LinearShape(inter, hidden),
    }


def read_safetensors_header(path: Path) -> dict[str, dict]:
    """Tensor name -> {"dtype", "shape", "data_offsets"} from a safetensors file's header."""
    try:
        with open(path, "rb") as f:
            raw_len = f.read(8)
            if len(raw_len) != 8:
                raise AdapterError(f"{path.name} is not a safetensors file (too short)")
            (length,) = struct.unpack("<Q", raw_len)
            if length > _MAX_HEADER_BYTES:
                raise AdapterError(f"{path.name} is not a safetensors file (header of {length} "
                                   "bytes)")
            header = json.loads(f.read(length))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise AdapterError(f"cannot read {path.name}: {exc}") from exc
    if not isinstance(header, dict):
        raise AdapterError(f"{path.name} is not a safetensors file")
    header.pop("__metadata__", None)
    return header


def _config(directory: Path) -> dict:
    config_path = directory / CONFIG_FILE
    if not config_path.is_file():
        raise AdapterError(f"no {CONFIG_FILE} in {directory}: not a PEFT adapter directory")
    try:
        config = json.loads(config_path.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise AdapterError(f"cannot read {CONFIG_FILE}: {exc}") from exc
    if not isinstance(config, dict):
        raise AdapterError(f"{CONFIG_FILE} is not a JSON object")
    return config


def _check_config(config: dict) -> None:
    peft_type = str(config.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise AdapterError(f"peft_type {peft_type} is not LoRA")
    refused = {
        "use_dora": "DoRA adapters are not supported",
        "modules_to_save": "adapters with modules_to_save (fully trained modules) are not "
                           "supported",
        "lora_bias": "adapters with a LoRA bias are not supported",
        "use_qalora": "QA-LoRA adapters are not supported",
        "fan_in_fan_out": "fan_in_fan_out adapters (Conv1D bases) are not supported",
        "target_parameters": "adapters on parameters (target_parameters) are not supported",
        "trainable_token_indices": "adapters with trained token embeddings are not supported",
        "layer_replication": "adapters with layer_replication are not supported",
    }
    for key, why in refused.items():
        if why and config.get(key):
            raise AdapterError(why)
    if str(config.get("bias", "none")) != "none":
        raise AdapterError(f"adapters with trained biases (bias={config['bias']!r}) are not "
                           "supported")
    if config.get("alpha_pattern"):
        raise AdapterError("alpha_pattern (per-module alpha) is not supported")


def inspect_adapter(path: str, model_config: dict, max_rank: int) -> AdapterInfo:
    """Check the adapter in directory `path` against a base model's config.json (`model_config`)
    and the fleet's `max_rank`; AdapterError says what is wrong."""
    directory = Path(path)
    if not directory.is_dir():
        raise AdapterError(f"adapter directory {path} does not exist")
    config = _config(directory)
    _check_config(config)
    weights = directory / WEIGHTS_FILE
    if not weights.is_file():
        raise AdapterError(f"no {WEIGHTS_FILE} in {path} (only safetensors adapters are "
                           "served; PEFT's save_pretrained writes one by default)")
    header = read_safetensors_header(weights)
    shapes = linear_shapes(model_config)
    num_layers = int(model_config.get("num_hidden_layers", 0))
    pairs: dict[str, dict[str, list[int]]] = {}
    for name, entry in header.items():
        match = _TENSOR_NAME.match(name)
        if match is None:
            raise AdapterError(f"tensor {name} is not a LoRA product of a decoder layer's "
                               f"linear (the engine applies LoRA to {', '.join(SUPPORTED_MODULES)})")
        module, layer = match["module"], int(match["layer"])
        if module not in SUPPORTED_MODULES:
            raise AdapterError(f"target module {module} is not supported (the engine applies "
                               f"LoRA to {', '.join(SUPPORTED_MODULES)})")
        if layer >= num_layers:
            raise AdapterError(f"tensor {name} is for layer {layer}; the base model has "
                               f"{num_layers} layers")
        pairs.setdefault(f"layers.{layer}.{module}", {})[match["part"]] = list(entry["shape"])
    if not pairs:
        raise AdapterError(f"{WEIGHTS_FILE} holds no LoRA tensors")
    modules: dict[str, tuple[int, int, int]] = {}
    for key, parts in sorted(pairs.items()):
        modules[key] = _check_pair(key, parts, shapes[key.rsplit(".", 1)[1]], max_rank)
    rank = max(r for r, _, _ in modules.values())
    alpha = float(config.get("lora_alpha", 8))
    declared = int(config.get("r", rank))
    scale = alpha / math.sqrt(declared) if config.get("use_rslora") else alpha / declared
    if any(r != declared for r, _, _ in modules.values()) and not config.get("rank_pattern"):
        raise AdapterError(f"the tensors' ranks differ from r={declared} in {CONFIG_FILE}")
    if config.get("rank_pattern"):
        raise AdapterError("rank_pattern (per-module rank) is not supported")
    targets = tuple(sorted({k.rsplit(".", 1)[1] for k in modules}))
    return AdapterInfo(path=str(path), rank=rank, alpha=alpha, scale=scale,
                       target_modules=targets,
                       num_layers=len({k.split(".")[1] for k in modules}),
                       weights_bytes=weights.stat().st_size,
                       base_model_name=str(config.get("base_model_name_or_path") or ""),
                       modules=modules)


def _check_pair(key: str, parts: dict[str, list[int]], shape: LinearShape,
                max_rank: int) -> tuple[int, int, int]:
    if set(parts) != {"A", "B"}:
        raise AdapterError(f"{key} has lora_{'A' if 'A' not in parts else 'B'} missing")
    a, b = parts["A"], parts["B"]  # A: [r, in], B: [out, r] (nn.Linear weights)
    if len(a) != 2 or len(b) != 2 or a[0] != b[1]:
        raise AdapterError(f"{key}: lora_A {a} and lora_B {b} are not a rank-r pair")
    rank = a[0]
    if a[1] != shape.in_features or b[0] != shape.out_features:
        raise AdapterError(
            f"{key}: the adapter maps {a[1]} -> {b[0]} features; the base model's "
            f"{key.rsplit('.', 1)[1]} maps {shape.in_features} -> {shape.out_features} (an "
            "adapter of another base model)")
    if rank > max_rank:
        raise AdapterError(f"{key}: rank {rank} is over the limit of {max_rank} "
                           "(--max-lora-rank)")
    return rank, shape.in_features, shape.out_features


def parse_lora_module(text: str) -> tuple[str, str]:
    """`name=path` (vLLM's --lora-modules spelling; also its JSON form {"name", "path"})."""
    text = text.strip()
    if text.startswith("{"):
        data = json.loads(text)
        name, path = data.get("name", ""), data.get("path", "")
    else:
        name, sep, path = text.partition("=")
        if not sep:
            raise ValueError(f"--lora-modules takes name=path, not {text!r}")
    name, path = name.strip(), path.strip()
    if not name or not path:
        raise ValueError(f"--lora-modules takes name=path, not {text!r}")
    return name, path


@dataclass(frozen=True)
class LoraRecord:
    """One registered adapter (`Keys.loras`: adapter name -> this record as JSON): the fleet's
    registry, written by a gateway, read by every gateway."""

    name: str  # what requests put in `model`
    base_model: str  # the served model id it adapts
    path: str  # the adapter directory, as every worker of the base model sees it
    rank: int
    target_modules: tuple[str, ...] = ()
    created: int = 0  # unix time of the registration
    pinned: bool = False  # named at start-up (--lora-modules): kept when the gateway restarts

    def to_json(self) -> str:
        return json.dumps({"name": self.name, "base_model": self.base_model, "path": self.path,
                           "rank": self.rank, "target_modules": list(self.target_modules),
                           "created": self.created, "pinned": self.pinned})

    @classmethod
    def from_json(cls, raw: bytes | str) -> LoraRecord:
        data = json.loads(raw)
        return cls(name=data["name"], base_model=data["base_model"], path=data["path"],
                   rank=int(data["rank"]), target_modules=tuple(data.get("target_modules", ())),
                   created=int(data.get("created", 0)), pinned=bool(data.get("pinned", False)))
