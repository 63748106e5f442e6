"""The CPU's C++ paged decode kernel (cpu_attention.py): against the gather + SDPA path on random
paged caches, inside the engine against HF `generate`, and how it is built, cached and refused."""

from __future__ import annotations

import pytest
import torch

from tests.engine.paged_cases import CASES, NUM_KV_HEADS, ChunkSpec, PagedCase, run_case
from tests.engine.tiny_models import greedy, random_prompt, run_to_completion
from worker.engine import cpu_attention
from worker.engine.device import resolve_attention_backend
from worker.engine.kv_cache import KVCachePool, KVLayout
from worker.engine.kv_format import resolve_kv_format

CPU = torch.device("cpu")
# the default model's shape: 3 query heads per KV head, head_dim 64, blocks of 16 (float32) and
# 64 (bf16's default); ragged contexts across several blocks, some ending exactly on a block
# boundary
DEFAULT_SHAPE_DECODES = [ChunkSpec(n, 1) for n in (0, 15, 16, 31, 47, 63, 64, 130, 255, 300)]
DEFAULT_SHAPE = {
    "fp32-default-shape": PagedCase("fp32", 3, 64, DEFAULT_SHAPE_DECODES, block_size=16, seed=11),
    # pages this long have the whole next page prefetched at once (kPrefetchWholePageRows)
    "fp32-default-shape-bs64": PagedCase("fp32", 3, 64, DEFAULT_SHAPE_DECODES, block_size=64,
                                         seed=14),
    "bf16-default-shape": PagedCase("bf16", 3, 64, DEFAULT_SHAPE_DECODES, block_size=64,
                                    model_dtype=torch.bfloat16, seed=12),
    "bf16-default-shape-bs16": PagedCase("bf16", 3, 64, DEFAULT_SHAPE_DECODES, block_size=16,
                                         model_dtype=torch.bfloat16, seed=13),
}
# bf16 K/V on a CPU with AVX512-BF16 take the kernel's pair-dot-product path: every group size it
# specialises (1, 2, 3, 4 and remainders, more than 8 query heads per KV head), both head dims,
# pages of odd sizes and of fewer than 16 rows
BF16_SHAPES = {
    f"bf16-g{group}-d{dim}-bs{bs}": PagedCase("bf16", group, dim, DEFAULT_SHAPE_DECODES,
                                              block_size=bs, model_dtype=torch.bfloat16, seed=seed)
    for seed, (group, dim, bs) in enumerate(
        [(1, 64, 16), (2, 128, 8), (4, 64, 5), (5, 64, 16), (6, 128, 3), (12, 64, 32)], 20)}
ALL_CASES = {**CASES, **DEFAULT_SHAPE, **BF16_SHAPES}


def tolerance(dtype: torch.dtype) -> float:
    # float32: both accumulate in fp32, in a different order; bf16: one rounding of the output
    return 1e-5 if dtype == torch.float32 else 2e-2


@pytest.mark.parametrize("name", sorted(ALL_CASES))
def test_decode_kernel_matches_gather_and_sdpa(name):
    """Every format and step shape of the Triton kernel's cases: where the C++ kernel supports the
    format it computes the decodes (the prefill chunks keep SDPA), elsewhere the runner keeps
    gather + SDPA; the output agrees with gather + SDPA either way."""
    case = ALL_CASES[name]
    expected, actual = run_case(case, CPU, backend="cpu")
    assert actual.dtype == expected.dtype == case.model_dtype
    assert torch.isfinite(actual).all()
    error = (actual.float() - expected.float()).abs().max().item()
    assert error < tolerance(case.model_dtype), f"{name}: max abs error {error:.2e}"


@pytest.mark.parametrize("kv_dtype, model_dtype, used", [
    ("auto", torch.float32, True), ("auto", torch.bfloat16, True), ("fp32", torch.float32, True),
    ("bf16", torch.float32, False), ("fp16", torch.float16, False), ("fp8", torch.float32, False),
    ("int8", torch.bfloat16, False)])
def test_the_kernel_takes_plain_kv_in_the_models_dtype_only(kv_dtype, model_dtype, used):
    pool = KVCachePool(KVLayout(1, NUM_KV_HEADS, 64, resolve_kv_format(kv_dtype, model_dtype)),
                       4, 16, CPU)
    assert cpu_attention.supports(pool, model_dtype) is used


def test_two_threads_compute_what_one_does():
    """The kernel splits (sequence, KV head) pairs over torch's OpenMP threads: the split must not
    change a single bit of the output."""
    case = DEFAULT_SHAPE["bf16-default-shape"]
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        _, one = run_case(case, CPU, backend="cpu")
        torch.set_num_threads(2)
        _, two = run_case(case, CPU, backend="cpu")
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


@pytest.mark.parametrize("backend", ["cpu", "sdpa"])
def test_engine_greedy_equals_hf_generate_on_either_cpu_backend(tiny_llama, backend):
    """float32, 6 streams of ragged lengths decoding together over blocks of 4: token for token
    what HF `generate` produces, with the kernel and with gather + SDPA."""
    engine = tiny_llama.engine(attention_backend=backend, max_batched_tokens=64)
    assert engine.runner.cpu_decode_kernel is (backend == "cpu")
    prompts = [random_prompt(n, seed=40 + i) for i, n in enumerate([3, 9, 16, 25, 33, 50])]
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, greedy(24))
    produced = run_to_completion(engine)
    for i, prompt in enumerate(prompts):
        assert produced[f"r{i}"] == tiny_llama.reference(prompt, 24), f"r{i}"


def test_auto_picks_the_kernel_on_a_cpu_that_builds_it():
    assert cpu_attention.unavailable_reason() is None  # this machine has a C++ compiler
    assert resolve_attention_backend("auto", CPU) == "cpu"
    assert resolve_attention_backend("cpu", CPU) == "cpu"
    with pytest.raises(ValueError, match="'cpu' runs on the CPU only"):
        resolve_attention_backend("cpu", torch.device("cuda"))


def test_the_build_is_cached_per_source_and_cpu(tmp_path):
    first = cpu_attention.build_kernel(tmp_path)
    stamp = first.stat().st_mtime_ns
    again = cpu_attention.build_kernel(tmp_path)
    assert again == first and again.stat().st_mtime_ns == stamp  # not rebuilt
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no partial files left


@pytest.fixture
def no_compiler(monkeypatch, tmp_path):
    monkeypatch.setenv("CXX", "no-such-compiler-kvfleet")
    monkeypatch.setenv("KVFLEET_KERNEL_CACHE", str(tmp_path))
    cpu_attention.load_kernel.cache_clear()
    yield
    cpu_attention.load_kernel.cache_clear()


def test_without_a_compiler_auto_keeps_sdpa_and_cpu_is_refused(no_compiler, tiny_llama):
    reason = cpu_attention.unavailable_reason()
    assert reason is not None and "no-such-compiler-kvfleet" in reason
    assert resolve_attention_backend("auto", CPU) == "sdpa"
    with pytest.raises(ValueError, match="needs its C\\+\\+ kernel.*no-such-compiler-kvfleet"):
        resolve_attention_backend("cpu", CPU)
    engine = tiny_llama.engine()
    assert engine.attention_backend == "sdpa"
    assert "no-such-compiler-kvfleet" in engine.device_report()  # the log says why


def test_a_failed_build_says_why_and_leaves_no_file(monkeypatch, tmp_path):
    broken = tmp_path / "broken.cpp"
    broken.write_text("this is not C++\n")
    monkeypatch.setattr(cpu_attention, "SOURCES", (broken,))
    with pytest.raises(cpu_attention.KernelUnavailable, match="compiling broken.cpp failed"):
        cpu_attention.build_kernel(tmp_path / "cache")
    assert list((tmp_path / "cache").iterdir()) == []


def test_the_start_up_report_names_the_attention_path(tiny_llama):
    assert tiny_llama.engine().device_report().endswith("; attention cpu")
    fp8 = tiny_llama.engine(kv_dtype="fp8")
    assert not fp8.runner.cpu_decode_kernel
    assert "attention cpu (gather + SDPA for --kv-dtype fp8" in fp8.device_report()
    assert "attention sdpa (the C++ decode kernel: not asked for)" in tiny_llama.engine(
        attention_backend="sdpa").device_report()
