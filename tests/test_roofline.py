"""What the benchmarks judge against: a model's FLOPs and bytes (benchmarks/roofline.py)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from benchmarks.roofline import ModelCost, peak_product_rate, read_bandwidth
from shared.model_shapes import shape_config


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
    rates = peak_product_rate(torch.float32, 256, 512, rows=64)
    assert rates["peak"] == max(rates["kvfleet"], rates["F.linear"]) > 1e8
    assert read_bandwidth(64 << 20) > 1e8
