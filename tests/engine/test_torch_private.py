"""The private torch APIs (torch_private.py): each one's fallback gives what the private path
gives, a missing or failing op falls back, and a torch version not checked is probed first."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from kvfleet.shared.cpu_features import cpu_features
from tests.engine.paged_cases import CASES, run_case
from tests.engine.tiny_models import MODEL_FACTORIES
from kvfleet.worker.engine.kernels import cpu_linear, torch_private
from kvfleet.worker.engine.kernels.cpu_linear import PackedLinear, pack_cpu_linears

TOLERANCE = {torch.bfloat16: 2 ** -7, torch.float32: 1e-5}  # relative to the output's scale


@pytest.fixture
def decided_afresh():
    """The cached verdicts are made again before and after the test."""
    def clear():
        for cached in (torch_private.onednn_packing_available, torch_private.onednn_bf16_supported,
                       cpu_linear.own_product):
            cached.cache_clear()
    clear()
    yield
    clear()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_checked_version_is_trusted_where_the_probe_agrees(monkeypatch, decided_afresh, dtype):
    """What CHECKED_TORCH claims: on this torch, trusting the ops decides as probing them does."""
    monkeypatch.setattr(torch_private, "CHECKED_TORCH", (torch_private.torch_version(),))
    trusted = torch_private.onednn_packing_available(dtype)
    torch_private.onednn_packing_available.cache_clear()
    monkeypatch.setattr(torch_private, "CHECKED_TORCH", ())
    assert torch_private.onednn_packing_available(dtype) == trusted


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_packed_product_gives_what_its_fallback_gives(dtype):
    if not torch_private.onednn_packing_available(dtype):
        pytest.skip(f"oneDNN does not pack {dtype} here (the fallback is all there is)")
    torch.manual_seed(0)
    linear = torch.nn.Linear(96, 160).to(dtype)
    x = torch.randn(7, 96, dtype=dtype)
    fallback = F.linear(x, linear.weight, linear.bias).float()
    private = torch_private.linear_op()(x, torch_private.pack_linear_weight(linear.weight, 64),
                                        linear.bias, "none", [], "").float()
    assert (private - fallback).abs().max() <= TOLERANCE[dtype] * fallback.abs().max()


def test_the_bf16_verdict_falls_back_to_the_cpu_flags(monkeypatch, decided_afresh):
    private = torch_private.onednn_bf16_supported()
    torch_private.onednn_bf16_supported.cache_clear()
    monkeypatch.setattr(torch_private, "_mkldnn_op", lambda name: None)
    fallback = torch_private.onednn_bf16_supported()
    # oneDNN also counts AVX-NE-CONVERT, which the flags' verdict leaves to F.linear
    assert fallback == private or (private and "avx_ne_convert" in cpu_features().flags)


def test_a_missing_packing_op_leaves_f_linear_with_the_same_output(monkeypatch, decided_afresh):
    monkeypatch.setenv(cpu_linear.PRODUCTS_ENV, "onednn")  # oneDNN's packing, not kvfleet's
    torch.manual_seed(0)
    model = MODEL_FACTORIES["llama"]().eval()  # float32: oneDNN packs it on every CPU
    packed, unpacked = copy.deepcopy(model), copy.deepcopy(model)
    assert pack_cpu_linears(packed, shared=True) > 0
    torch_private.onednn_packing_available.cache_clear()
    real = torch_private._mkldnn_op
    monkeypatch.setattr(torch_private, "_mkldnn_op",
                        lambda name: None if name == "_linear_pointwise" else real(name))
    assert not cpu_linear.packing_available(torch.float32)
    assert pack_cpu_linears(unpacked, shared=True) == 0
    assert not any(isinstance(m, PackedLinear) for m in unpacked.modules())
    x = torch.randint(3, 500, (1, 9))
    with torch.inference_mode():
        got, want = unpacked(x).logits, packed(x).logits
    assert torch.equal(got, model(x).logits)  # nothing replaced
    assert (got - want).abs().max() <= 8 * TOLERANCE[torch.float32] * want.abs().max()


def test_an_unchecked_version_is_probed_first(monkeypatch, decided_afresh):
    monkeypatch.setattr(torch_private, "CHECKED_TORCH", ())
    assert torch_private.onednn_packing_available(torch.float32)  # the probe agrees here
    torch_private.onednn_packing_available.cache_clear()
    monkeypatch.setattr(torch_private, "linear_op", lambda: lambda x, w, b, *args: x[:, :1] * 0)
    assert not torch_private.onednn_packing_available(torch.float32)  # disagrees: F.linear

    def failing(*args):
        raise RuntimeError("no kernel for this layout")
    torch_private.onednn_packing_available.cache_clear()
    monkeypatch.setattr(torch_private, "linear_op", lambda: failing)
    assert not torch_private.onednn_packing_available(torch.float32)


def test_kernel_calls_are_named_only_while_profiling(monkeypatch):
    """Named in a profile through the private flag; without the flag the same output, unnamed."""
    case = CASES["fp32-g1-d64-mixed"]  # decodes and prefill chunks, plain float32 K/V
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        _, profiled = run_case(case, torch.device("cpu"), backend="cpu")
    names = {event.name for event in profile.events()}
    assert "attention (cpu kernel)" in names
    assert torch_private.named_while_profiling("x") is torch_private._UNNAMED  # none runs now
    monkeypatch.setattr(torch_private, "_HAS_PROFILER_FLAG", False)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        _, unnamed = run_case(case, torch.device("cpu"), backend="cpu")
    assert "attention (cpu kernel)" not in {event.name for event in profile.events()}
    assert torch.equal(unnamed, profiled)
