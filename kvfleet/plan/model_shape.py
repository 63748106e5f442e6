"""The shape of a model that capacity planning needs (layers, KV heads, head size, parameter count),
read from a transformers config: a config.json file, a model directory, inline JSON, or any id
transformers' AutoConfig finds locally (never fetched from a hub)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

# Config key spellings across model families, first match wins.
_LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers")
_HEAD_KEYS = ("num_attention_heads", "n_head")
_HIDDEN_KEYS = ("hidden_size", "n_embd", "d_model")


class ModelShapeError(ValueError):
    """The config could not be found or lacks what the KV size needs."""


@dataclass(frozen=True)
class ModelShape:
    source: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_params_estimate: int | None  # None when the config lacks the sizes to count them
    # embeddings + LM head: whole on every tensor-parallel rank (None: unknown)
    replicated_params: int | None = None

    def describe(self) -> str:
        return (f"{self.num_layers} layers × {self.num_kv_heads} KV heads × "
                f"{self.head_dim} head dim")

    def kv_bytes_per_token(self, bytes_per_element: int) -> int:
        """K and V, for every layer and KV head: 2 × layers × kv_heads × head_dim × bytes."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * bytes_per_element


def load_model_shape(source: str) -> ModelShape:
    return shape_from_config(load_config(source), source)


def load_config(source: str) -> dict:
    """A config dict from inline JSON, a config.json path, a model directory, or AutoConfig."""
    if source.lstrip().startswith("{"):
        return _parse_json(source, "inline config")
    path = Path(source)
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        return _parse_json(path.read_text(encoding="utf-8"), str(path))
    if path.is_absolute() or source.startswith((".", "~")):
        raise ModelShapeError(f"no config.json at {source!r}")
    return _auto_config(source)


def shape_from_config(config: dict, source: str = "config") -> ModelShape:
    config = config.get("text_config") or config  # multimodal configs nest the decoder's
    num_layers = _first(config, _LAYER_KEYS)
    num_heads = _first(config, _HEAD_KEYS)
    hidden_size = _first(config, _HIDDEN_KEYS)
    if num_layers is None or (num_heads is None and config.get("head_dim") is None):
        raise ModelShapeError(f"{source}: config has no layer/attention-head counts")
    num_kv_heads = config.get("num_key_value_heads") or num_heads
    head_dim = config.get("head_dim") or (hidden_size // num_heads if hidden_size else None)
    if not num_kv_heads or not head_dim:
        raise ModelShapeError(f"{source}: config has no KV-head count or head size")
    return ModelShape(source, int(num_layers), int(num_kv_heads), int(head_dim),
                      estimate_num_params(config), replicated_params(config))


def replicated_params(config: dict) -> int | None:
    """Embedding and (untied) LM head parameters: kvfleet keeps them whole on every rank."""
    hidden, vocab = _first(config, _HIDDEN_KEYS), config.get("vocab_size")
    if not hidden or not vocab:
        return None
    return vocab * hidden * (1 if config.get("tie_word_embeddings", False) else 2)


def estimate_num_params(config: dict) -> int | None:
    """Parameters of a Llama-style decoder (gated MLP, optional MoE experts, RMSNorm): embeddings,
    attention projections, MLP, norms and an untied LM head. Close for Llama/Qwen/Mistral."""
    hidden = _first(config, _HIDDEN_KEYS)
    num_layers = _first(config, _LAYER_KEYS)
    num_heads = _first(config, _HEAD_KEYS)
    intermediate = config.get("intermediate_size")
    vocab = config.get("vocab_size")
    if not all((hidden, num_layers, num_heads, intermediate, vocab)):
        return None
    head_dim = config.get("head_dim") or hidden // num_heads
    num_kv_heads = config.get("num_key_value_heads") or num_heads
    attention = 2 * hidden * num_heads * head_dim + 2 * hidden * num_kv_heads * head_dim
    num_experts = config.get("num_local_experts") or config.get("num_experts") or 1
    mlp = num_experts * 3 * hidden * intermediate + (hidden * num_experts if num_experts > 1 else 0)
    per_layer = attention + mlp + 2 * hidden
    embeddings = vocab * hidden
    lm_head = 0 if config.get("tie_word_embeddings", False) else vocab * hidden
    return int(embeddings + num_layers * per_layer + hidden + lm_head)


def _first(config: dict, keys: tuple[str, ...]) -> int | None:
    for key in keys:
        if config.get(key):
            return config[key]
    return None


def _parse_json(text: str, source: str) -> dict:
    try:
        config = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ModelShapeError(f"{source}: not valid JSON ({exc.msg}, line {exc.lineno})") from None
    if not isinstance(config, dict):
        raise ModelShapeError(f"{source}: expected a JSON object")
    return config


def _auto_config(source: str) -> dict:
    try:
        from transformers import AutoConfig  # slow import: only when no file matched

        return AutoConfig.from_pretrained(source, local_files_only=True).to_dict()
    except Exception as exc:  # transformers raises OSError/ValueError/KeyError variously
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelShapeError(f"no model config found at {source!r}: {first_line}") from None
