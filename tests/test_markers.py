"""The `cuda` marker: GPU tests run only in a run aimed at them (`-m cuda`), which is also the only
run that compiles the Triton kernels; every other run interprets them on CPU tensors."""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.conftest import interpret_unless_a_gpu_run, selects_cuda
from kvfleet.worker.engine.kernels.triton_attention import interpreting

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("markexpr, aimed", [
    ("", False), ("cuda", True), ("cuda and not slow", True), ("cuda or slow", True),
    ("not cuda", False), ("not slow", False), ("slow", False), ("not slow and not e2e", False)])
def test_which_mark_expressions_select_the_gpu_tests(markexpr, aimed):
    assert selects_cuda(markexpr) is aimed


def test_only_a_gpu_run_leaves_the_interpreter_off(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    interpret_unless_a_gpu_run("cuda")
    assert "TRITON_INTERPRET" not in os.environ
    interpret_unless_a_gpu_run("not slow")
    assert os.environ["TRITON_INTERPRET"] == "1"


def test_this_run_interprets_the_kernels():
    assert interpreting()  # a run that selects this unmarked test is not a `-m cuda` run


def pytest_run(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=240, env=env)


# The pytest runs the tests below look at, by name: started all at once, as each spends seconds
# importing torch and triton.
RUNS = {"plain": ("--collect-only", "tests/cuda"),
        "aimed": ("--collect-only", "-m", "cuda", "tests/cuda"),
        "kernel": ("tests/engine/test_triton_engine.py::test_triton_backend_equals_hf_generate",)}


@pytest.fixture(scope="module")
def pytest_runs() -> dict[str, Future]:
    with ThreadPoolExecutor(max_workers=len(RUNS)) as pool:
        yield {name: pool.submit(pytest_run, *args) for name, args in RUNS.items()}


def test_the_gpu_tests_are_deselected_unless_selected(pytest_runs):
    plain = pytest_runs["plain"].result().stdout
    aimed = pytest_runs["aimed"].result().stdout
    assert "no tests collected" in plain and "deselected" in plain
    assert "tests/cuda/test_cuda_kernels.py::" in aimed and "deselected" not in aimed


def test_kernel_tests_given_by_path_run_interpreted(pytest_runs):
    """Given a test path, pytest loads tests/engine/conftest.py (which imports the engine, and so
    triton) before `pytest_configure`: the interpreter must be chosen earlier than that."""
    done = pytest_runs["kernel"].result()
    assert done.returncode == 0, done.stdout[-3000:]
