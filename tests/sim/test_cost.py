"""The simulated worker's cost models (worker/sim/cost.py) and accelerators: expectations are
worked out here from the published numbers (datasheets, model cards), not read off the code."""

from __future__ import annotations

import pytest
import torch

from kvfleet.shared.model_shapes import SHAPES, shape_config
from kvfleet.shared.pace import StepCostCurve, StepFeatures
from kvfleet.shared.wire import Heartbeat
from kvfleet.worker.sim.accelerators import ACCELERATORS, accelerator
from kvfleet.worker.sim.cost import (MeasuredCost, ModelShape, RooflineCost, measured_cost_from_file,
                             measured_cost_from_heartbeat, step_cost)

GIB = 1 << 30
VOCAB = 49_152  # the shapes' vocabulary (SmolLM2's)
# Llama-3.1-8B's published parameter count less what its 128,256-token vocabulary adds beyond
# the shapes' (untied: embeddings and LM head)
LLAMA_8B_PARAMS = 8_030_261_248 - (128_256 - VOCAB) * 4096 * 2
LLAMA_8B_KV_PER_TOKEN = 2 * 32 * 8 * 128 * 2  # K and V x layers x KV heads x head_dim x bf16
LLAMA_70B_PARAMS = 70_553_706_496 - (128_256 - VOCAB) * 8192 * 2
H100_BANDWIDTH, H200_BANDWIDTH = 3.35e12, 4.8e12  # datasheets, B/s
H100_BF16 = 989e12  # datasheet, dense
# Qwen3-30B-A3B's published config (the MoE shape is its layer cut down): 30.5B params, 3.3B
# activated per token
QWEN3_30B_A3B = dict(model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144,
                     moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32,
                     num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                     vocab_size=151_936, tie_word_embeddings=False, decoder_sparse_step=1,
                     mlp_only_layers=[], attention_bias=False)


def meta_params(config) -> int:
    from transformers import AutoModelForCausalLM
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


# ---- shapes ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_a_shapes_parameters_are_those_transformers_builds(name):
    config = shape_config(name)
    built = meta_params(config)
    assert ModelShape.named(name).total_params == built
    # a loaded model's config (what a simulated worker reads from the model's directory)
    loaded = ModelShape.from_config(config.to_dict() | {"_name_or_path": f"models/x-{name}"})
    assert loaded.total_params == built and loaded.name == f"x-{name}"


def test_biases_are_counted_where_a_config_has_them():
    config = shape_config("llama-3.2-1b", num_hidden_layers=2, attention_bias=True,
                          mlp_bias=True)
    assert ModelShape.from_config(config.to_dict()).total_params == meta_params(config)


def test_the_shapes_match_the_published_counts():
    assert ModelShape.named("llama-3.1-8b").total_params == LLAMA_8B_PARAMS
    assert ModelShape.named("random:llama-3.1-70b").total_params == LLAMA_70B_PARAMS
    assert ModelShape.named("llama-3.1-8b").kv_bytes_per_token() == LLAMA_8B_KV_PER_TOKEN
    assert ModelShape.named("llama-3.1-8b").kv_bytes_per_token(1) == LLAMA_8B_KV_PER_TOKEN // 2
    with pytest.raises(ValueError, match="llama-3.1-8b"):
        ModelShape.named("llama-9b")


def test_moe_active_parameters_are_fewer_than_the_total():
    shape = ModelShape.from_config(QWEN3_30B_A3B)
    assert shape.total_params == pytest.approx(30.5e9, rel=0.01)
    assert shape.active_params == pytest.approx(3.3e9, rel=0.03)
    # the experts a token skips: 120 of 128 per layer, each a gated MLP of 768
    skipped = 48 * (128 - 8) * 3 * 2048 * 768
    assert shape.total_params - shape.active_params == skipped
    from transformers import AutoConfig
    fields = dict(QWEN3_30B_A3B)
    assert shape.total_params == meta_params(AutoConfig.for_model(fields.pop("model_type"),
                                                                  **fields))
    small = ModelShape.named("qwen3-moe-30b-a3b-8l32e")
    assert small.active_params < small.total_params
    assert ModelShape.named("llama-3.1-8b").active_params == LLAMA_8B_PARAMS  # dense: all


# ---- accelerators ------------------------------------------------------------------------


def test_accelerators_by_name_and_alias():
    assert accelerator("H100").memory_bandwidth == H100_BANDWIDTH
    assert accelerator("h100-sxm") is accelerator("h100")
    assert accelerator("A100-80GB").peak_bf16_flops == 312e12
    assert accelerator("l40s").link_bandwidth < accelerator("h100").link_bandwidth  # PCIe
    assert accelerator("h200").memory_bytes > accelerator("h100").memory_bytes


def test_an_unknown_accelerator_names_the_known_ones():
    with pytest.raises(ValueError) as error:
        accelerator("tpu-v5")
    assert all(name in str(error.value) for name in ("h100", "h200", "a100", "l40s"))
    assert set(ACCELERATORS) >= {"h100", "h200", "a100", "l40s"}


# ---- the roofline ------------------------------------------------------------------------


def test_a_one_row_decode_reads_the_weights():
    cost = RooflineCost("h100", "llama-3.1-8b")
    h100 = accelerator("h100")
    work = StepFeatures.of_decode(1, 1024)
    part = cost.breakdown(work)
    assert part.bound == "memory" and part.compute_s < part.memory_s / 20
    weights_s = LLAMA_8B_PARAMS * 2 / (H100_BANDWIDTH * h100.memory_efficiency)
    # what it reads besides the weights (1,024 positions of KV) is ~1 % of them
    assert cost.step_seconds(work) == pytest.approx(weights_s + h100.step_overhead_s, rel=0.02)
    assert 4e-3 < cost.step_seconds(work) < 12e-3  # an 8B decode step on an H100: milliseconds


def test_a_long_prefill_is_compute_bound():
    cost = RooflineCost("h100", "llama-3.1-8b")
    h100 = accelerator("h100")
    part = cost.breakdown(StepFeatures.of_prefill(4096))
    assert part.bound == "compute" and part.compute_s > 5 * part.memory_s
    linear_flops = 2 * LLAMA_8B_PARAMS * 4096  # the products, the attention left out
    assert part.compute_s > linear_flops / (H100_BF16 * h100.prefill_efficiency) * 0.95
    assert part.compute_s < linear_flops / (H100_BF16 * h100.prefill_efficiency) * 1.15


def test_decode_rows_are_nearly_free_at_small_batch_and_prefill_scales():
    cost = RooflineCost("h100", "llama-3.1-8b")
    one, two = (cost.step_seconds(StepFeatures.of_decode(n, 1024)) for n in (1, 2))
    assert one < two < one * 1.03
    small, large = (cost.step_seconds(StepFeatures.of_prefill(n)) for n in (4096, 8192))
    assert 1.9 < large / small < 2.3  # twice the products, four times the (smaller) attention


def test_h200_decodes_faster_by_its_bandwidth():
    work = StepFeatures.of_decode(8, 2048)
    h100 = RooflineCost("h100", "llama-3.1-8b")
    h200 = RooflineCost("h200", "llama-3.1-8b")
    overhead = accelerator("h100").step_overhead_s
    assert accelerator("h200").step_overhead_s == overhead
    ratio = (h100.step_seconds(work) - overhead) / (h200.step_seconds(work) - overhead)
    assert ratio == pytest.approx(H200_BANDWIDTH / H100_BANDWIDTH, rel=1e-6)


@pytest.mark.parametrize("work", [StepFeatures.of_decode(32, 2048), StepFeatures.of_prefill(2048)],
                         ids=["decode", "prefill"])
def test_tensor_parallel_halves_the_work_and_adds_the_all_reduces(work):
    one = RooflineCost("h100", "qwen3-32b")
    two = RooflineCost("h100", "qwen3-32b", tensor_parallel=2)
    h100 = accelerator("h100")
    assert one.step_seconds(work) > two.step_seconds(work) > one.step_seconds(work) / 2
    # 2 all-reduces a layer of the tokens' bf16 activations, a ring of 2 sending half of them
    tokens = work.decode_rows + work.prefill_tokens
    one_reduce = 2 * (2 - 1) / 2 * tokens * 5120 * 2 / 450e9 + h100.link_latency_s
    expected = ((one.step_seconds(work) - h100.step_overhead_s) / 2 + h100.step_overhead_s
                + 2 * 64 * one_reduce)
    assert two.step_seconds(work) == pytest.approx(expected, rel=1e-9)


def test_an_empty_step_costs_nothing_and_swaps_cost_the_host_link():
    cost = RooflineCost("h100", "llama-3.1-8b", block_size=16)
    assert cost.step_seconds(StepFeatures()) == 0.0
    decode = StepFeatures.of_decode(4, 512)
    swapped = StepFeatures(decode.decode_rows, decode.context_tokens, swap_blocks=10)
    extra = cost.step_seconds(swapped) - cost.step_seconds(decode)
    assert extra == pytest.approx(10 * 16 * LLAMA_8B_KV_PER_TOKEN / 64e9)  # PCIe Gen5 x16


def test_moe_decode_reads_only_the_experts_it_touches():
    moe = RooflineCost("h100", QWEN3_30B_A3B)
    shape = moe.shape
    expert_bytes = shape.routed_expert_params * 2
    one_row = moe.breakdown(StepFeatures.of_decode(1, 0)).memory_s
    many = moe.breakdown(StepFeatures.of_decode(256, 0)).memory_s
    bandwidth = H100_BANDWIDTH * accelerator("h100").memory_efficiency
    # one token reads 8 of 128 experts; 256 tokens read nearly all of them
    assert one_row < (shape.total_params * 2 - expert_bytes * 0.9) / bandwidth
    assert many > shape.total_params * 2 / bandwidth * 0.99


def test_the_kv_pool_of_an_8b_model_on_an_h100():
    blocks = RooflineCost("h100", "llama-3.1-8b").kv_blocks(16)
    usable = 0.9 * 80 * GIB - LLAMA_8B_PARAMS * 2  # vLLM's 0.9 of the memory, less the weights
    block_bytes = 16 * LLAMA_8B_KV_PER_TOKEN
    # a reserve for the runtime and activations of between 1 and 4 GiB
    assert (usable - 4 * GIB) / block_bytes < blocks < (usable - 1 * GIB) / block_bytes
    # on two devices each holds half the heads of every block and half the weights
    two = RooflineCost("h100", "llama-3.1-8b", tensor_parallel=2).kv_blocks(16)
    assert two > 2 * blocks


def test_70b_weights_do_not_fit_one_l40s():
    short = (LLAMA_70B_PARAMS * 2 - 0.9 * 48 * GIB) / GIB
    with pytest.raises(ValueError, match="do not fit") as error:
        RooflineCost("l40s", "llama-3.1-70b").kv_blocks()
    assert f"{short:.1f} GiB short" in str(error.value)
    assert RooflineCost("h100", "llama-3.1-70b", tensor_parallel=4).kv_blocks() > 0


def test_tensor_parallel_must_split_the_heads():
    with pytest.raises(ValueError, match="tensor parallel 3"):
        RooflineCost("h100", "llama-3.1-8b", tensor_parallel=3)


def test_describe_names_the_device_shape_and_parallelism():
    text = RooflineCost("a100", "qwen3-32b", tensor_parallel=2).describe()
    assert "a100" in text and "qwen3-32b" in text and "tensor parallel 2" in text
    assert "\n" not in text


# ---- the measured curve ------------------------------------------------------------------

CURVE = StepCostCurve(base_s=0.004, decode_row_s=5e-5, context_token_s=2e-8,
                      prefill_token_s=1e-4, prefill_context_s=1e-9, swap_block_s=1e-4,
                      overhead_s=0.5, margin=1.3, steps=200)


def test_a_measured_cost_replays_the_curve_without_the_loop_overhead():
    cost = MeasuredCost(CURVE, "a test")
    for work in (StepFeatures.of_decode(16, 1000), StepFeatures.of_prefill(512, 100),
                 StepFeatures(3, 300, 64, 4096, 2)):
        assert cost.step_seconds(work) == CURVE.step_seconds(work)
        assert cost.step_seconds(work) < CURVE.overhead_s  # the 0.5 s loop overhead is not in
    assert cost.step_seconds(StepFeatures()) == 0.0
    text = cost.describe()
    assert "a test" in text and "200 steps" in text and "\n" not in text


def test_a_measured_cost_is_never_negative():
    curve = StepCostCurve(base_s=-0.01, decode_row_s=1e-4, steps=10)  # a fit can dip below 0
    assert MeasuredCost(curve, "x").step_seconds(StepFeatures.of_decode(1, 10)) == 0.0


def test_a_measured_cost_from_the_file_a_worker_writes(tmp_path):
    path = tmp_path / "curve.json"
    path.write_text(CURVE.to_json())
    cost = measured_cost_from_file(path)
    assert cost.curve == CURVE and str(path) in cost.describe()
    (tmp_path / "bad.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="bad.json"):
        measured_cost_from_file(tmp_path / "bad.json")
    (tmp_path / "new.json").write_text(StepCostCurve().to_json())
    with pytest.raises(ValueError, match="no step"):
        measured_cost_from_file(tmp_path / "new.json")
    with pytest.raises(ValueError, match="cannot read"):
        measured_cost_from_file(tmp_path / "missing.json")


def test_a_measured_cost_from_a_heartbeat():
    beat = Heartbeat(model="m", ts=0.0, step_cost=CURVE.to_json())
    decoded = Heartbeat.decode({k: str(v) for k, v in beat.encode().items()})
    assert measured_cost_from_heartbeat(decoded).curve == CURVE
    with pytest.raises(ValueError, match="no fitted step-cost curve"):
        measured_cost_from_heartbeat(Heartbeat(model="m", ts=0.0))


def test_step_cost_takes_a_device_or_a_curve_file(tmp_path):
    path = tmp_path / "curve.json"
    path.write_text(CURVE.to_json())
    assert isinstance(step_cost("h100", "llama-3.1-8b", 1, None), RooflineCost)
    assert step_cost(None, "llama-3.1-8b", 1, str(path)).curve == CURVE
    with pytest.raises(ValueError, match="exactly one"):
        step_cost("h100", "llama-3.1-8b", 1, str(path))
    with pytest.raises(ValueError, match="exactly one"):
        step_cost(None, "llama-3.1-8b", 1, None)
    with pytest.raises(ValueError, match="model shape"):
        step_cost("h100", None, 1, None)
