"""Structured outputs under a LoRA adapter: the grammar's mask applies to an adapter's rows as to
the base model's, in one mixed batch (the adapter changes the logits, never the mask)."""

from __future__ import annotations

import copy
import re

import pytest
import torch
from peft import LoraConfig, get_peft_model

from kvfleet.shared.structured import OutputConstraint
from kvfleet.shared.wire import SamplingParams
from kvfleet.shared.wire.prefix_hash import lora_root
from tests.engine.tiny_models import run_to_completion
from kvfleet.worker.engine.lora import LoraRequest

PROMPT = [5, 17, 42, 99, 7, 3]
REGEX = r"(abc ){3}[0-9]{3}"
CHOICES = ["alpha beta gamma", "alpha beta delta"]
DIGITS = r"[0-9]{2}-[a-z]{4}"
CONSTRAINTS = [OutputConstraint("regex", REGEX), OutputConstraint("regex", DIGITS),
               OutputConstraint.choice(CHOICES)]


@pytest.fixture(scope="module")
def adapter_dir(tiny_bpe_model, tmp_path_factory) -> str:
    torch.manual_seed(3)
    model = get_peft_model(copy.deepcopy(tiny_bpe_model), LoraConfig(
        r=4, lora_alpha=32, target_modules=["q_proj", "v_proj", "gate_proj", "down_proj"],
        init_lora_weights=False))
    directory = tmp_path_factory.mktemp("adapter")
    model.save_pretrained(str(directory))
    return str(directory)


def test_constraints_hold_under_an_adapter_in_a_mixed_batch(make_engine, tokenizer,
                                                             adapter_dir):
    engine = make_engine(enable_lora=True, max_loras=1)
    lora = LoraRequest("tuned", adapter_dir, lora_root("tiny", "tuned", adapter_dir))
    for i, constraint in enumerate(CONSTRAINTS):
        for name in ("base", "tuned"):
            engine.add_request(f"{name}-{i}", PROMPT + [i], SamplingParams(
                max_tokens=40, temperature=1.0, seed=60 + i, constraint=constraint),
                lora=lora if name == "tuned" else None)
    got = run_to_completion(engine)
    texts = {k: tokenizer.decode(v, skip_special_tokens=True) for k, v in got.items()}
    for name in ("base", "tuned"):
        assert re.fullmatch(REGEX, texts[f"{name}-0"]), texts[f"{name}-0"]
        assert re.fullmatch(DIGITS, texts[f"{name}-1"]), texts[f"{name}-1"]
        assert texts[f"{name}-2"] in CHOICES
    # the adapter's rows were computed with its terms: its sampled answers are not the base's
    assert any(got[f"tuned-{i}"] != got[f"base-{i}"] for i in range(len(CONSTRAINTS)))
    assert engine.lora_stats().loads_total == {"tuned": 1}
