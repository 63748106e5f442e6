"""The CPU's C++ paged decode and prefill kernels (cpu_attention.py, cpu_prefill.cpp): against the
gather + SDPA path on random paged caches, inside the engine against HF `generate`, and how they
are built, cached and refused."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kvfleet.shared.cpu_features import cpu_features
from tests.engine.paged_cases import CASES, NUM_KV_HEADS, ChunkSpec, PagedCase, run_case
from tests.engine.tiny_models import VOCAB, greedy, random_prompt, run_to_completion
from kvfleet.worker.engine.kernels import cpu_attention, cpu_kernels, cpu_linear
from kvfleet.worker.engine.attention import resolve_attention_backend, resolve_backend_name
from kvfleet.worker.engine.attention import cpu_backend
from kvfleet.worker.engine.attention.cpu_backend import CpuBackend
from kvfleet.worker.engine.attention.sdpa_backend import SdpaBackend
from kvfleet.worker.engine.engine import Engine, EngineConfig
from kvfleet.worker.engine.memory.kv_cache import KVCachePool, KVLayout
from kvfleet.worker.engine.memory.kv_format import resolve_kv_format

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
# prefill chunks, where the CPU has AVX-512 (bf16: AVX512-BF16), take the prefill kernel: chunks from position
# 0 and after a cached prefix, of 2 to 150 tokens (tiles of 16 query tokens, full and partial),
# beside decodes; every group size it blocks by (3, 2, 1 heads and mixes), both head dims, pages
# of 8 or more rows and of fewer (a block of 8 keys then spans pages)
PREFILL_CHUNKS = [ChunkSpec(0, 1), ChunkSpec(40, 1), ChunkSpec(0, 2), ChunkSpec(0, 13),
                  ChunkSpec(37, 11), ChunkSpec(0, 64), ChunkSpec(100, 40), ChunkSpec(5, 150),
                  ChunkSpec(64, 17)]
PREFILL_SHAPES = {
    f"{kv}-prefill-g{group}-d{dim}-bs{bs}": PagedCase(
        kv, group, dim, PREFILL_CHUNKS, block_size=bs, model_dtype=dtype, seed=seed)
    for kv, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32))
    for seed, (group, dim, bs) in enumerate(
        [(3, 64, 64), (1, 64, 16), (2, 128, 8), (4, 64, 5), (5, 64, 16), (6, 128, 3),
         (12, 64, 32)], 40)}
ALL_CASES = {**CASES, **DEFAULT_SHAPE, **BF16_SHAPES, **PREFILL_SHAPES}


def tolerance(dtype: torch.dtype) -> float:
    # float32: both accumulate in fp32, in a different order; bf16: one rounding of the output
    return 1e-5 if dtype == torch.float32 else 2e-2


@pytest.mark.parametrize("name", sorted(ALL_CASES))
def test_cpu_kernels_match_gather_and_sdpa(name):
    """Every format and step shape of the Triton kernel's cases: where the C++ kernels support the
    format they compute the decodes (and the prefill chunks, for bf16 on AVX512-BF16), elsewhere
    the runner keeps gather + SDPA; the output agrees with gather + SDPA either way."""
    case = ALL_CASES[name]
    expected, actual = run_case(case, CPU, backend="cpu")
    assert actual.dtype == expected.dtype == case.model_dtype
    assert torch.isfinite(actual).all()
    error = (actual.float() - expected.float()).abs().max().item()
    assert error < tolerance(case.model_dtype), f"{name}: max abs error {error:.2e}"


ROW_FORM_CASES = sorted(name for name, case in ALL_CASES.items()
                        if case.kv_dtype == "bf16" and case.model_dtype == torch.bfloat16
                        and any(c.num_tokens > 1 for c in case.chunks))


@pytest.mark.skipif("avx512_bf16" not in cpu_features().flags,
                    reason="the prefill kernel's row form needs AVX512-BF16")
@pytest.mark.parametrize("name", ROW_FORM_CASES)
def test_the_row_form_equals_the_decode_kernel_bit_for_bit(name, monkeypatch):
    """Batch-invariant steps on AVX512-BF16 compute prefill chunks in the prefill kernel's row
    form (pages of an even size): each row must be the decode kernel's for that row alone, bit
    for bit, or a prompt computed in chunks, or from a cached prefix, or beside other rows, would
    drift from the same tokens decoded one at a time. Every bf16 step shape of the kernels' cases:
    group sizes 1-12, head dims 64 and 128, chunks from 1 to 150 tokens from position 0 and
    after a cached prefix (16-row tiles full and partial), pages of 3 to 64 keys (odd pages: the
    decode kernel row by row). The control, a row the plain form sums otherwise: the test
    below."""
    case = ALL_CASES[name]
    forms = []
    real = cpu_backend.paged_prefill

    def spy(*args, **kwargs):
        forms.append(args[-1] if len(args) > 6 else kwargs.get("rows", False))
        return real(*args, **kwargs)

    monkeypatch.setattr(cpu_backend, "paged_prefill", spy)
    _, decode_rows = run_case(case, CPU, backend=CpuBackend(False, row_invariant=True))
    assert forms == []  # every row in the decode kernel
    _, row_form = run_case(case, CPU, backend=CpuBackend(False, row_invariant=True,
                                                         prefill_rows=True))
    assert forms == ([True] if case.block_size % 2 == 0 else [])
    assert torch.equal(row_form, decode_rows)


@pytest.mark.skipif("avx512_bf16" not in cpu_features().flags,
                    reason="the prefill kernel's row form needs AVX512-BF16")
def test_a_row_the_plain_form_sums_otherwise_the_row_form_sums_as_the_decode_kernel():
    """The control, constructed so that no CPU's rounding decides it: a query of ones in
    dimensions 0, 2 and 4 against a key of 2^25, 1 and -2^25 there (every product exact). The
    plain form sums the dimension pairs in order: 2^25 + 1 rounds to 2^25 (half an ulp of 2^25
    is 2), and the -2^25 after it leaves a score of 0. The decode kernel sums lane by lane (pairs
    0, 1 and 2 in lanes of their own) and then its tree, (2^25 + -2^25) + (1 + 0) = 1, a score of
    1/8 after the scale. Against a second key of score 0 (V: 1 for the first key, 0 for the
    second in dimension 0), the second prompt row's output is exactly 0.5 in the plain form and
    e^(1/8) / (e^(1/8) + 1) = 0.53 by the decode kernel, which the row form must equal."""
    dim, block = 64, 16
    pool = KVCachePool(KVLayout(1, 1, dim, resolve_kv_format("auto", torch.bfloat16)), 1, block,
                       CPU)
    kv = pool.layer(0)  # [2 (K, V), kv heads, blocks, block size, dim]
    kv.zero_()
    kv[0, 0, 0, 0, [0, 2, 4]] = torch.tensor([2.0 ** 25, 1.0, -2.0 ** 25], dtype=torch.bfloat16)
    kv[1, 0, 0, 0, 0] = 1.0
    query = torch.zeros(1, 2, dim, dtype=torch.bfloat16)  # [heads, rows, dim]: a 2-token prompt
    query[0, :, [0, 2, 4]] = 1.0
    tables = torch.zeros(1, 1, dtype=torch.int32)
    plan = cpu_attention.CpuPrefillPlan(tables, torch.tensor([0], dtype=torch.int32),
                                        torch.tensor([2], dtype=torch.int32),
                                        torch.tensor([2], dtype=torch.int32))

    def prefill(rows: bool) -> torch.Tensor:
        out = torch.full((2, 1, dim), float("nan"), dtype=torch.bfloat16)  # [rows, heads, dim]
        cpu_attention.paged_prefill(query, pool, 0, plan, dim ** -0.5, out, rows=rows)
        return out[:, 0]

    decode_rows = torch.full((2, 1, dim), float("nan"), dtype=torch.bfloat16)
    cpu_attention.paged_decode(query, pool, 0, cpu_attention.CpuDecodePlan(
        2, tables.repeat(2, 1), torch.tensor([1, 2], dtype=torch.int32)), dim ** -0.5, decode_rows)
    plain, row_form, decode_rows = prefill(False), prefill(True), decode_rows[:, 0]
    assert plain[1, 0].item() == 0.5
    assert decode_rows[1, 0].item() == pytest.approx(math.exp(0.125) / (math.exp(0.125) + 1),
                                                     abs=4e-3)
    assert torch.equal(row_form, decode_rows)
    assert torch.equal(plain[0], decode_rows[0])  # one key: nothing to sum in another order
    assert not plain[:, 1:].any() and not decode_rows[:, 1:].any()
    # pages of an odd number of keys: the decode kernel's key pairs are not the row form's, and
    # the kernel refuses them (the backend gives such a pool's rows to the decode kernel)
    odd = KVCachePool(KVLayout(1, 1, dim, resolve_kv_format("auto", torch.bfloat16)), 1, 5, CPU)
    with pytest.raises(RuntimeError, match="kvfleet_paged_prefill_rows failed with status 1"):
        cpu_attention.paged_prefill(query, odd, 0, plan, dim ** -0.5,
                                    torch.empty(2, 1, dim, dtype=torch.bfloat16), rows=True)


@pytest.mark.parametrize("kv_dtype, model_dtype, used", [
    ("auto", torch.float32, True), ("auto", torch.bfloat16, True), ("fp32", torch.float32, True),
    ("bf16", torch.float32, False), ("fp16", torch.float16, False), ("fp8", torch.float32, False),
    ("int8", torch.bfloat16, False)])
def test_the_kernel_takes_plain_kv_in_the_models_dtype_only(kv_dtype, model_dtype, used):
    pool = KVCachePool(KVLayout(1, NUM_KV_HEADS, 64, resolve_kv_format(kv_dtype, model_dtype)),
                       4, 16, CPU)
    assert cpu_attention.supports(pool, model_dtype) is used


@pytest.mark.parametrize("name", ["bf16-default-shape", "bf16-prefill-g3-d64-bs64"])
def test_two_threads_compute_what_one_does(name, monkeypatch):
    """The kernels split (sequence, KV head) pairs and (chunk, KV head, query tile) tasks over
    torch's OpenMP threads: the split must not change a single bit of the output. A decode of
    few keys runs on one thread (SERIAL_DECODE_ELEMENTS): the same bits again."""
    case = ALL_CASES[name]
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        _, by_size = run_case(case, CPU, backend="cpu")  # these few keys: on one thread
        monkeypatch.setattr(cpu_attention, "SERIAL_DECODE_ELEMENTS", 0)  # every decode split
        torch.set_num_threads(1)
        _, one = run_case(case, CPU, backend="cpu")
        torch.set_num_threads(2)
        _, two = run_case(case, CPU, backend="cpu")
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)
    assert torch.equal(by_size, two)


def test_a_decode_of_few_keys_runs_on_one_thread():
    """Waking the other threads costs more than reading a few keys: below
    SERIAL_DECODE_ELEMENTS (keys x KV heads x head_dim) the decode kernel runs on one thread;
    above it, or where the keys were not counted, on torch's."""
    tables = torch.zeros(1, 64, dtype=torch.int32)

    def plan(keys: int, counted: bool = True) -> cpu_attention.CpuDecodePlan:
        ctx_lens = torch.tensor([keys], dtype=torch.int32)
        return (cpu_attention.CpuDecodePlan(1, tables, ctx_lens, keys) if counted
                else cpu_attention.CpuDecodePlan(1, tables, ctx_lens))

    limit = cpu_attention.SERIAL_DECODE_ELEMENTS // (3 * 64)  # the default model's 3 x 64
    assert plan(64).threads(3, 64) == 1
    assert plan(limit - 1).threads(3, 64) == 1
    assert plan(limit).threads(3, 64) == torch.get_num_threads()
    assert plan(64, counted=False).threads(3, 64) == torch.get_num_threads()


@pytest.mark.parametrize("backend", ["cpu", "sdpa"])
def test_engine_greedy_equals_hf_generate_on_either_cpu_backend(tiny_llama, backend):
    """float32, 6 streams of ragged lengths decoding together over blocks of 4: token for token
    what HF `generate` produces, with the kernel and with gather + SDPA."""
    engine = tiny_llama.engine(attention_backend=backend, max_batched_tokens=64)
    assert isinstance(engine.runner.attention_backend, CpuBackend) is (backend == "cpu")
    prompts = [random_prompt(n, seed=40 + i) for i, n in enumerate([3, 9, 16, 25, 33, 50])]
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, greedy(24))
    produced = run_to_completion(engine)
    for i, prompt in enumerate(prompts):
        assert produced[f"r{i}"] == tiny_llama.reference(prompt, 24), f"r{i}"


def test_prefill_chunks_take_the_kernel_where_the_cpu_has_avx512(tiny_llama):
    """Pools of head_dim 64 or 128 in the model's dtype: float32 on a CPU with AVX-512, bf16 on
    one with AVX512-BF16 (where -march=native compiles the pair dot products); other head dims
    and 8-bit pools keep SDPA."""
    def pool(kv_dtype, model_dtype, head_dim=64):
        return KVCachePool(KVLayout(1, NUM_KV_HEADS, head_dim,
                                    resolve_kv_format(kv_dtype, model_dtype)), 4, 16, CPU)

    flags = cpu_features().flags
    for dtype, flag in ((torch.bfloat16, "avx512_bf16"), (torch.float32, "avx512f")):
        for head_dim in (64, 128):
            assert cpu_attention.prefill_supported(pool("auto", dtype, head_dim), dtype,
                                                   head_dim) is (flag in flags)
        assert not cpu_attention.prefill_supported(pool("auto", dtype, 96), dtype, 96)
    assert not cpu_attention.prefill_supported(pool("int8", torch.bfloat16), torch.bfloat16, 64)
    assert not cpu_attention.prefill_supported(pool("bf16", torch.float32), torch.float32, 64)
    for dtype in ("float32", "bfloat16"):  # head_dim 16
        engine = tiny_llama.engine(dtype=dtype, deterministic=False)
        assert not engine.attention_backend.prefill_kernel
        assert "(decode kernel; prefill chunks on SDPA); linears in " in engine.device_report()
        # batch-invariant (the default): every row in the decode kernel, never SDPA
        engine = tiny_llama.engine(dtype=dtype)
        assert not engine.attention_backend.prefill_kernel
        assert "(every query row in the decode kernel: batch-invariant)" in engine.device_report()


@pytest.mark.parametrize("deterministic", [False, True], ids=["prefill-kernel", "rows"])
@pytest.mark.parametrize("dtype, flag, bound", [
    (torch.bfloat16, "avx512_bf16", 0.02), (torch.float32, "avx512f", 1e-4)])
def test_prompt_logprobs_through_the_prefill_kernel_follow_hf(dtype, flag, bound, deterministic):
    """A Llama of head_dim 64 (the prefill kernel's shape): prompts of 150, 90 and 40 tokens
    prefilled in chunks of up to 64 tokens after their cached prefix, beside a decoding request.
    Each prompt token's logprob is that of HF's forward in the same dtype: within 0.02 in bf16
    (measured on a Zen 5: at most 0.004 through the kernel, 0.006 through SDPA), 1e-4 in float32;
    a chunk attending to the wrong keys or rows would be off by whole units. With
    `--no-deterministic` the chunks take the prefill kernel where it runs here; by default every
    row takes the decode kernel, in bf16 on AVX512-BF16 CPUs its order through the prefill
    kernel's row form, on AMX CPUs the tile kernel (batch-invariant), which must follow HF as
    closely."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        hidden_size=192, intermediate_size=256, num_hidden_layers=2, num_attention_heads=3,
        num_key_value_heads=1, vocab_size=VOCAB, max_position_embeddings=512))
    prompts = [random_prompt(n, seed=60 + i) for i, n in enumerate([150, 90, 40])]
    hf = copy.deepcopy(model).to(dtype).eval()
    with torch.inference_mode():
        expected = [torch.log_softmax(hf(torch.tensor([p])).logits[0, :-1].float(), dim=-1)
                    .gather(1, torch.tensor(p[1:]).unsqueeze(1)).squeeze(1) for p in prompts]
    engine = Engine(model, EngineConfig(device="cpu", dtype=str(dtype).removeprefix("torch."),
                                        num_blocks=64, block_size=16, max_batched_tokens=64,
                                        deterministic=deterministic))
    has_kernel = flag in cpu_features().flags and not deterministic
    assert engine.attention_backend.prefill_kernel is has_kernel
    tiles = dtype == torch.bfloat16 and cpu_linear.amx_tiles() is None  # AMX CPUs: on tiles
    # bf16 with AVX512-BF16: prefill chunks in the prefill kernel's row form
    row_form = dtype == torch.bfloat16 and flag in cpu_features().flags and not tiles
    assert (("attention cpu (every query row on AMX tiles: batch-invariant);" if tiles else
             "attention cpu (every query row in the decode kernel's order, prefill chunks 16 "
             "rows at a time: batch-invariant);" if row_form else
             "attention cpu (every query row in the decode kernel: batch-invariant);")
            if deterministic else "attention cpu (decode and prefill kernels);" if has_kernel
            else "attention cpu (decode kernel; prefill chunks on SDPA);") in engine.device_report()
    engine.add_request("neighbour", random_prompt(20, seed=1), greedy(40))
    engine.step()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"p{i}", prompt, greedy(2, prompt_logprobs=0))
    got = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.prompt_logprobs is not None:
                got[out.req_id] = torch.tensor([e.logprob for e in out.prompt_logprobs])
    for i, want in enumerate(expected):
        error = (got[f"p{i}"] - want).abs().max().item()
        assert error < bound, f"prompt {i}: max logprob difference {error:.2e}"


def test_auto_picks_the_kernel_on_a_cpu_that_builds_it():
    assert cpu_attention.unavailable_reason() is None  # this machine has a C++ compiler
    assert resolve_backend_name("auto", CPU) == "cpu"
    assert resolve_backend_name("cpu", CPU) == "cpu"
    fp32 = resolve_kv_format("auto", torch.float32)
    backend = resolve_attention_backend("auto", CPU, torch.float32, fp32, 64)
    assert isinstance(backend, CpuBackend) and backend.cpu_kernel
    assert backend.prefill_kernel is ("avx512f" in cpu_features().flags)
    # the kernels read plain K/V in the model's dtype: another format keeps gather + SDPA
    fp8_format = resolve_kv_format("fp8", torch.float32)
    fp8 = resolve_attention_backend("cpu", CPU, torch.float32, fp8_format, 64)
    assert isinstance(fp8, SdpaBackend) and fp8.name == "cpu" and not fp8.cpu_kernel
    with pytest.raises(ValueError, match="'cpu' runs on the CPU only"):
        resolve_backend_name("cpu", torch.device("cuda"))
    with pytest.raises(ValueError, match="'cpu' runs on the CPU only"):
        resolve_attention_backend("cpu", torch.device("cuda"), torch.float32, fp32, 64)


def test_the_build_is_cached_per_source_and_cpu(tmp_path):
    first = cpu_kernels.build_kernel("layer_ops", tmp_path)
    stamp = first.stat().st_mtime_ns
    again = cpu_kernels.build_kernel("layer_ops", tmp_path)
    assert again == first and again.stat().st_mtime_ns == stamp  # not rebuilt
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no partial files left


@pytest.fixture
def no_compiler(monkeypatch, tmp_path):
    monkeypatch.setenv("CXX", "no-such-compiler-kvfleet")
    monkeypatch.setenv("KVFLEET_KERNEL_CACHE", str(tmp_path))
    cpu_kernels.clear_cache()
    cpu_linear.own_product.cache_clear()
    yield
    cpu_kernels.clear_cache()
    cpu_linear.own_product.cache_clear()


def test_without_a_compiler_auto_keeps_sdpa_and_cpu_is_refused(no_compiler, tiny_llama):
    reason = cpu_attention.unavailable_reason()
    assert reason is not None and "no-such-compiler-kvfleet" in reason
    assert resolve_backend_name("auto", CPU) == "sdpa"
    with pytest.raises(ValueError, match="needs its C\\+\\+ kernel.*no-such-compiler-kvfleet"):
        resolve_backend_name("cpu", CPU)
    engine = tiny_llama.engine()
    assert isinstance(engine.attention_backend, SdpaBackend) and engine.attention_backend.name == "sdpa"
    assert "no-such-compiler-kvfleet" in engine.device_report()  # the log says why
    assert "; linears in oneDNN, weights packed;" in engine.device_report()  # float32
    assert "decode unavailable: " in engine.device_report()  # each kernel's own verdict


def test_a_failed_build_says_why_and_leaves_no_file(tmp_path):
    broken = tmp_path / "broken.cpp"
    broken.write_text("this is not C++\n")
    kernels = {"decode": cpu_kernels.KernelSource(broken, cpu_kernels.KERNELS["decode"].header)}
    with pytest.raises(cpu_attention.KernelUnavailable, match="compiling broken.cpp failed"):
        cpu_kernels.build_kernel("decode", tmp_path / "cache", kernels)
    assert list((tmp_path / "cache").iterdir()) == []


def loaded_kernels(report: str) -> set[str]:
    """The kernels a device report says are loaded."""
    return set(report.split("kernels loaded: ")[1].split(";")[0].split(", "))


def test_the_start_up_report_names_the_attention_path(tiny_llama):
    report = tiny_llama.engine(deterministic=False).device_report()  # float32
    assert "; attention cpu (decode kernel; prefill chunks on SDPA)" in report
    # float32's products: kvfleet's on AVX-512 CPUs without AMX, else oneDNN's (cpu_linear.py)
    assert "; linears " + cpu_linear.products_report(torch.float32) + "; " in report
    # the kernels this process has loaded so far (the AMX product's too where a test used it)
    assert loaded_kernels(report) >= {"decode", "prefill", "layer_ops", "matmul"}
    assert report.endswith("; not batch-invariant: --no-deterministic")
    report = tiny_llama.engine().device_report()  # the default: batch-invariant
    assert "; attention cpu (every query row in the decode kernel: batch-invariant)" in report
    assert "; linears " + cpu_linear.products_report(torch.float32, True) + "; " in report
    assert loaded_kernels(report) >= {"decode", "prefill", "layer_ops", "matmul"}
    assert report.endswith("; batch-invariant")
    fp8 = tiny_llama.engine(kv_dtype="fp8")
    assert not fp8.attention_backend.cpu_kernel and fp8.attention_backend.name == "cpu"
    assert "attention cpu (gather + SDPA for --kv-dtype fp8" in fp8.device_report()
    assert "; not batch-invariant: attention cpu (gather + SDPA" in fp8.device_report()
    assert "attention sdpa (the C++ decode kernel: not asked for)" in tiny_llama.engine(
        attention_backend="sdpa").device_report()
