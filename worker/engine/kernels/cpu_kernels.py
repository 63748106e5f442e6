"""The CPU's C++ kernels: the source each builds from, the header that types its binding, and
the loaded libraries, each built and loaded on its own.

| kernel    | source            | functions                                | without it            |
|-----------|-------------------|------------------------------------------|-----------------------|
| decode    | cpu_attention.cpp | kvfleet_paged_decode                     | gather + SDPA         |
| prefill   | cpu_prefill.cpp   | kvfleet_paged_prefill (AVX-512)          | SDPA prefill          |
| layer_ops | cpu_layer_ops.cpp | RMSNorm, RoPE, SiLU * up, K/V writes, LoRA terms | HF's decoder layers; LoRA in products |
| matmul    | cpu_matmul.cpp    | kvfleet_linear (AVX-512), kvfleet_linear_groups | oneDNN or F.linear |
| amx       | cpu_amx.cpp       | kvfleet_amx_linear (AMX tiles)           | matmul's bf16 forms   |

Each kernel is its own library (kernel_build.py), typed from its own header (kernel_binding.py):
a source that does not compile, or a library that does not load, disables only the functions it
provides; the reason is logged once and `unavailable_reason(name)` returns it.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from kvfleet.shared.settings import KernelSettings
from kvfleet.worker.engine.kernels.kernel_binding import BoundKernel, HeaderError, read_header
from kvfleet.worker.engine.kernels.kernel_build import KernelUnavailable, build, build_inputs, flags_for

log = logging.getLogger(__name__)

_HERE = Path(__file__).parent
COMMON_HEADERS = (_HERE / "cpu_kernels.h",)  # scalar helpers some sources include
SANITIZE_ENV = "KVFLEET_KERNEL_SANITIZE"


@dataclass(frozen=True)
class KernelSource:
    source: Path
    header: Path  # its `extern "C"` declarations


KERNELS = {name: KernelSource(_HERE / f"{stem}.cpp", _HERE / f"{stem}.h") for name, stem in (
    ("decode", "cpu_attention"), ("prefill", "cpu_prefill"), ("layer_ops", "cpu_layer_ops"),
    ("matmul", "cpu_matmul"), ("amx", "cpu_amx"))}


def kernel_cache_dir() -> Path:
    return KernelSettings().kernel_cache


def compiler_name() -> str:
    return os.environ.get("CXX", "g++")


def sanitizer() -> str | None:
    """`address` builds the kernels with AddressSanitizer (kernel_build.py), for the tests."""
    return KernelSettings().kernel_sanitize


def build_kernel(name: str, cache_dir: Path | None = None,
                 kernels: dict[str, KernelSource] = KERNELS) -> Path:
    """Compile kernel `name` (once per source, flags, compiler and CPU); return its library."""
    spec = kernels[name]
    return build(spec.source, (spec.header, *COMMON_HEADERS), compiler=compiler_name(),
                 cache_dir=cache_dir or kernel_cache_dir(), sanitize=sanitizer())


def build_all(cache_dir: Path | None = None) -> dict[str, Path | KernelUnavailable]:
    """Every kernel's library, compiled side by side (one compiler per kernel), or why not."""
    def attempt(name: str) -> Path | KernelUnavailable:
        try:
            return build_kernel(name, cache_dir)
        except KernelUnavailable as exc:
            return exc
    with ThreadPoolExecutor(max_workers=len(KERNELS)) as pool:
        return dict(zip(KERNELS, pool.map(attempt, KERNELS)))


class UnavailableKernel:
    """Stands for a kernel that did not build or load: any of its functions raises why."""

    def __init__(self, name: str, reason: str):
        self.name, self.reason = name, reason

    def __getattr__(self, function: str):
        if function.startswith("__"):
            raise AttributeError(function)  # copy, pickle and hasattr probe these
        raise KernelUnavailable(f"{function}: the {self.name} kernel is unavailable: {self.reason}")


@functools.cache
def kernel(name: str) -> BoundKernel | UnavailableKernel:
    """Kernel `name` of KERNELS, built on first call: its functions typed from its header
    (`kernel("matmul").kvfleet_linear(...)`), or an UnavailableKernel. Never raises."""
    _first_build()
    return build_and_bind(name, KERNELS)


@functools.cache
def _first_build() -> None:
    """A first start compiles every kernel side by side; later starts find them built."""
    build_all()


# Each kernel's own accessor, for the calls made every step: a cached call with no argument is
# the cheapest lookup Python has (kernel(name) hashes its argument).
@functools.cache
def decode_kernel() -> BoundKernel | UnavailableKernel:
    return kernel("decode")


@functools.cache
def prefill_kernel() -> BoundKernel | UnavailableKernel:
    return kernel("prefill")


@functools.cache
def layer_ops_kernel() -> BoundKernel | UnavailableKernel:
    return kernel("layer_ops")


@functools.cache
def matmul_kernel() -> BoundKernel | UnavailableKernel:
    return kernel("matmul")


@functools.cache
def amx_kernel() -> BoundKernel | UnavailableKernel:
    return kernel("amx")


def clear_cache() -> None:
    """Load every kernel afresh at next use (the tests change the compiler or the sources)."""
    for cached in (_first_build, kernel, decode_kernel, prefill_kernel, layer_ops_kernel,
                   matmul_kernel, amx_kernel):
        cached.cache_clear()


def build_and_bind(name: str, kernels: dict[str, KernelSource],
                   cache_dir: Path | None = None) -> BoundKernel | UnavailableKernel:
    """What `kernel` caches, for any table of kernels (the tests build broken ones)."""
    import torch  # noqa: F401  - torch's libgomp must be loaded first, so the kernel shares it
    spec = kernels[name]
    try:
        declarations = read_header(spec.header)
        library = ctypes.CDLL(str(build_kernel(name, cache_dir, kernels)))
        return BoundKernel(library, declarations)
    except (KernelUnavailable, HeaderError, OSError, AttributeError) as exc:
        log.warning("the %s kernel (%s) is unavailable: %s", name, spec.source.name, exc)
        return UnavailableKernel(name, str(exc))


def unavailable_reason(name: str) -> str | None:
    """None when kernel `name` builds and loads here, else why not."""
    loaded = kernel(name)
    return loaded.reason if isinstance(loaded, UnavailableKernel) else None


def build_signature() -> str:
    """What the kernels that load here were built from (sources, headers, flags, compiler), as
    12 hex digits of a SHA-256, with the names of those that do not load; for the numerics
    fingerprint (worker/engine/model/numerics.py)."""
    digest, missing = hashlib.sha256(), []
    for name, spec in KERNELS.items():
        if unavailable_reason(name) is not None:
            missing.append(name)
            continue
        digest.update(build_inputs(spec.source, (spec.header, *COMMON_HEADERS),
                                   shutil.which(compiler_name()) or compiler_name(),
                                   flags_for(sanitizer())))
    return digest.hexdigest()[:12] + "".join(f" (no {name})" for name in missing)


def report() -> str:
    """One line for logs: which kernels load here, and why the others do not."""
    reasons = {name: unavailable_reason(name) for name in KERNELS}
    loaded = [name for name, reason in reasons.items() if reason is None]
    missing = [f"{name} unavailable: {reason}" for name, reason in reasons.items()
               if reason is not None]
    return "; ".join([f"kernels loaded: {', '.join(loaded) or 'none'}", *missing])
