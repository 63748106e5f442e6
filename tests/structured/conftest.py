"""Fixtures of the constrained-decoding tests: the default model's tokenizer (49k vocabulary)
and a tiny random Llama over that vocabulary, so grammars meet a real BPE tokenizer."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kvfleet.shared.models import DEFAULT_MODEL, load_tokenizer, resolve_model_path
from kvfleet.worker.engine.engine import Engine, EngineConfig


@pytest.fixture(scope="session")
def tokenizer():
    return load_tokenizer(resolve_model_path(DEFAULT_MODEL))


@pytest.fixture(scope="session")
def tiny_bpe_model(tokenizer):
    torch.manual_seed(7)
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1,
                         vocab_size=len(tokenizer), max_position_embeddings=512,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=1, pad_token_id=0)
    model = LlamaForCausalLM(config).eval()
    model.set_attn_implementation("eager")
    return model


@pytest.fixture
def make_engine(tiny_bpe_model, tokenizer):
    def build(**config) -> Engine:
        config.setdefault("device", "cpu")
        config.setdefault("dtype", "float32")  # not auto: bf16 on native-bf16 CPUs
        config.setdefault("num_blocks", 256)
        config.setdefault("block_size", 4)
        return Engine(copy.deepcopy(tiny_bpe_model), EngineConfig(**config), tokenizer=tokenizer)
    return build
