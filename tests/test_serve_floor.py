"""A serving workload's floor on this machine (benchmarks/serve_floor.py): the work it must do,
the fewest steps it allows, and the ceiling a throughput target is judged against."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from benchmarks.roofline import ModelCost
from benchmarks.serve_floor import Ceilings, Workload, floor, model_cost, reachable
from kvfleet.shared.model_shapes import shape_config


@pytest.fixture(scope="module")
def cost() -> ModelCost:
    with torch.device("meta"):
        return ModelCost.of(AutoModelForCausalLM.from_config(shape_config("llama-3.2-1b")))


def test_a_prompt_alone_costs_what_the_roofline_counts_for_its_prefill(cost):
    one = Workload((300,), (1,), (0,), 1)
    assert one.flops(cost) == pytest.approx(cost.prefill_flops([300]))
    assert one.decode_steps() == 0


def test_each_decode_row_costs_its_products_and_attention_over_its_context(cost):
    base = Workload((10,), (1,), (0,), 1).flops(cost)
    three = Workload((10,), (4,), (0,), 1).flops(cost)  # rows at contexts 11, 12, 13
    attention = 4 * cost.num_layers * cost.q_width * (11 + 12 + 13)
    assert three - base == pytest.approx(cost.decode_step_flops(3) + attention)


def test_cached_tokens_are_not_computed_but_attended_to(cost):
    cold = Workload((576,), (1,), (0,), 1).flops(cost)
    warm = Workload((576,), (1,), (512,), 1).flops(cost)
    products = 2 * cost.active_layer_params * 512
    pairs = 512 * 513 / 2  # the cached tokens' own pairs; the suffix still attends to them
    assert cold - warm == pytest.approx(products + 4 * cost.num_layers * cost.q_width * pairs)


def test_a_shared_prefix_is_computed_once_per_distinct_prefix():
    w = Workload.uniform(prompts=6, input_len=576, output_len=96, concurrency=4,
                         shared_prefix=512, distinct_prefixes=2)
    assert w.cached == (0, 0, 512, 512, 512, 512)
    assert Workload.uniform(3, 100, 5, 2).cached == (0, 0, 0)


def test_the_fewest_steps_are_the_longest_request_or_the_rows_over_the_concurrency():
    assert Workload((8,) * 4, (10, 10, 10, 100), (0,) * 4, 4).decode_steps() == 99
    # 48 requests of 128 tokens, 32 in flight: 48 * 127 rows, at most 32 a step
    assert Workload.uniform(48, 256, 128, 32).decode_steps() == -(-48 * 127 // 32)


def test_the_floor_is_the_larger_bound_and_the_ceiling_follows(cost):
    w = Workload.uniform(24, 256, 64, 16)
    weights = cost.decode_step_bytes(1, 0, 2)["weights"]
    slow_compute = floor(w, cost, peak_flops=1e11, bandwidth=1e12)
    assert slow_compute.bound_by == "compute"
    assert slow_compute.seconds == pytest.approx(w.flops(cost) / 1e11)
    assert slow_compute.ceiling == pytest.approx(24 * 64 / slow_compute.seconds)
    slow_memory = floor(w, cost, peak_flops=1e16, bandwidth=1e9)
    assert slow_memory.bound_by == "memory"
    assert slow_memory.seconds == pytest.approx(w.decode_steps() * weights / 1e9)
    assert slow_compute.share(slow_compute.ceiling / 2) == pytest.approx(0.5)


def test_a_target_is_reachable_only_below_the_ceiling():
    assert reachable(1.2, 0.8)
    assert not reachable(1.2, 0.9)
    assert not reachable(1.5, 0.7)


def test_bad_workloads_are_refused():
    with pytest.raises(ValueError):
        Workload((10, 10), (5,), (0, 0), 1)
    with pytest.raises(ValueError):
        Workload((10,), (5,), (10,), 1)  # a prompt wholly cached computes nothing to sample from
    with pytest.raises(ValueError):
        Workload((10,), (0,), (0,), 1)
    with pytest.raises(ValueError):
        Workload((10,), (5,), (0,), 0)


def test_a_models_cost_comes_from_its_config_alone():
    cost, shape = model_cost("random:llama-3.2-1b")
    assert shape == (2048, 8192)
    assert cost.head_params == 49152 * 2048 and cost.num_layers == 16


def test_the_ceilings_are_measured_here(monkeypatch):
    from benchmarks import serve_floor
    with torch.device("meta"):
        small = ModelCost.of(AutoModelForCausalLM.from_config(shape_config(
            "llama-3.2-1b", hidden_size=128, intermediate_size=256, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=32)))
    monkeypatch.setattr(serve_floor, "model_cost", lambda model: (small, (128, 256)))
    ceilings = serve_floor.measure("random:llama-3.2-1b", dtypes=(torch.float32,))
    assert isinstance(ceilings, Ceilings)
    assert ceilings.best.peak > 1e8 and ceilings.bandwidth > 1e8
    got = ceilings.floor(Workload.uniform(2, 16, 4, 2))
    assert got.peak_flops == ceilings.best.peak and "float32" in got.peak_by
    assert got.seconds > 0 and got.ceiling == pytest.approx(8 / got.seconds)
