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


@pytest.mark.slow
def test_8bit_kv_caches_keep_the_default_models_greedy_choices():
    """Teacher-forced over 64 tokens of prose: fp8 and int8 caches pick the full-precision
    cache's next token almost everywhere (benchmarks/kv_quality.py measures this at scale)."""
    from pathlib import Path

    from worker.engine.scoring import teacher_forced_logprobs

    path = resolve_model_path(DEFAULT_MODEL)
    tokenizer = load_tokenizer(path)
    corpus = Path(__file__).resolve().parents[2] / "benchmarks" / "data" / "kv_corpus.txt"
    passages = corpus.read_text().split("\n\n")[:2]
    texts = [tokenizer(p)["input_ids"][:96] for p in passages]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    argmax = {}
    for kv_dtype in ("fp32", "fp8", "int8"):
        engine = Engine(model, EngineConfig(device="cpu", dtype="float32", kv_dtype=kv_dtype,
                                            num_blocks=32, enable_prefix_caching=False))
        argmax[kv_dtype] = torch.stack([lp.argmax(-1) for _, lp in
                                        teacher_forced_logprobs(engine, texts, context_len=32)])
    for kv_dtype in ("fp8", "int8"):
        agreement = (argmax[kv_dtype] == argmax["fp32"]).float().mean().item()
        assert agreement >= 0.95, f"{kv_dtype}: {agreement:.1%}"
