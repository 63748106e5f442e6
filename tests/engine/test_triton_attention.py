"""The Triton paged-attention kernel under Triton's interpreter on CPU tensors, against the gather +
SDPA path as the oracle (tests/cuda runs the same cases compiled on a GPU)."""

from __future__ import annotations

import pytest
import torch

from tests.engine.paged_cases import CASES, run_case


from kvfleet.worker.engine.kernels.triton_attention import interpreting


def test_runs_under_the_interpreter():
    assert interpreting()  # tests/conftest.py sets it where there is no GPU


def tolerance(dtype: torch.dtype) -> float:
    return 1e-4 if dtype == torch.float32 else 2e-2


@pytest.mark.parametrize("name", sorted(CASES))
def test_kernel_matches_gather_and_sdpa(name):
    case = CASES[name]
    expected, actual = run_case(case, torch.device("cpu"))
    assert actual.dtype == expected.dtype == case.model_dtype
    assert torch.isfinite(actual).all()
    error = (actual.float() - expected.float()).abs().max().item()
    assert error < tolerance(case.model_dtype), f"{name}: max abs error {error:.2e}"


@pytest.fixture
def row_exact_dot(monkeypatch):
    """The interpreter's tl.dot is numpy's matmul, whose float32 kernels on some CPUs (OpenBLAS's
    Haswell and Zen sgemm: AVX2-only hosts, and AMD Zen 5) round a row differently by its place
    among a tile's rows (their tail rows take another micro-kernel); a GPU's MMA does not. Here
    each product is summed in float64 and rounded once to the accumulator's type: every row's
    result is then the same wherever it sits, on every CPU, and the test checks the kernel's
    own plan (one tile shape, the masks, the softmax order), not the host's BLAS."""
    import numpy as np
    from triton.runtime.interpreter import InterpreterBuilder, TensorHandle

    create_dot = InterpreterBuilder.create_dot

    def dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.dtype.primitive_bitwidth == 8 or b.dtype.primitive_bitwidth == 8:
            return create_dot(self, a, b, d, input_precision, max_num_imprecise_acc)
        product = np.matmul(a.data.astype(np.float64), b.data.astype(np.float64))
        return TensorHandle(product.astype(d.data.dtype) + d.data, d.dtype.scalar)

    monkeypatch.setattr(InterpreterBuilder, "create_dot", dot)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batch_invariant_tiles_give_a_prefill_row_what_its_decode_gives(dtype, row_exact_dot):
    """--deterministic: the backend takes the decode steps' tile for every step, so a prefill
    chunk's row (beside a decode of another sequence) gets bit for bit what the same row gets as a
    decode step of its own, its keys up to its position."""
    from types import SimpleNamespace

    from kvfleet.worker.engine.attention.backend import StepGeometry
    from kvfleet.worker.engine.attention.triton_backend import TritonBackend
    from kvfleet.worker.engine.memory.kv_cache import KVCachePool, KVLayout
    from kvfleet.worker.engine.memory.kv_format import resolve_kv_format
    from kvfleet.worker.engine.kernels.triton_attention import paged_attention, queries_per_tile

    torch.manual_seed(3)
    heads, kv_heads, dim, bs = 4, 2, 64, 16
    pool = KVCachePool(KVLayout(1, kv_heads, dim, resolve_kv_format("auto", dtype)), 12, bs,
                       torch.device("cpu"))
    rows = torch.arange(kv_heads * 12 * bs)
    pool.write(0, rows, torch.randn(len(rows), dim).to(dtype), torch.randn(len(rows), dim).to(dtype))
    geometry = StepGeometry.of(pool, heads, dtype)
    backend = TritonBackend(row_invariant=True)
    chunk = SimpleNamespace(num_tokens=20, start=70, end=90, block_table=[5, 1, 8, 3, 10, 0])
    other = SimpleNamespace(num_tokens=1, start=40, end=41, block_table=[2, 7, 4])
    step = backend.build_metadata(geometry, torch.zeros(0), [other], [chunk]).plan
    assert step.block_q == queries_per_tile(heads, kv_heads, has_prefill=False)
    assert TritonBackend().build_metadata(geometry, torch.zeros(0), [other], [chunk]).plan.block_q \
        == queries_per_tile(heads, kv_heads, has_prefill=True)
    query = torch.randn(heads, 21, dim).to(dtype)  # [H, T, D]: the decode row, then the chunk's
    out = torch.empty(21, heads, dim, dtype=dtype)
    paged_attention(query, pool, 0, step, dim ** -0.5, out)
    for i in (0, 7, 19):
        row = SimpleNamespace(num_tokens=1, start=70 + i, end=71 + i, block_table=chunk.block_table)
        alone = backend.build_metadata(geometry, torch.zeros(0), [row], []).plan
        single = torch.empty(1, heads, dim, dtype=dtype)
        paged_attention(query[:, 1 + i:2 + i], pool, 0, alone, dim ** -0.5, single)
        assert torch.equal(single[0], out[1 + i]), f"row {i}"
