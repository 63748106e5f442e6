"""Random-weight models of real shapes (`random:<shape>`) and `--load-format dummy`."""

from __future__ import annotations

import json

import pytest
import torch
from pydantic import ValidationError

from kvfleet.shared import model_shapes
from kvfleet.shared.model_shapes import SHAPES, shape_config
from kvfleet.shared import models
from kvfleet.shared.models import DEFAULT_MODEL, resolve_model_path
from kvfleet.worker.engine.engine import Engine, EngineConfig
from kvfleet.worker.engine.model.model_prep import load_pretrained

# Parameter counts of the published models less what their vocabulary adds beyond SmolLM2's
# 49,152 tokens (tied embeddings counted once): the shapes are those models' layers.
PUBLISHED = {
    "llama-3.2-1b": (1_235_814_400, 128_256, 2048, True),
    "llama-3.2-3b": (3_212_749_824, 128_256, 3072, True),
    # the big shapes are built on the meta device only: no weights are made
    "llama-3.1-8b": (8_030_261_248, 128_256, 4096, False),
    "llama-3.1-70b": (70_553_706_496, 128_256, 8192, False),
    "qwen2.5-1.5b": (1_543_714_304, 151_936, 1536, True),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_dense_shapes_have_the_published_models_layers(name):
    published, vocab, hidden, tied = PUBLISHED[name]
    config = shape_config(name)
    with torch.device("meta"):
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_config(config)
    params = sum(p.numel() for p in model.parameters())
    assert params == published - (vocab - config.vocab_size) * hidden * (1 if tied else 2)


def test_the_moe_shape_is_qwen3_30b_a3b_layers_cut_down():
    config = shape_config("qwen3-moe-30b-a3b-8l32e")
    assert (config.hidden_size, config.moe_intermediate_size, config.num_experts_per_tok,
            config.num_attention_heads, config.num_key_value_heads, config.head_dim) == \
        (2048, 768, 8, 32, 4, 128)
    assert (config.num_hidden_layers, config.num_experts) == (8, 32)


def test_the_qwen3_32b_shape_has_the_published_config():
    config = shape_config("qwen3-32b")  # the config only: its weights would be 63 GB
    assert (config.model_type, config.architectures) == ("qwen3", ["Qwen3ForCausalLM"])
    assert (config.hidden_size, config.intermediate_size, config.num_hidden_layers,
            config.num_attention_heads, config.num_key_value_heads, config.head_dim) == \
        (5120, 25600, 64, 64, 8, 128)
    assert (config.tie_word_embeddings, config.rms_norm_eps,
            config.rope_parameters["rope_theta"]) == (False, 1e-6, 1e6)


def test_an_unknown_shape_names_the_known_ones(tmp_path):
    with pytest.raises(ValueError, match="llama-3.2-1b"):
        resolve_model_path("random:llama-9b", tmp_path)


@pytest.fixture
def tiny_shape(monkeypatch):
    monkeypatch.setitem(SHAPES, "tiny-llama", dict(
        SHAPES["llama-3.2-1b"], hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16))
    return "random:tiny-llama"


def test_a_random_model_directory_is_made_once_with_seeded_weights(tiny_shape, tmp_path,
                                                                  monkeypatch):
    # the default model (its tokenizer) as the usual cache holds it, not converted again here
    (tmp_path / DEFAULT_MODEL).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / DEFAULT_MODEL).symlink_to(resolve_model_path(DEFAULT_MODEL))
    path = resolve_model_path(tiny_shape, tmp_path)
    config = json.loads((tmp_path / "random-tiny-llama" / "config.json").read_text())
    assert config["hidden_size"] == 64 and config["vocab_size"] == 49152
    from transformers import AutoModelForCausalLM, AutoTokenizer
    assert len(AutoTokenizer.from_pretrained(path)) == 49152  # the default model's tokenizer
    loaded = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    again = model_shapes.random_model(shape_config("tiny-llama"))
    for (name, a), b in zip(loaded.state_dict().items(), again.state_dict().values()):
        assert torch.equal(a, b), name  # what a peer loads is what the seed makes
    made = []
    monkeypatch.setattr(models, "write_random_model", lambda *a: made.append(a))
    assert resolve_model_path(tiny_shape, tmp_path) == path and not made  # not made twice


def test_load_format_dummy_reads_no_weight_file(tmp_path):
    shape_config("llama-3.2-1b", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16).save_pretrained(tmp_path)
    assert not list(tmp_path.glob("*.safetensors"))
    a = load_pretrained(str(tmp_path), "float32", "cpu", "dummy")
    b = load_pretrained(str(tmp_path), "float32", "cpu", "dummy")
    assert next(a.parameters()).dtype == torch.float32
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    engine = Engine.from_pretrained(str(tmp_path), EngineConfig(
        device="cpu", dtype="float32", load_format="dummy", num_blocks=64, block_size=4))
    from kvfleet.shared.wire import SamplingParams
    out = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0.0,
                                                      ignore_eos=True))
    assert len(out[0]) == 4
    with pytest.raises(OSError):  # the weights are what `auto` needs
        load_pretrained(str(tmp_path), "float32", "cpu", "auto")


def test_load_format_is_checked():
    with pytest.raises(ValidationError):
        EngineConfig(load_format="pt")
