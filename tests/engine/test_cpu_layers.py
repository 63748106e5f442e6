"""The fused CPU decoder layer (cpu_layers.py): its C++ element-wise ops against the eager
torch ops they replace, which layers it takes, and the engine with it against HF."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

from tests.engine.tiny_models import greedy, random_prompt, run_to_completion, tokens_before_divergence
from kvfleet.worker.engine.core.config import EngineConfig
from kvfleet.worker.engine.model.cpu_layers import FusedDecoderLayer, FusedRMSNorm, rms_norm, rope_, silu_mul
from kvfleet.worker.engine.engine import Engine

DTYPES = [torch.float32, torch.bfloat16]


def assert_within_rounding(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal but for the last bit of a few elements (an exp or a sum taken in another order)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    ulp = 2 ** -7 if want.dtype == torch.bfloat16 else 2 ** -20
    error = (got.float() - want.float()).abs()
    assert (error <= ulp * want.float().abs().clamp(min=1e-3)).float().mean() > 0.99
    assert error.max() <= 4 * ulp * want.float().abs().max()


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_with_and_without_the_residual_add(dtype):
    torch.manual_seed(0)
    norm = LlamaRMSNorm(96, eps=1e-5)
    norm.weight.data = torch.randn(96)
    norm = norm.to(dtype)
    x, residual = torch.randn(2, 7, 96).to(dtype)
    assert_within_rounding(rms_norm(x, norm.weight, 1e-5), norm(x))
    total = residual + x  # the layer's `residual + attention output`, rounded in dtype
    kept = residual.clone()
    out = rms_norm(x, norm.weight, 1e-5, residual=kept)
    assert torch.equal(kept, total)  # the residual now holds the sum
    assert_within_rounding(out, norm(total))
    assert_within_rounding(FusedRMSNorm(norm)(x.unsqueeze(0)), norm(x.unsqueeze(0)))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_in_place_on_a_strided_view(dtype):
    """q as the fused layer has it: heads of a row sit inside a wider row of q/k/v outputs."""
    torch.manual_seed(1)
    rows, heads, dim = 5, 3, 16
    qkv = torch.randn(rows, heads * dim + 40).to(dtype)
    angles = torch.rand(rows, dim // 2) * 6
    angles = torch.cat([angles, angles], dim=-1)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    q = qkv[:, :heads * dim].view(rows, heads, dim)
    want, _ = apply_rotary_pos_emb(q.transpose(0, 1), q.transpose(0, 1), cos, sin, unsqueeze_dim=0)
    tail = qkv[:, heads * dim:].clone()
    rope_(q, cos, sin)
    assert_within_rounding(q.transpose(0, 1), want)
    assert torch.equal(qkv[:, heads * dim:], tail)  # the rest of each row is untouched


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_times_up(dtype):
    torch.manual_seed(2)
    gate_up = (torch.randn(9, 2 * 80) * 4).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    assert_within_rounding(silu_mul(gate_up), F.silu(gate) * up)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_engine_fuses_llama_family_layers_with_the_cpu_kernel(tiny, dtype):
    layers = tiny.model.config.num_hidden_layers
    engine = tiny.engine(dtype=dtype)
    assert engine.prepared.num_fused_layers == layers
    assert all(type(m) is FusedDecoderLayer for m in engine.model.model.layers)
    assert type(engine.model.model.norm) is FusedRMSNorm
    # 8-bit K/V and gather + SDPA keep HF's layers
    assert tiny.engine(dtype=dtype, kv_dtype="fp8").prepared.num_fused_layers == 0
    assert tiny.engine(dtype=dtype, attention_backend="sdpa").prepared.num_fused_layers == 0


def test_engines_on_one_model_each_prepare_their_own_copy(tiny):
    """Engines built one after another on the same model object (as a benchmark or a test does):
    the first fuses the layers of its own copy; the model keeps HF's layers, so a later engine
    with an 8-bit pool, which the C++ kernel does not read, runs HF's layers on it."""
    model = copy.deepcopy(tiny.model)  # the fixture's model stays as it is
    prompts = [random_prompt(n, seed=90 + i) for i, n in enumerate([5, 23])]
    produced = {}
    for kv_dtype in ("fp32", "int8"):
        engine = Engine(model, EngineConfig(device="cpu", dtype="float32", kv_dtype=kv_dtype,
                                            num_blocks=32, block_size=8))
        fused = kv_dtype == "fp32"
        assert engine.prepared.num_fused_layers == (model.config.num_hidden_layers if fused else 0)
        assert all((type(m) is FusedDecoderLayer) == fused for m in engine.model.model.layers)
        produced[kv_dtype] = engine.generate(prompts, greedy(12))
    assert not any(type(m) is FusedDecoderLayer for m in model.model.layers)
    agreed = sum(tokens_before_divergence(a, b) for a, b in zip(produced["fp32"], produced["int8"]))
    assert agreed >= 0.75 * 2 * 12, produced


def test_fused_layers_decode_what_hf_layers_decode(tiny):
    """bf16, 5 streams decoding together through chunked prefill: the engine with fused layers
    and the engine with HF's layers (gather + SDPA) agree on nearly every greedy token."""
    prompts = [random_prompt(n, seed=60 + i) for i, n in enumerate([4, 11, 19, 30, 45])]
    produced = {}
    for backend in ("cpu", "sdpa"):
        engine = tiny.engine(dtype="bfloat16", attention_backend=backend, max_batched_tokens=32)
        for i, prompt in enumerate(prompts):
            engine.add_request(f"r{i}", prompt, greedy(16))
        produced[backend] = run_to_completion(engine)
    agreed = sum(tokens_before_divergence(produced["cpu"][key], produced["sdpa"][key])
                 for key in produced["sdpa"])
    # measured: 80 of 80 (llama) and 74 of 80 (qwen2) on AVX512-BF16, 57 of 80 (qwen2) on an
    # AVX2-only CPU where bf16 is emulated (a random tiny model's near-tied logits flip with the
    # products' rounding, and a stream's later tokens follow its first difference)
    assert agreed >= 0.6 * 5 * 16, produced
