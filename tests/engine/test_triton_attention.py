"""The Triton paged-attention kernel under Triton's interpreter on CPU tensors, against the gather +
SDPA path as the oracle (tests/cuda runs the same cases compiled on a GPU)."""

from __future__ import annotations

import pytest
import torch

from tests.engine.paged_cases import CASES, run_case


from worker.engine.triton_attention import interpreting


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
