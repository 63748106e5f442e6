"""Mixture-of-experts models serve correctly: greedy equal to transformers' own `generate`, their
experts through packed products (cpu_experts.py).

A tiny random Qwen3-MoE and a tiny random Mixtral (8 experts, 2 per token) through the engine,
batched, chunked and joined mid-flight, in float32 token for token; in bf16 against `generate` in
bf16 with the agreement measured (bf16 rounding of a random model's close logits flips some
greedy choices: the bound is on the tokens agreed before the first difference, over enough of
them that no single flip decides).
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import (MixtralConfig, MixtralForCausalLM, Qwen3Config, Qwen3ForCausalLM,
                          Qwen3MoeConfig, Qwen3MoeForCausalLM)

from tests.engine.tiny_models import VOCAB, greedy, random_prompt, tokens_before_divergence
from kvfleet.worker.engine.kernels.cpu_experts import PackedExperts, PackedRouter, as_linear
from kvfleet.worker.engine.kernels.cpu_linear import KernelLinear, packs
from kvfleet.worker.engine.engine import Engine, EngineConfig
from kvfleet.worker.engine.model.cpu_layers import FusedDecoderLayer

_COMMON = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               vocab_size=VOCAB, max_position_embeddings=512, initializer_range=0.25,
               eos_token_id=2, bos_token_id=1, pad_token_id=0, num_experts_per_tok=2)
FACTORIES = {
    "qwen3_moe": lambda: Qwen3MoeForCausalLM(Qwen3MoeConfig(
        **_COMMON, head_dim=16, intermediate_size=128, moe_intermediate_size=32, num_experts=8,
        decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True)),
    "mixtral": lambda: MixtralForCausalLM(MixtralConfig(
        **_COMMON, intermediate_size=48, num_local_experts=8)),
}
LENGTHS = [3, 17, 40, 9]
MAX_TOKENS = [24, 16, 20, 30]


@pytest.fixture(scope="module", params=sorted(FACTORIES))
def moe(request):
    torch.manual_seed(99)
    model = FACTORIES[request.param]().eval()
    model.set_attn_implementation("eager")
    return model


def reference(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt),
                             dtype=torch.long), do_sample=False, max_new_tokens=max_new_tokens,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def serve(model, dtype: str, prompts, max_tokens, join_at=(0, 0, 2, 5)) -> dict[str, list[int]]:
    engine = Engine(copy.deepcopy(model), EngineConfig(device="cpu", dtype=dtype, num_blocks=256,
                                                       block_size=4, max_batched_tokens=16))
    produced: dict[str, list[int]] = {}
    for step in range(10_000):
        for i, at in enumerate(join_at):
            if at == step:
                engine.add_request(f"r{i}", prompts[i], greedy(max_tokens[i]))
        if step > max(join_at) and not engine.has_unfinished():
            return produced
        for out in engine.step():
            produced.setdefault(out.req_id, []).extend(out.new_token_ids)
    raise AssertionError("engine did not finish")


def test_float32_greedy_equals_transformers_generate(moe):
    prompts = [random_prompt(n, seed=70 + i) for i, n in enumerate(LENGTHS)]
    produced = serve(moe, "float32", prompts, MAX_TOKENS)
    for i, (prompt, n) in enumerate(zip(prompts, MAX_TOKENS)):
        assert produced[f"r{i}"] == reference(moe, prompt, n), f"request r{i}"


def test_bf16_agrees_with_transformers_generate_in_bf16(moe):
    lengths = [5, 11, 23, 31, 8, 14, 40, 2]
    prompts = [random_prompt(n, seed=90 + i) for i, n in enumerate(lengths)]
    max_tokens = [24] * len(prompts)
    produced = serve(moe, "bfloat16", prompts, max_tokens, join_at=(0,) * len(prompts))
    bf16 = copy.deepcopy(moe).to(torch.bfloat16)
    agreed = sum(tokens_before_divergence(produced[f"r{i}"], reference(bf16, p, n))
                 for i, (p, n) in enumerate(zip(prompts, max_tokens)))
    # measured on a Xeon with AVX512-BF16 (both forms of the bf16 product): qwen3_moe 155 and
    # mixtral 90 of 192 tokens before the first difference; the bound leaves room for other CPUs'
    # rounding (a random model's close router scores flip experts under bf16)
    assert agreed >= 0.25 * sum(max_tokens), agreed


def test_decode_steps_batch_the_streams(moe):
    """4 streams of 12 tokens in far fewer than 48 steps: an MoE's decode rows go through the
    experts together, and their KV stays as the engine's paged cache holds it."""
    engine = Engine(copy.deepcopy(moe), EngineConfig(device="cpu", dtype="float32", num_blocks=256,
                                                     block_size=4, max_batched_tokens=256))
    prompts = [random_prompt(6, seed=i) for i in range(4)]
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, greedy(12))
    produced: dict[str, list[int]] = {}
    steps = 0
    while engine.has_unfinished():
        steps += 1
        for out in engine.step():
            produced.setdefault(out.req_id, []).extend(out.new_token_ids)
    assert steps <= 13
    for i, p in enumerate(prompts):
        assert produced[f"r{i}"] == reference(moe, p, 12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_experts_compute_what_transformers_experts_do(moe, dtype):
    """The experts block through packed products (cpu_experts.py) against transformers' own, on
    random routing of 37 tokens (some experts hit by none): within a rounding of the dtype."""
    experts = copy.deepcopy(moe.model.layers[0].mlp.experts).to(dtype)
    if not packs(dtype):
        # an AVX2-only CPU: bf16 is emulated, nothing packs it, the experts stay in transformers'
        pytest.skip(f"{dtype} weights do not pack on a CPU without native bf16: the experts "
                    "stay in transformers' F.linear there, nothing of ours to compare")
    packed = PackedExperts(experts)
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(37, experts.gate_up_proj.shape[2], generator=g).to(dtype)
    index = torch.stack([torch.randperm(6, generator=g)[:2] for _ in range(37)])  # experts 0-5
    weights = torch.softmax(torch.randn(37, 2, generator=g), dim=-1).to(dtype)
    with torch.inference_mode():
        expected = experts(hidden, index, weights).double()
        got = packed(hidden, index, weights).double()
    tolerance = 2 ** -6 if dtype == torch.bfloat16 else 1e-5
    assert (got - expected).abs().max().item() <= tolerance * expected.abs().max().item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_experts_compute_the_per_expert_products_bits(moe, dtype):
    """One kvfleet_linear_groups call for every expert's gate/up product and one for the down
    products give bit for bit what one kvfleet product per expert gives, for 1, 2 and 37 tokens
    (the groups' rows from 0 to many, some experts hit by none). On a CPU without AVX-512 the
    calls take the portable product, one group at a time, and on one with AMX tiles
    kvfleet_amx_linear_groups in bf16: the same comparison."""
    experts = copy.deepcopy(moe.model.layers[0].mlp.experts).to(dtype)
    grouped = PackedExperts(experts, grouped=True)
    loop = PackedExperts(experts, grouped=False)
    # the loop over kvfleet's own product (KernelLinear), whatever products this CPU prefers
    loop.gate_up = torch.nn.ModuleList(KernelLinear(as_linear(w)) for w in experts.gate_up_proj)
    loop.down = torch.nn.ModuleList(KernelLinear(as_linear(w)) for w in experts.down_proj)
    g = torch.Generator().manual_seed(5)
    for tokens in (1, 2, 37):
        hidden = torch.randn(tokens, experts.gate_up_proj.shape[2], generator=g).to(dtype)
        index = torch.stack([torch.randperm(6, generator=g)[:2] for _ in range(tokens)])
        weights = torch.softmax(torch.randn(tokens, 2, generator=g), dim=-1).to(dtype)
        with torch.inference_mode():
            got = copy.deepcopy(grouped)(hidden, index, weights)  # a copy: packed weights shared
            want = loop(hidden, index, weights)
        assert torch.equal(got, want), tokens
    # control: two experts' packed weights swapped in the grouped call change its output
    swapped = copy.deepcopy(grouped)
    swapped._gate_up_at = swapped._gate_up_at[[1, 0, *range(2, grouped.num_experts)]]
    index = torch.tensor([[0, 2], [1, 3]])
    with torch.inference_mode():
        assert not torch.equal(swapped(hidden[:2], index, weights[:2]),
                               grouped(hidden[:2], index, weights[:2]))


def test_an_engine_packs_the_experts_of_every_moe_layer(moe):
    engine = Engine(copy.deepcopy(moe), EngineConfig(device="cpu", dtype="float32", num_blocks=64,
                                                     block_size=4))
    kinds = {type(layer.mlp.experts) for layer in engine.model.model.layers}
    assert kinds == {PackedExperts}
    # the layers around the experts are the fused CPU layer's (cpu_layers.py), so the float32
    # and bf16 comparisons with `generate` above run through them
    assert engine.prepared.num_fused_layers == moe.config.num_hidden_layers
    assert all(type(layer) is FusedDecoderLayer for layer in engine.model.model.layers)
    # the routers' logits through a packed product too (cpu_experts.PackedRouter)
    assert all(type(layer.mlp.gate) is PackedRouter for layer in engine.model.model.layers)


def test_qwen3_dense_layers_fuse_with_their_head_norms():
    """Qwen3's dense layers (an RMSNorm over each q and k head before RoPE) through the fused
    layer: float32 greedy equal to `generate` token for token, batched and joined mid-flight."""
    torch.manual_seed(98)
    model = Qwen3ForCausalLM(Qwen3Config(**{**_COMMON, "num_experts_per_tok": None}, head_dim=16,
                                         intermediate_size=128)).eval()
    model.set_attn_implementation("eager")
    engine = Engine(copy.deepcopy(model), EngineConfig(device="cpu", dtype="float32",
                                                       num_blocks=64, block_size=4))
    assert engine.prepared.num_fused_layers == model.config.num_hidden_layers
    prompts = [random_prompt(n, seed=40 + i) for i, n in enumerate(LENGTHS)]
    produced = serve(model, "float32", prompts, MAX_TOKENS)
    for i, (prompt, n) in enumerate(zip(prompts, MAX_TOKENS)):
        assert produced[f"r{i}"] == reference(model, prompt, n), f"request r{i}"


def test_a_negative_control_the_head_norms_matter():
    """The Qwen3 comparison above can fail: the same model with its q norm's weights changed
    after `generate`'s reference was taken answers differently."""
    torch.manual_seed(98)
    model = Qwen3ForCausalLM(Qwen3Config(**{**_COMMON, "num_experts_per_tok": None}, head_dim=16,
                                         intermediate_size=128)).eval()
    model.set_attn_implementation("eager")
    prompts = [random_prompt(n, seed=40 + i) for i, n in enumerate(LENGTHS)]
    expected = [reference(model, p, n) for p, n in zip(prompts, MAX_TOKENS)]
    changed = copy.deepcopy(model)
    with torch.no_grad():
        for layer in changed.model.layers:
            layer.self_attn.q_norm.weight.mul_(3.0)
    produced = serve(changed, "float32", prompts, MAX_TOKENS)
    assert any(produced[f"r{i}"] != expected[i] for i in range(len(prompts)))
