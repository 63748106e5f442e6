"""The C++ kernels under AddressSanitizer: a selection of their tests runs in a child process whose
kernels are built with `-fsanitize=address` (KVFLEET_KERNEL_SANITIZE=address) and which has the
ASan runtime preloaded, so a read or write outside a tensor fails the run.

Marked `sanitizer` (about a minute on 2 cores: the instrumented builds, then torch's import
under ASan); `-m "not sanitizer"` leaves it out. It needs g++'s libasan; where that is missing it
fails and says so, as the kernels' other tests fail without a compiler: a run that should check
the kernels does not pass without checking them.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvfleet.worker.engine.kernels import cpu_kernels

pytestmark = pytest.mark.sanitizer

ROOT = Path(__file__).resolve().parents[2]
# every kernel function, both dtypes, decode and prefill shapes, the fused layer in the engine
SELECTION = [
    "tests/engine/test_cpu_layers.py::test_rms_norm_with_and_without_the_residual_add",
    "tests/engine/test_cpu_layers.py::test_rope_in_place_on_a_strided_view",
    "tests/engine/test_cpu_layers.py::test_silu_times_up",
    "tests/engine/test_cpu_layers.py::test_fused_layers_decode_what_hf_layers_decode[llama]",
    "tests/engine/test_cpu_kernels.py::test_own_product_follows_the_exact_product",
    "tests/engine/test_cpu_kernels.py::test_own_product_takes_strided_and_batched_input_and_still_copies",
    # the AMX kernel's packing, and its emulation's tile loads: what the real tiles would read
    "tests/engine/test_cpu_amx.py::test_the_weights_pack_into_b_tiles",
    "tests/engine/test_cpu_amx.py::test_the_emulated_tiles_sum_as_the_sdm_model",
    *(f"tests/engine/test_cpu_attention.py::test_cpu_kernels_match_gather_and_sdpa[{case}]"
      for case in ("fp32-g1-d64-mixed", "bf16-default-shape-bs16", "bf16-g4-d64-bs5",
                   "bf16-prefill-g3-d64-bs64", "fp32-prefill-g6-d128-bs3",
                   "bf16-prefill-g12-d64-bs32")),
]
# a kernel asked to read one row past its input: ASan must stop it
OVERFLOW = """
import torch
from kvfleet.worker.engine.kernels.cpu_kernels import layer_ops_kernel
gate_up = torch.randn(4, 64)
out = torch.empty(5, 32)
layer_ops_kernel().kvfleet_silu_mul(0, gate_up.data_ptr(), out.data_ptr(), 5, 32, 1)
print("not stopped")
"""


def asan_runtime() -> str:
    compiler = cpu_kernels.compiler_name()
    try:
        path = subprocess.run([compiler, "-print-file-name=libasan.so"], capture_output=True,
                              text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError) as exc:
        pytest.fail(f"{compiler} did not run ({exc}): the sanitizer build needs g++ and libasan")
    if not os.path.isabs(path) or not os.path.exists(path):
        pytest.fail(f"{compiler} has no AddressSanitizer runtime (libasan.so): install it "
                    "(Debian: libasan8, part of gcc) to run the kernels under ASan")
    return path


@pytest.fixture(scope="module")
def asan_env() -> dict[str, str]:
    env = {**os.environ, "LD_PRELOAD": asan_runtime(), "ASAN_OPTIONS": "detect_leaks=0",
           cpu_kernels.SANITIZE_ENV: "address", "PYTHONPATH": str(ROOT)}
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(cpu_kernels.SANITIZE_ENV, "address")
        built = cpu_kernels.build_all()  # side by side, before the child loads them one by one
    failed = {name: str(result) for name, result in built.items() if not isinstance(result, Path)}
    assert not failed, f"the instrumented builds failed: {failed}"
    return env


def run(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)


def test_asan_stops_a_kernel_that_reads_past_its_input(asan_env):
    """The harness works: the libraries are instrumented and the runtime is loaded."""
    result = run(asan_env, "-c", OVERFLOW)
    assert result.returncode != 0 and "not stopped" not in result.stdout
    assert "AddressSanitizer: heap-buffer-overflow" in result.stderr, result.stderr[-3000:]
    assert "kvfleet_silu_mul" in result.stderr


def test_the_kernel_tests_pass_under_asan(asan_env):
    result = run(asan_env, "-m", "pytest", "-q", "-p", "no:cacheprovider", *SELECTION)
    report = (result.stdout + result.stderr)[-6000:]
    assert result.returncode == 0, report
    assert "AddressSanitizer" not in result.stderr, report
    assert " passed" in result.stdout, report
