"""The default model (SmolLM2-135M-Instruct): greedy outputs equal HF generate, batched together."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from kvfleet.shared.models import DEFAULT_MODEL, load_tokenizer, resolve_model_path
from kvfleet.worker.cpu_share import cpu_share
from kvfleet.worker.engine.engine import Engine, EngineConfig
from tests.engine.tiny_models import greedy

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about memory budgets.",
    "Explain continuous batching in one sentence.",
]


@pytest.fixture
def two_threads():
    """The teacher-forced tests compute the default model over 24 windows x 80 tokens, 2 or 3
    times: not a tiny model's steps (tests/engine/conftest.py's one thread), a second thread where
    this process may use one takes 40 % off their time (28.6 s -> 17.5 s and 16.2 s -> 9.5 s on a
    2-core Zen 4). Their verdicts are bounds 5-8 standard deviations below the agreement measured,
    far outside a thread count's rounding (there, 1 -> 2 threads: fp8 95.75 % -> 95.66 %, int8
    98.18 % -> 98.61 %, bf16 97.14 % and 96.96 % both times)."""
    before = torch.get_num_threads()
    torch.set_num_threads(max(1, min(2, cpu_share())))
    try:
        yield
    finally:
        torch.set_num_threads(before)


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
    # blocks of 16: the shared system prompt (~30 tokens) fills one, which the later prompts reuse
    engine = Engine.from_pretrained(path, EngineConfig(device="cpu", dtype="float32", num_blocks=64,
                                                       block_size=16),
                                    tokenizer=tokenizer)
    # the first alone, then two batched together that find its system-prompt blocks cached
    assert engine.generate(prompts[:1], greedy(20)) + engine.generate(prompts[1:], greedy(20)) == expected
    stats = engine.stats()
    assert stats.prefix_hit_tokens >= 2 * 16
    assert stats.num_blocks_free == stats.num_blocks_total


# Measured on 1,728 positions (24 windows x 72; AMD EPYC Zen4, torch 2.13.0 CPU), and again with every
# weight multiplied by (1 + 1e-6 N(0, 1)) — rounding noise of the size another CPU's matmul kernels
# add — three variants in all: fp8 agreement 94.85–95.08 %, mean KL 9.2–9.6e-3; int8 agreement
# 98.96–99.31 %, mean KL 4.5–4.8e-4 (on 2,048 positions of 8 x 256 tokens: fp8 95.0–95.6 %, int8
# 98.6–98.9 %). The test now scores 1,152 positions (24 windows x 48: half a minute less on a
# 2-core Xeon); there, on an Intel Xeon with AMX: fp8 95.92 %, mean KL 7.1e-3; int8 98.61 %,
# 4.2e-4. The bounds sit 5-7 binomial standard deviations below the agreement measured (sd ~0.6 %
# at fp8's rate over 1,152 positions) and at 2x or more the KL measured: far outside rounding
# noise, yet int8 without its Hadamard rotation (KL 3.3x higher, docs/BENCHMARKS.md) fails its bound.
KV_QUALITY_BOUNDS = {"fp8": (0.92, 2.0e-2), "int8": (0.97, 1.0e-3)}  # (min agreement, max mean KL)


def corpus_windows(tokenizer, windows_per_passage: int = 3, window_len: int = 104) -> list[list[int]]:
    """Consecutive windows of the KV-quality corpus's passages (each passage has >= 314 tokens)."""
    from pathlib import Path

    corpus = Path(__file__).resolve().parents[2] / "benchmarks" / "data" / "kv_corpus.txt"
    windows = []
    for passage in corpus.read_text().split("\n\n"):
        ids = tokenizer(passage)["input_ids"]
        windows += [ids[i * window_len:(i + 1) * window_len] for i in range(windows_per_passage)]
    assert all(len(w) == window_len for w in windows)
    return windows


@pytest.mark.slow
@pytest.mark.usefixtures("two_threads")
def test_8bit_kv_caches_keep_the_default_models_greedy_choices():
    """Teacher-forced over 24 windows x 48 positions (1,152 next-token choices of prose): fp8 and
    int8 caches pick the fp32 cache's next token almost everywhere, and their next-token
    distributions stay close (mean KL), within bounds derived from measurement (see above)."""
    from kvfleet.worker.engine.scoring import teacher_forced_logprobs

    path = resolve_model_path(DEFAULT_MODEL)
    tokenizer = load_tokenizer(path)
    texts = corpus_windows(tokenizer, window_len=80)  # 48 positions after a 32-token context
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    logprobs = {}
    for kv_dtype in ("fp32", "fp8", "int8"):
        engine = Engine(model, EngineConfig(device="cpu", dtype="float32", kv_dtype=kv_dtype,
                                            num_blocks=len(texts) * 7 + 8,
                                            enable_prefix_caching=False))
        logprobs[kv_dtype] = torch.stack([lp for _, lp in
                                          teacher_forced_logprobs(engine, texts, context_len=32)])
    reference = logprobs["fp32"]  # [positions, windows, vocab]
    assert reference.shape[:2] == (48, 24)
    for kv_dtype, (min_agreement, max_kl) in KV_QUALITY_BOUNDS.items():
        tested = logprobs[kv_dtype]
        agreement = (tested.argmax(-1) == reference.argmax(-1)).float().mean().item()
        mean_kl = (reference.exp() * (reference - tested)).sum(-1).mean().item()
        print(f"{kv_dtype} cache: agreement with fp32 {agreement:.2%}, mean KL {mean_kl:.2e}")
        assert agreement >= min_agreement, f"{kv_dtype}: agreement {agreement:.2%}"
        assert mean_kl <= max_kl, f"{kv_dtype}: mean KL {mean_kl:.2e}"


# bf16 bounds. Measured on 1,728 teacher-forced positions (24 windows x 72; AMD EPYC Zen4 with
# AVX512-BF16, torch 2.13.0 CPU): the engine in bf16 agrees with HF's bf16 forward on 97.7 % and
# with float32 on 96.4 % (HF bf16 itself with float32: 96.5 %). With the C++ decode kernel
# (`--attention-backend cpu`, auto on a CPU) on an Intel Xeon with AMX: 97.4 % and 96.1 % (HF bf16 with
# float32 there: 96.1 %); on an AMD EPYC with AVX2 only (bf16 emulated, fused layers over F.linear):
# 97.63 % and 96.35 % (HF bf16 with float32 96.64 %). The test now scores the first 48 positions of
# each window (1,152; a minute less where bf16 is emulated): on that AVX2 EPYC 97.57 % and 96.35 %
# (HF bf16 with float32 96.53 %). Both sides round in bf16 in differently shaped matmuls, so they
# part where two candidates lie within bf16 rounding; another CPU's kernels (AMX tiles, or bf16
# emulated on AVX2) round elsewhere. The bounds sit ~8 binomial standard deviations (0.45-0.55 %
# at these rates over 1,152 positions) below the measurements: no verdict hinges on one CPU's
# rounding, while a real defect (a lost position, bf16 RoPE angles, a wrong cache read) falls far
# below them.
BF16_BOUNDS = {"hf_bf16": 0.94, "fp32": 0.92}  # min next-token agreement


def hf_next_token_logprobs(path: str, dtype: torch.dtype, texts: list[list[int]],
                           context_len: int) -> torch.Tensor:
    """HF's own forward over whole windows: log-probs [positions, windows, vocab] of each next
    token from position context_len - 1 on (the positions teacher_forced_logprobs yields)."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    with torch.inference_mode():
        logits = model(torch.tensor(texts)).logits[:, context_len - 1:-1]
    return torch.log_softmax(logits.float(), dim=-1).transpose(0, 1)


@pytest.mark.slow
@pytest.mark.usefixtures("two_threads")
def test_bf16_engine_follows_hf_in_bf16_on_the_default_model():
    """Teacher-forced over 24 windows x 48 positions of prose (1,152 next-token choices): the
    engine in bf16 picks the token HF's bf16 forward picks almost everywhere, and float32's
    nearly as often. Teacher forcing judges every position on the same context, so one early
    difference does not decide the verdict as it would in a free-running comparison."""
    from kvfleet.worker.engine.scoring import teacher_forced_logprobs

    path = resolve_model_path(DEFAULT_MODEL)
    texts = corpus_windows(load_tokenizer(path), window_len=80)  # 48 positions after 32 tokens
    hf_bf16 = hf_next_token_logprobs(path, torch.bfloat16, texts, context_len=32)
    hf_fp32 = hf_next_token_logprobs(path, torch.float32, texts, context_len=32)
    engine = Engine.from_pretrained(path, EngineConfig(
        device="cpu", dtype="bfloat16", num_blocks=len(texts) * 7 + 8, enable_prefix_caching=False))
    tested = torch.stack([lp for _, lp in teacher_forced_logprobs(engine, texts, context_len=32)])
    assert tested.shape == hf_bf16.shape == (48, 24, hf_bf16.shape[-1])
    choices = tested.argmax(-1)
    agreement = {"hf_bf16": (choices == hf_bf16.argmax(-1)).float().mean().item(),
                 "fp32": (choices == hf_fp32.argmax(-1)).float().mean().item()}
    hf_own = (hf_bf16.argmax(-1) == hf_fp32.argmax(-1)).float().mean().item()
    print(f"bf16 engine next-token agreement: with HF bf16 {agreement['hf_bf16']:.2%}, with fp32 "
          f"{agreement['fp32']:.2%} (HF bf16 with fp32: {hf_own:.2%})")
    for reference, bound in BF16_BOUNDS.items():
        assert agreement[reference] >= bound, f"{reference}: agreement {agreement[reference]:.2%}"
