"""Random-weight models of the shapes people serve, for benchmarks where no weights can be fetched.

`random:<shape>` as a model name (`--model random:llama-3.2-1b`) resolves to a model directory made
once under the model cache: the shape's config with the default model's tokenizer and vocabulary
(SmolLM2's 49,152 tokens), seeded random weights in bf16 safetensors, so that kvfleet and a peer
(vLLM) load the same weights from the same directory. Random weights answer nonsense: benchmarks
ask for fixed lengths (`ignore_eos`). The shapes follow the published configs but for the
vocabulary (and a context of 8,192 positions); the MoE shape is Qwen3-30B-A3B's layer cut to 8
layers of 32 experts (8 active), so that it fits a small host.

The big shapes (Llama-3.1-8B and -70B, Qwen3-32B) are for simulated workers (worker/sim/), whose
cost models need a model's shape and never its weights: as `random:` weights they are costly to
make (16 to 140 GB) and no test makes them.

`--load-format dummy` (vLLM's spelling, worker/engine/model/model_prep.py) is the other way: any model
directory's config with random weights, nothing read from its weight files.
"""

from __future__ import annotations

from pathlib import Path

RANDOM_PREFIX = "random:"
SEED = 0
VOCAB_SIZE = 49152  # SmolLM2's tokenizer, which the shapes are served with

_LLAMA = dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_act="silu",
              rms_norm_eps=1e-5, max_position_embeddings=8192, rope_theta=500000.0,
              attention_bias=False, mlp_bias=False, tie_word_embeddings=True)
SHAPES: dict[str, dict] = {
    "llama-3.2-1b": _LLAMA | dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                                  num_attention_heads=32, num_key_value_heads=8, head_dim=64),
    "llama-3.2-3b": _LLAMA | dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
                                  num_attention_heads=24, num_key_value_heads=8, head_dim=128),
    # the Llama 3.1 configs untie the LM head from the embeddings (3.2's small ones tie them)
    "llama-3.1-8b": _LLAMA | dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                  num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                                  tie_word_embeddings=False),
    "llama-3.1-70b": _LLAMA | dict(hidden_size=8192, intermediate_size=28672,
                                   num_hidden_layers=80, num_attention_heads=64,
                                   num_key_value_heads=8, head_dim=128, tie_word_embeddings=False),
    "qwen2.5-1.5b": dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"],
                         hidden_act="silu", rms_norm_eps=1e-6, max_position_embeddings=8192,
                         rope_theta=1000000.0, tie_word_embeddings=True, hidden_size=1536,
                         intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2),
    "qwen3-32b": dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], hidden_act="silu",
                      rms_norm_eps=1e-6, max_position_embeddings=8192, rope_theta=1000000.0,
                      attention_bias=False, tie_word_embeddings=False, hidden_size=5120,
                      intermediate_size=25600, num_hidden_layers=64, num_attention_heads=64,
                      num_key_value_heads=8, head_dim=128),
    "qwen3-moe-30b-a3b-8l32e": dict(
        model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], hidden_act="silu",
        rms_norm_eps=1e-6, max_position_embeddings=8192, rope_theta=1000000.0,
        tie_word_embeddings=False, hidden_size=2048, intermediate_size=6144,
        moe_intermediate_size=768, num_hidden_layers=8, num_attention_heads=32,
        num_key_value_heads=4, head_dim=128, num_experts=32, num_experts_per_tok=8,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[]),
}


def is_random_model(model: str) -> bool:
    return model.startswith(RANDOM_PREFIX)


def shape_name(model: str) -> str:
    """The shape of a `random:<shape>` name; ValueError naming the shapes for an unknown one."""
    name = model[len(RANDOM_PREFIX):]
    if name not in SHAPES:
        raise ValueError(f"unknown model shape {name!r} in {model!r}; shapes: {', '.join(SHAPES)}")
    return name


def shape_config(name: str, **overrides):
    """The transformers config of a shape (its vocabulary SmolLM2's, token ids its tokenizer's)."""
    from transformers import AutoConfig

    fields = dict(SHAPES[name])
    model_type = fields.pop("model_type")
    fields.update(vocab_size=VOCAB_SIZE, bos_token_id=1, eos_token_id=2, pad_token_id=2,
                  torch_dtype="bfloat16")
    return AutoConfig.for_model(model_type, **(fields | overrides))


def random_model(config, seed: int = SEED, dtype=None):
    """A model of `config` with seeded random weights (transformers' own initialisation), in
    `dtype` (default bf16): the same weights wherever it is built with the same seed."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=dtype or torch.bfloat16).eval()


def write_random_model(name: str, directory: Path, tokenizer_dir: str, seed: int = SEED) -> None:
    """Write the shape's random model (bf16 safetensors) with the tokenizer of `tokenizer_dir`
    into `directory` (shared/models.py makes it atomically)."""
    from transformers import AutoTokenizer

    random_model(shape_config(name), seed).save_pretrained(directory)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(directory)
