"""The default model (SmolLM2-135M-Instruct): greedy outputs equal HF generate, batched together."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from shared.models import DEFAULT_MODEL, load_tokenizer, resolve_model_path
from worker.engine.engine import Engine, EngineConfig
from tests.engine.tiny_models import greedy

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about memory budgets.",
    "Explain continuous batching in one sentence.",
]


@pytest.mark.slow
def test_greedy_equals_hf_generate_on_the_default_model():
    path = resolve_model_path(DEFAULT_MODEL)
    tokenizer = load_tokenizer(path)
    prompts = [list(tokenizer.apply_chat_template([{"role": "user", "content": q}],
                                                  add_generation_prompt=True, tokenize=True)["input_ids"])
               for q in QUESTIONS]
    reference_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    expected = []
    with torch.inference_mode():
        for prompt in prompts:
            # an explicit mask: pad id == <|im_end|> here, which generate would otherwise mask out
            out = reference_model.generate(
                torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                do_sample=False, max_new_tokens=20, eos_token_id=None, pad_token_id=tokenizer.pad_token_id)
            expected.append(out[0, len(prompt):].tolist())
    engine = Engine.from_pretrained(path, EngineConfig(device="cpu", dtype="float32", num_blocks=64),
                                    tokenizer=tokenizer)
    # the first alone, then two batched together that find its system-prompt blocks cached
    assert engine.generate(prompts[:1], greedy(20)) + engine.generate(prompts[1:], greedy(20)) == expected
    stats = engine.stats()
    assert stats.prefix_hit_tokens >= 2 * 16
    assert stats.num_blocks_free == stats.num_blocks_total
