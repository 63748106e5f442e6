"""Teacher-forced scoring through the paged cache, against the model's own full forward."""

from __future__ import annotations

import pytest
import torch

from tests.engine.tiny_models import random_prompt
from kvfleet.worker.engine.scoring import teacher_forced_logprobs


def full_forward_logprobs(tiny, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        logits = tiny.model(torch.tensor([tokens])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)  # [n, vocab]


def score(engine, sequences, context_len):
    return {p: lp for p, lp in teacher_forced_logprobs(engine, sequences, context_len)}


def test_full_precision_cache_scores_like_the_full_forward(tiny_llama):
    sequences = [random_prompt(40, seed=70 + i) for i in range(3)]
    engine = tiny_llama.engine(kv_dtype="fp32")
    scored = score(engine, sequences, context_len=8)
    assert sorted(scored) == list(range(7, 39))
    for i, tokens in enumerate(sequences):
        reference = full_forward_logprobs(tiny_llama, tokens)
        for position, logprobs in scored.items():
            assert torch.allclose(logprobs[i], reference[position], atol=1e-4)
    assert engine.stats().num_blocks_free == engine.stats().num_blocks_total


@pytest.mark.parametrize("kv_dtype, max_kl", [("int8", 3e-3), ("fp8", 6e-2), ("bf16", 1e-3)])
def test_smaller_formats_cost_a_little_measurable_divergence(tiny_llama, kv_dtype, max_kl):
    sequences = [random_prompt(40, seed=80 + i) for i in range(3)]
    reference = score(tiny_llama.engine(kv_dtype="fp32"), sequences, 8)
    tested = score(tiny_llama.engine(kv_dtype=kv_dtype), sequences, 8)
    kls = [torch.sum(reference[p].exp() * (reference[p] - tested[p]), dim=-1).mean().item()
           for p in reference]
    mean_kl = sum(kls) / len(kls)
    assert 0 < mean_kl < max_kl
    # the first position is computed by the prefill chunk alone (fresh K/V): no divergence yet
    assert kls[0] == pytest.approx(0, abs=1e-6)


def test_sequences_of_different_lengths_are_refused(tiny_llama):
    engine = tiny_llama.engine()
    with pytest.raises(ValueError, match="one length"):
        list(teacher_forced_logprobs(engine, [[3, 4, 5], [3, 4]], 1))
