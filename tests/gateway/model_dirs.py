"""Model and adapter directories for the multi-model and LoRA tests: a second served model (a
config and the SmolLM2 tokenizer: all a gateway loads) and PEFT adapters of random weights."""

from __future__ import annotations

import json
from pathlib import Path

from kvfleet.shared.models import DEFAULT_MODEL, resolve_model_path

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=1024)


def default_model_config() -> dict:
    """SmolLM2's config.json (the tests' default model)."""
    return json.loads((Path(resolve_model_path(DEFAULT_MODEL)) / "config.json").read_text())


def save_model_dir(directory: Path, tokenizer) -> Path:
    """A tiny Llama's config and the given tokenizer: a model the gateway can serve (a gateway
    never loads the weights)."""
    from transformers import LlamaConfig

    LlamaConfig(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                eos_token_id=tokenizer.eos_token_id, **TINY).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def save_adapter(directory: Path, base_config: dict, *, rank: int = 8,
                 target_modules=("q_proj", "v_proj")) -> Path:
    """A PEFT LoRA adapter of random weights for a model shaped as `base_config` (one decoder
    layer is enough: the shapes are what a gateway checks)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = {k: base_config[k] for k in ("hidden_size", "intermediate_size",
                                         "num_attention_heads", "num_key_value_heads")}
    if base_config.get("head_dim"):
        shape["head_dim"] = base_config["head_dim"]
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=32, num_hidden_layers=1, **shape))
    peft_model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank,
                                                  target_modules=list(target_modules),
                                                  init_lora_weights=False))
    peft_model.save_pretrained(directory)
    return directory
