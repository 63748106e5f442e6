"""Fixtures of the engine tests: tiny random models (one per family) and their references."""

from __future__ import annotations

import pytest
import torch

from tests.engine.tiny_models import MODEL_FACTORIES, TinyModel


@pytest.fixture(scope="session", autouse=True)
def one_torch_thread():
    """Tiny models gain nothing from a second thread, and on a shared CPU OpenMP's spinning
    threads slow everything down; one thread keeps these tests fast and steady."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session", params=sorted(MODEL_FACTORIES))
def tiny(request) -> TinyModel:
    return TinyModel(request.param)


@pytest.fixture(scope="session")
def tiny_llama() -> TinyModel:
    return TinyModel("llama")
