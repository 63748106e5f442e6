"""What the benchmarks judge against: a model's FLOPs and bytes (benchmarks/roofline.py)."""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from benchmarks.roofline import (ModelCost, ProductRates, peak_product_rate,
                                 product_implementations, product_rates, read_bandwidth)
from kvfleet.shared.cpu_features import cpu_features
from kvfleet.shared.model_shapes import shape_config
from kvfleet.worker.engine.kernels import cpu_kernels, cpu_linear, torch_private


def meta_model(name: str, **overrides):
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(shape_config(name, **overrides))


def test_a_dense_shape_costs_its_weights_and_kv():
    model = meta_model("llama-3.2-1b")
    cost = ModelCost.of(model)
    layer = 2048 * 2048 * 2 + 2048 * 512 * 2 + 3 * 2048 * 8192 + 2 * 2048  # q,o k,v mlp norms
    assert cost.layer_params == 16 * layer and cost.expert_params == 0
    assert cost.head_params == 49152 * 2048
    assert cost.prefill_flops([3]) == 2 * 16 * layer * 3 + 4 * 16 * 2048 * 6 + 2 * 49152 * 2048
    step = cost.decode_step_bytes(streams=4, mean_context=100, elem=2)
    assert step["weights"] == (16 * layer + 49152 * 2048) * 2
    assert step["kv"] == 4 * 100 * 16 * 2 * 512 * 2
    assert cost.decode_step_flops(4) == 2 * (16 * layer + 49152 * 2048) * 4


def test_an_moe_step_reads_the_experts_its_tokens_route_to():
    cost = ModelCost.of(meta_model("qwen3-moe-30b-a3b-8l32e"))
    per_expert = 3 * 2048 * 768
    assert cost.expert_params == 8 * 32 * per_expert
    assert (cost.num_experts, cost.experts_per_token) == (32, 8)
    assert cost.active_layer_params == cost.layer_params - cost.expert_params * 3 / 4
    one = cost.decode_step_bytes(1, 0, 2)["weights"]
    many = cost.decode_step_bytes(64, 0, 2)["weights"]
    dense_part = (cost.layer_params - cost.expert_params + cost.head_params) * 2
    assert one == pytest.approx(dense_part + cost.expert_params * 2 / 4)  # 8 of 32 experts
    assert dense_part + cost.expert_params * 2 * 0.99 < many <= dense_part + cost.expert_params * 2


def test_the_ceilings_are_measured():
    rates = peak_product_rate(torch.float32, 256, 512, rows=64, round_seconds=0.01)
    assert {"kvfleet", "F.linear", "peak"} <= set(rates)
    assert rates["peak"] == max(rates.values()) > 1e8
    assert read_bandwidth(64 << 20) > 1e8


def _slow_linear(linear):
    def call(x):
        time.sleep(0.002)
        return F.linear(x, linear.weight)
    return call


def _broken(linear):
    raise RuntimeError("not on this CPU\nsecond line")


def test_the_peak_is_the_fastest_implementation_and_names_it():
    fake = {"slow": _slow_linear,
            "fast": lambda linear: lambda x: F.linear(x, linear.weight),
            "wrong": lambda linear: lambda x: torch.zeros(x.shape[0], linear.out_features),
            "broken": _broken}
    rates = product_rates(torch.float32, 32, 64, rows=4, implementations=fake,
                          round_seconds=0.01)
    assert set(rates.rates) == {"slow", "fast"}
    assert rates.peak == rates.rates["fast"] > rates.rates["slow"] and rates.peak_by == "fast"
    assert "disagrees with F.linear" in rates.skipped["wrong"]
    assert rates.skipped["broken"] == "RuntimeError: not on this CPU"
    assert rates.as_dict() == rates.rates | {"peak": rates.peak}  # no engine product timed
    line = rates.describe()
    assert line.startswith("float32 [4, 32] x [32, 64] (")
    assert f"peak {rates.peak / 1e9:.0f} by fast" in line
    assert "slow " in line and "broken not timed: RuntimeError" in line


def test_the_line_names_the_peak_the_engine_products_and_amx():
    rates = ProductRates(torch.bfloat16, 512, 2048, 8192,
                         {"kvfleet fma": 200e9, "oneDNN packed": 900e9, "F.linear": 850e9}, "AMX",
                         {"deterministic": "kvfleet fma", "no-deterministic": "oneDNN packed"})
    assert rates.describe() == (
        "bf16 [512, 2048] x [2048, 8192] (AMX): kvfleet fma 200, oneDNN packed 900, F.linear 850 "
        "GFLOP/s; peak 900 by oneDNN packed; the engine computes with kvfleet fma "
        "(--deterministic) / oneDNN packed (--no-deterministic)")
    assert rates.as_dict() == rates.rates | {"kvfleet": 200e9, "peak": 900e9}


def _kvfleet_support(code: int) -> int:
    matmul = cpu_kernels.matmul_kernel()
    return (0 if isinstance(matmul, cpu_kernels.UnavailableKernel)
            else int(matmul.kvfleet_linear_supported(code)))


def _expected_names(dtype: torch.dtype) -> set[str]:
    """What this CPU and torch build have, by the rules product_implementations states."""
    codes = cpu_linear.BF16_FORM_CODES
    names = {"F.linear", "torch.mm"}
    if dtype == torch.float32:
        support = _kvfleet_support(0)
        names |= {cpu_linear.FAST: {"kvfleet fp32"}, cpu_linear.PORTABLE: {"kvfleet portable"}
                  }.get(support, set())
        names |= {"MKL packed"} if torch.backends.mkl.is_available() else set()
    elif _kvfleet_support(codes["dot"]) == cpu_linear.PORTABLE:
        names |= {"kvfleet portable"}
    else:
        names |= {f"kvfleet {form}" for form in ("dot", "fma")
                  if _kvfleet_support(codes[form]) == cpu_linear.FAST}
        names |= {"kvfleet amx"} if cpu_linear.amx_tiles() is None else set()
    if cpu_linear.packing_available(dtype):
        names |= {"oneDNN packed"}
    if torch.backends.mkldnn.is_available() and (
            dtype == torch.float32 or torch_private.onednn_bf16_supported()):
        names |= {"oneDNN unpacked"}
    return names


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_every_implementation_here_is_timed(dtype):
    features = cpu_features()
    rates = product_rates(dtype, 64, 128, rows=8, round_seconds=0.005)
    assert set(product_implementations(dtype)) == _expected_names(dtype)
    assert set(rates.rates) == _expected_names(dtype) and rates.skipped == {}
    assert all(rate > 1e6 for rate in rates.rates.values())
    assert rates.rates[rates.peak_by] == rates.peak == max(rates.rates.values())
    assert rates.isa == features.isa
    assert set(rates.engine) == {"deterministic", "no-deterministic"}
    assert set(rates.engine.values()) <= set(rates.rates)
    assert rates.as_dict()["kvfleet"] == rates.rates[rates.engine["deterministic"]]
    line = rates.describe()
    assert all(f"{name} " in line for name in rates.rates)
    assert f"by {rates.peak_by}" in line and ("no AMX" in line) == (features.isa != "AMX")
    if dtype == torch.bfloat16 and "avx512_bf16" in features.flags and _kvfleet_support(2):
        assert {"kvfleet dot", "kvfleet fma"} <= set(rates.rates)  # an AVX512-BF16 CPU's forms
    if dtype == torch.bfloat16 and features.isa == "AMX" and cpu_linear.packing_available(dtype):
        assert rates.engine["no-deterministic"] == "oneDNN packed"  # the tiles
