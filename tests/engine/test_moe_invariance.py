"""A mixture-of-experts model at the default `--deterministic`: a request's tokens, logprobs and
final hidden rows are bit-identical alone, in a batch, with its prompt chunked and when it
resumes from a checkpoint (what a worker does after another died), in bf16 and float32.

Its layers are the fused CPU layer (cpu_layers.py) around the model's sparse block, whose router
computes its logits in kvfleet's product (cpu_experts.PackedRouter) and whose experts compute in
it (one grouped call a layer, or one product per expert): every sum in one order whatever the
other rows of the step. The model is a tiny Qwen3-MoE whose heads are 64 wide (the C++ kernels'
vectorised paths) with transformers' default initialisation, so its router scores and logits are
close together as a real model's are. The checks are those of test_batch_invariance.py."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from tests.engine.test_batch_invariance import (DTYPES, MAX_TOKENS, alone, make_engine, requests,
                                                run)
from tests.engine.tiny_models import VOCAB
from kvfleet.worker.engine.kernels.cpu_experts import PackedRouter


@pytest.fixture(scope="module")
def wide_moe() -> Qwen3MoeForCausalLM:
    torch.manual_seed(4323)
    config = Qwen3MoeConfig(hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=64, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                            decoder_sparse_step=1, mlp_only_layers=[], vocab_size=VOCAB,
                            max_position_embeddings=512, eos_token_id=2, bos_token_id=1,
                            pad_token_id=0)
    return Qwen3MoeForCausalLM(config).eval()


@pytest.fixture(scope="module", params=DTYPES, ids=["bf16", "float32"])
def moe_reference(request, wide_moe):
    dtype = request.param
    return (dtype, *alone(wide_moe, dtype, requests()))


def test_an_moe_engine_reports_itself_batch_invariant(wide_moe):
    engine = make_engine(wide_moe, torch.bfloat16)
    assert engine.invariance_gap is None
    assert engine.device_report().endswith("; batch-invariant")


@pytest.mark.parametrize("case", ["batched", "chunked", "resumed"])
def test_an_moe_request_gets_its_lone_answer_bit_for_bit(moe_reference, wide_moe, case):
    dtype, expected, hidden = moe_reference
    reqs = requests()
    engine = make_engine(wide_moe, dtype, **({"max_batched_tokens": 16} if case == "chunked"
                                             else {}))
    if case == "resumed":
        for k in (1, MAX_TOKENS - 3):
            got = run(engine, reqs, prefix=f"k{k}-", sent=[expected[i][0][:k] for i in expected])
            for i in expected:
                assert got[i][0] == expected[i][0][k:], f"request {i} resumed after {k} ({dtype})"
                assert got[i][1] == expected[i][1][k:], f"request {i} resumed after {k} ({dtype})"
    else:
        got = run(engine, reqs)
        for i in expected:
            assert got[i] == expected[i], f"request {i} ({case}, {dtype})"
    engine.hidden.assert_same_as(hidden, f"{case}, {dtype}")


def test_a_router_that_depends_on_the_batch_is_seen(moe_reference, wide_moe):
    """The control: the same checks fail when the routers' logits depend on how many rows came
    with them (a constructed difference, not a rounding: in steps of more than one row expert
    0's logit is raised by 2, which moves tokens to it and changes their routing weights)."""
    dtype, _, hidden = moe_reference
    engine = make_engine(wide_moe, dtype)
    routers = [m for m in engine.model.modules() if isinstance(m, PackedRouter)]
    assert routers
    for router in routers:
        router.product.register_forward_hook(
            lambda module, args, out: _raise_expert_0(out) if args[0].shape[0] > 1 else out)
    run(engine, requests())
    with pytest.raises(AssertionError, match="positions differ"):
        engine.hidden.assert_same_as(hidden, "a router that depends on the batch")


def _raise_expert_0(logits: torch.Tensor) -> torch.Tensor:
    raised = logits.clone()
    raised[:, 0] += 2.0
    return raised
