"""Device handling on CPU: fp32 buffers survive a bf16 cast, bf16 next-token choices agree with HF in
bf16, sticky device errors are told from request errors, and the profiling step's shape."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

from kvfleet.worker.engine.attention import resolve_attention_backend, resolve_backend_name
from kvfleet.worker.engine.attention.sdpa_backend import SdpaBackend
from kvfleet.worker.engine.memory.device import (
    CPU_BF16_BLOCK_SIZE, DEFAULT_BLOCK_SIZE, DeviceFailure, is_cpu, is_cuda,
    is_sticky_device_error, place_model, resolve_block_size)
from kvfleet.worker.engine.engine import Engine, EngineConfig
from kvfleet.worker.engine.memory.kv_cache import KVLayout
from kvfleet.worker.engine.memory.kv_format import resolve_kv_format
from kvfleet.worker.engine.model.memory_profile import largest_step, profile_step
from tests.engine.tiny_models import (
    MODEL_FACTORIES, greedy, random_prompt, save_tiny_llama)

ILLEGAL_ACCESS = "CUDA error: an illegal memory access was encountered"


def test_the_device_kind_predicates():
    assert is_cpu(torch.device("cpu")) and not is_cuda(torch.device("cpu"))
    assert is_cuda(torch.device("cuda", 1)) and not is_cpu(torch.device("cuda"))


def test_place_model_keeps_fp32_buffers():
    torch.manual_seed(0)
    model = MODEL_FACTORIES["llama"]()
    inv_freq = model.model.rotary_emb.inv_freq.clone()
    place_model(model, torch.device("cpu"), torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32
    assert torch.equal(model.model.rotary_emb.inv_freq, inv_freq)
    # a plain cast loses them: what place_model prevents
    assert not torch.equal(model.to(torch.bfloat16).model.rotary_emb.inv_freq.float(), inv_freq)


@pytest.fixture(scope="module")
def saved_tiny(tmp_path_factory) -> str:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


def test_bf16_engine_agrees_with_hf_in_bf16(saved_tiny):
    """HF loads the model in bf16 (fp32 RoPE buffers); the engine at its defaults (batched,
    batch-invariant kernels: other sums, other bf16 rounding) is teacher-forced over the same
    12 sequences x 64 positions (768 next-token choices), so agreement is measured on each
    position's own context and one early near-tie does not decide the verdict."""
    from kvfleet.worker.engine.scoring import teacher_forced_logprobs

    texts = [random_prompt(96, seed=seed) for seed in range(12)]
    choices = {}
    with torch.inference_mode():
        for name, dtype in (("hf_bf16", torch.bfloat16), ("fp32", torch.float32)):
            reference = AutoModelForCausalLM.from_pretrained(saved_tiny, dtype=dtype).eval()
            choices[name] = reference(torch.tensor(texts)).logits[:, 31:-1].argmax(-1).T
    engine = Engine.from_pretrained(saved_tiny, EngineConfig(
        device="cpu", dtype="bfloat16", num_blocks=256, block_size=16, enable_prefix_caching=False))
    assert engine.model.model.rotary_emb.inv_freq.dtype == torch.float32
    tested = torch.stack([lp for _, lp in teacher_forced_logprobs(engine, texts, 32)]).argmax(-1)
    agreement = {name: (tested == c).float().mean().item() for name, c in choices.items()}
    print(f"bf16 agreement: with HF bf16 {agreement['hf_bf16']:.1%}, with fp32 {agreement['fp32']:.1%}")
    for name, bound in AGREEMENT_BOUNDS.items():
        assert agreement[name] >= bound, f"{name}: {agreement[name]:.1%}"


# Measured on AVX-512 Zen 4 (2026-12-04): with HF bf16 98.3 % (98.0 % with --no-deterministic),
# with fp32 95.3 % (HF bf16 itself with fp32: 96.0 %); this random model has many near-ties. The
# bounds sit ~8 binomial standard deviations (0.5-0.8 % at these rates over 768 positions) below,
# so no verdict hinges on one CPU's rounding; a real defect (a lost position, bf16 RoPE angles,
# a wrong cache read) falls far below them.
AGREEMENT_BOUNDS = {"hf_bf16": 0.94, "fp32": 0.89}


def test_sticky_device_errors_are_told_from_request_errors():
    assert is_sticky_device_error(RuntimeError(ILLEGAL_ACCESS))
    assert is_sticky_device_error(RuntimeError("CUDA error: device-side assert triggered"))
    assert not is_sticky_device_error(torch.OutOfMemoryError("CUDA out of memory"))
    assert not is_sticky_device_error(RuntimeError("shape mismatch"))
    assert not is_sticky_device_error(ValueError(ILLEGAL_ACCESS))
    accelerator_error = getattr(torch, "AcceleratorError", None)
    if accelerator_error is not None:
        assert is_sticky_device_error(accelerator_error("an illegal instruction"))


@pytest.mark.parametrize("where", ["forward", "sampler"])
def test_a_sticky_error_leaves_the_requests_unfinished(tiny_llama, where):
    engine = tiny_llama.engine()
    engine.add_request("a", random_prompt(7, seed=1), greedy(5))
    engine.step()

    def fail(*args, **kwargs):
        raise RuntimeError(ILLEGAL_ACCESS)

    target = engine.runner if where == "forward" else engine.sampler
    setattr(target, "execute" if where == "forward" else "sample", fail)
    with pytest.raises(DeviceFailure):
        engine.step()
    assert engine.has_unfinished() and engine.stats().num_running == 1


def test_an_ordinary_forward_error_fails_only_its_requests(tiny_llama):
    engine = tiny_llama.engine()
    engine.add_request("a", random_prompt(7, seed=1), greedy(5))

    def fail(*args, **kwargs):
        raise RuntimeError("shape mismatch")

    engine.runner.execute = fail
    outputs = engine.step()
    assert [o.finish_reason for o in outputs] == ["error"] and not engine.has_unfinished()


def test_attention_backend_and_graph_settings():
    cpu = torch.device("cpu")
    assert resolve_backend_name("auto", cpu) == "cpu"  # the C++ kernel builds here
    assert resolve_backend_name("triton", cpu) == "triton"  # under the tests' interpreter
    fp32 = resolve_kv_format("auto", torch.float32)
    assert resolve_attention_backend("triton", cpu, torch.float32, fp32, 64).name == "triton"
    with pytest.raises(ValueError, match="must be one of auto, sdpa, cpu, triton; got 'flash'"):
        resolve_attention_backend("flash", cpu, torch.float32, fp32, 64)
    with pytest.raises(ValueError):
        EngineConfig(attention_backend="flash")
    with pytest.raises(ValueError):
        EngineConfig(cuda_graphs="always")


def test_the_block_size_is_64_for_bf16_on_the_cpu_kernel_and_16_elsewhere_unless_set(tiny_llama):
    bf16, fp32, codes = torch.bfloat16, torch.float32, torch.uint8
    assert (CPU_BF16_BLOCK_SIZE, DEFAULT_BLOCK_SIZE) == (64, 16)
    assert resolve_block_size(None, True, bf16, bf16) == 64  # read by the C++ CPU kernel
    assert resolve_block_size(None, True, fp32, fp32) == 16
    assert resolve_block_size(None, True, bf16, codes) == 16  # an 8-bit pool
    assert resolve_block_size(None, True, fp32, bf16) == 16  # K/V not in the model's dtype
    assert resolve_block_size(None, False, bf16, bf16) == 16  # gather + SDPA, Triton
    assert resolve_block_size(8, True, bf16, bf16) == 8
    with pytest.raises(ValueError):
        EngineConfig(block_size=0)
    for dtype, backend, given, size in (("bfloat16", "cpu", None, 64), ("float32", "cpu", None, 16),
                                        ("bfloat16", "sdpa", None, 16), ("float32", "cpu", 64, 64)):
        engine = tiny_llama.engine(block_size=given, attention_backend=backend, dtype=dtype)
        assert engine.config.block_size == engine.pool.block_size == size
        assert engine.block_manager.block_size == size
        if dtype == "float32":  # greedy equal to HF generate in float32
            prompt = random_prompt(size + 3, seed=5)  # one full block and a part of the next
            assert engine.generate([prompt], greedy(4)) == [tiny_llama.reference(prompt, 4)]


@pytest.mark.parametrize("max_batched_tokens, max_running", [(96, 8), (16, 64)])
def test_the_profiling_step_has_the_largest_shape(tiny_llama, max_batched_tokens, max_running):
    step = largest_step(max_batched_tokens, max_running, block_size=4)
    assert step.num_batched_tokens == max_batched_tokens
    assert sum(c.emits_token for c in step.chunks) == min(max_running, max_batched_tokens)
    model = tiny_llama.engine().model
    layout = KVLayout.from_model_config(model.config, resolve_kv_format("auto", torch.float32))
    profile = profile_step(model, layout, 4, max_batched_tokens, max_running,
                           torch.device("cpu"), SdpaBackend())
    assert (profile.num_tokens, profile.num_logits_rows) == (
        max_batched_tokens, min(max_running, max_batched_tokens))
    assert profile.peak_bytes == 0  # measured on CUDA only


def test_with_speculation_the_profiling_step_verifies_proposals_for_every_stream(tiny_llama):
    """Speculation makes a step emit up to 1 + k rows per stream: the profiled step has them."""
    step = largest_step(96, 8, block_size=4, num_speculative_tokens=4)
    assert step.num_batched_tokens == 96
    assert [c.num_logits for c in step.chunks] == [5] * 7 + [1]
    model = tiny_llama.engine().model
    layout = KVLayout.from_model_config(model.config, resolve_kv_format("auto", torch.float32))
    profile = profile_step(model, layout, 4, 96, 8, torch.device("cpu"), SdpaBackend(),
                           num_speculative_tokens=4)
    assert (profile.num_tokens, profile.num_logits_rows) == (96, 36)


def test_the_triton_backend_on_a_cpu_is_refused_when_the_engine_is_built(tiny_llama, monkeypatch):
    """Without Triton's interpreter the kernel cannot run on CPU tensors: the engine refuses the
    pairing when it is built, instead of failing every request at its first step."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="'triton' runs on CUDA devices only.*cpu"):
        resolve_backend_name("triton", torch.device("cpu"))
    with pytest.raises(ValueError, match="CUDA devices only"):
        tiny_llama.engine(attention_backend="triton")
    assert tiny_llama.engine(attention_backend="auto").attention_backend.name == "cpu"


def test_a_worker_asked_for_triton_on_a_cpu_exits_before_loading_its_model(tmp_path):
    """`kvfleet worker --device cpu --attention-backend triton` exits at once with the reason; the
    model path does not exist, so a check made after loading would fail differently."""
    env = {**os.environ, "TRITON_INTERPRET": "0", "KVFLEET_MODEL": str(tmp_path / "no-model")}
    result = subprocess.run(
        [sys.executable, "-m", "kvfleet", "worker", "--device", "cpu", "--attention-backend",
         "triton", "--redis-url", "redis://127.0.0.1:9", "--metrics-port", "-1"],
        capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode != 0
    assert "kvfleet worker: attention_backend 'triton' runs on CUDA devices only" in result.stderr
    assert "Traceback" not in result.stderr


def test_auto_dtype_follows_the_cpus_bf16_support_and_is_reported(tiny_llama):
    """--dtype auto on CPU: bf16 where this CPU has native bf16, float32 elsewhere; the start-up
    report names the CPU, its ISA and what auto picked."""
    from kvfleet.shared.cpu_features import cpu_features

    features = cpu_features()
    engine = tiny_llama.engine(dtype="auto")
    assert engine.dtype is (torch.bfloat16 if features.native_bf16 else torch.float32)
    assert all(p.dtype == engine.dtype for p in engine.model.parameters())
    report = engine.device_report()
    assert features.model in report and features.isa in report
    assert str(engine.dtype).removeprefix("torch.") in report and "--dtype auto" in report
