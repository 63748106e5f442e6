"""CUDA tests: deselected on CPU-only runs (tests/conftest.py), run by `pytest -m cuda`
(benchmarks/gpu_check.sh). Where they are selected, a missing GPU is a failure, not a skip."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def gpu() -> torch.device:
    assert torch.cuda.is_available(), "tests marked cuda need a CUDA GPU"
    return torch.device("cuda", torch.cuda.current_device())
