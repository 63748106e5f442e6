"""shared/lora.py: a PEFT adapter directory checked against its base model from the files'
headers alone (what a gateway does at registration and a worker before it loads one)."""

from __future__ import annotations

import json

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

from kvfleet.shared.lora import (AdapterError, LoraRecord, inspect_adapter, linear_shapes,
                         parse_lora_module)

BASE = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2)


def save_adapter(directory, config=BASE, **lora) -> str:
    torch.manual_seed(0)
    model = get_peft_model(LlamaForCausalLM(config), LoraConfig(**{
        "r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj", "down_proj"],
        "init_lora_weights": False, **lora}))
    model.save_pretrained(str(directory))
    return str(directory)


@pytest.fixture(scope="module")
def adapter(tmp_path_factory) -> str:
    return save_adapter(tmp_path_factory.mktemp("adapter"))


def test_an_adapter_is_read_from_its_header(adapter):
    info = inspect_adapter(adapter, BASE.to_dict(), max_rank=16)
    assert (info.rank, info.alpha, info.scale) == (8, 16.0, 2.0)
    assert info.target_modules == ("down_proj", "q_proj", "v_proj")
    assert info.num_layers == 2
    assert info.modules["layers.1.down_proj"] == (8, 96, 64)
    assert info.modules["layers.0.v_proj"] == (8, 64, 32)  # 2 KV heads of 16


def test_rslora_scales_by_the_square_root(tmp_path):
    info = inspect_adapter(save_adapter(tmp_path, r=4, lora_alpha=8, use_rslora=True),
                           BASE.to_dict(), max_rank=16)
    assert info.scale == pytest.approx(8 / 2)


def test_linear_shapes_follow_the_config():
    shapes = linear_shapes({**BASE.to_dict(), "head_dim": 32})
    assert (shapes["q_proj"].out_features, shapes["o_proj"].in_features) == (128, 128)
    assert shapes["k_proj"].out_features == 64


@pytest.mark.parametrize("change, message", [
    ("rank", "rank 8 is over the limit of 4"),
    ("other base", "an adapter of another base model"),
    ("no config", "not a PEFT adapter directory"),
    ("no weights", "no adapter_model.safetensors"),
    ("bad header", "not a safetensors file"),
    ("dora", "DoRA adapters are not supported"),
    ("bias", "trained biases"),
    ("missing dir", "does not exist"),
])
def test_bad_adapters_are_refused_with_the_reason(tmp_path, adapter, change, message):
    path, max_rank, base = adapter, 16, BASE.to_dict()
    if change == "rank":
        max_rank = 4
    elif change == "other base":
        base = {**base, "hidden_size": 128}
    elif change in ("no config", "no weights", "bad header"):
        path = save_adapter(tmp_path / "a")
        victim = {"no config": "adapter_config.json"}.get(change, "adapter_model.safetensors")
        if change == "bad header":
            (tmp_path / "a" / victim).write_bytes(b"\xff" * 16)
        else:
            (tmp_path / "a" / victim).unlink()
    elif change == "dora":
        path = save_adapter(tmp_path / "d", use_dora=True)
    elif change == "bias":
        path = save_adapter(tmp_path / "b")
        config = json.loads((tmp_path / "b" / "adapter_config.json").read_text())
        (tmp_path / "b" / "adapter_config.json").write_text(json.dumps({**config,
                                                                        "bias": "all"}))
    elif change == "missing dir":
        path = str(tmp_path / "nowhere")
    with pytest.raises(AdapterError, match=message):
        inspect_adapter(path, base, max_rank)


def test_unsupported_modules_are_refused(tmp_path):
    torch.manual_seed(0)
    model = get_peft_model(LlamaForCausalLM(BASE), LoraConfig(
        r=4, target_modules=["q_proj", "lm_head"], init_lora_weights=False))
    model.save_pretrained(str(tmp_path))
    with pytest.raises(AdapterError, match="lm_head"):
        inspect_adapter(str(tmp_path), BASE.to_dict(), 16)


def test_lora_modules_flag_and_record_round_trip():
    assert parse_lora_module("sql = /adapters/sql ") == ("sql", "/adapters/sql")
    assert parse_lora_module('{"name": "a", "path": "/p"}') == ("a", "/p")
    for bad in ("sql", "=/p", "sql="):
        with pytest.raises(ValueError, match="name=path"):
            parse_lora_module(bad)
    record = LoraRecord("sql", "base", "/adapters/sql", 8, ("q_proj",), created=5, pinned=True)
    assert LoraRecord.from_json(record.to_json()) == record
