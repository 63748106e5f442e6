"""`--speculative-config` as a worker takes it: JSON from a flag or KVFLEET_SPECULATIVE_CONFIG,
checked when the settings load; a draft model resolved like `--model` and refused at start-up
when its tokenizer is not the model's; an engine refuses a draft model it cannot use."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError
from transformers import LlamaConfig, LlamaForCausalLM

from kvfleet.shared.engine_config import EngineConfig
from kvfleet.shared.models import DEFAULT_MODEL, load_tokenizer, resolve_model_path
from kvfleet.shared.settings import WorkerSettings
from kvfleet.worker.engine.engine import Engine
from kvfleet.worker.process.main import with_draft_model_path


def test_json_from_the_flag_and_the_environment(monkeypatch):
    settings = WorkerSettings(speculative_config='{"method": "suffix", "num_speculative_tokens": 3}')
    assert settings.engine_config().speculative_config.num_speculative_tokens == 3
    monkeypatch.setenv("KVFLEET_SPECULATIVE_CONFIG", '{"method": "ngram", "prompt_lookup_max": 6}')
    spec = WorkerSettings().engine_config().speculative_config
    assert (spec.method, spec.prompt_lookup_max, spec.num_speculative_tokens) == ("ngram", 6, 5)
    monkeypatch.setenv("KVFLEET_SPECULATIVE_CONFIG", "")
    assert WorkerSettings().speculative_config is None


@pytest.mark.parametrize("text, problem", [
    ('{"method": "eagle"}', "method"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens"),
    ('{"method": "ngram", "prompt_lookup_min": 5, "prompt_lookup_max": 2}', "prompt_lookup_min"),
    ('{"method": "ngram", "model": "x"}', "draft model"),
    ('{"method": "ngram", "lookahead": 3}', "lookahead"),
    ("{method: ngram}", "not a JSON object"),
])
def test_bad_configs_are_refused_with_the_reason(text, problem):
    with pytest.raises((ValidationError, ValueError), match=problem):
        EngineConfig(speculative_config=text)


def tiny_draft(vocab_size: int) -> LlamaForCausalLM:
    torch.manual_seed(3)
    return LlamaForCausalLM(LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, vocab_size=vocab_size, max_position_embeddings=256))


def test_a_draft_model_is_resolved_and_must_share_the_tokenizer(tmp_path):
    tokenizer = load_tokenizer(resolve_model_path(DEFAULT_MODEL))
    same, other = tmp_path / "same", tmp_path / "other"
    for directory in (same, other):
        tiny_draft(len(tokenizer)).save_pretrained(directory)
    tokenizer.save_pretrained(same)
    tokenizer.add_tokens(["<a-token-only-the-other-draft-has>"])
    tokenizer.save_pretrained(other)
    models = load_tokenizer(resolve_model_path(DEFAULT_MODEL))  # the model's, unchanged

    def resolve(path) -> EngineConfig:
        config = EngineConfig(speculative_config={"method": "draft_model", "model": str(path)})
        return with_draft_model_path(config, models, None)

    assert resolve(same).speculative_config.model == str(same)
    with pytest.raises(SystemExit, match="another tokenizer"):
        resolve(other)
    with pytest.raises(SystemExit, match="draft model"):
        resolve(tmp_path / "missing")


def test_an_engine_refuses_a_draft_it_cannot_use(tiny_llama):
    model = tiny_llama.model
    base = dict(device="cpu", dtype="float32", num_blocks=32, block_size=4)
    with pytest.raises(ValueError, match="vocabulary"):
        Engine(model, EngineConfig(**base), draft_model=tiny_draft(64))
    with pytest.raises(ValueError, match="method is 'ngram'"):
        Engine(model, EngineConfig(**base, speculative_config={"method": "ngram"}),
               draft_model=tiny_draft(512))
    with pytest.raises(ValueError, match="needs `model`"):
        Engine(model, EngineConfig(**base, speculative_config={"method": "draft_model"}))
