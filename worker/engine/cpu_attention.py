"""Paged attention on the CPU: small C++ kernels (`cpu_attention.cpp` for decodes, `cpu_prefill.cpp`
for prefill chunks) built on first use.

Every decoding sequence's query (all query heads of a KV head together) attends over its K/V read
in place from the pool's blocks through its block table, with fp32 accumulation and an exact
softmax. Against the SDPA path it saves the dense copy of every group's K/V (`index_select`), the
padding of length groups and their masks: measured on a Zen 5 core at the default model's shapes
(32 sequences of 100-900 tokens), one layer's decode attention takes 3.3 ms in bf16 against
6.6 ms for gather + SDPA, and 4.2 against 29 ms in float32. Where the compiler targets AVX512-BF16
(`-march=native` on such a CPU), bf16 K/V take a path of pair dot products (vdpbf16ps) with the
keys' sums reduced 16 at a time, instead of one horizontal sum per key and query head: on a
2-core Xeon (AMX) at the default model's shapes 0.87-1.03 ms per layer against 1.11-1.20 ms.

The kernel (with the decoder layer's element-wise ops of `cpu_layer_ops.cpp`, cpu_layers.py) is
plain C++ with OpenMP and no torch headers: it compiles in about a second with the
system's C++ compiler (`$CXX`, default `g++`), for this machine's ISA (`-march=native`), into
`$KVFLEET_KERNEL_CACHE` (default ~/.cache/kvfleet/kernels) under a name that hashes the source,
the flags, the compiler and the CPU, and is loaded with ctypes. Its OpenMP calls run on the
libgomp that torch has already loaded (the loader shares a library by its soname), so the kernel
uses torch's thread pool and thread count. Without a compiler the worker keeps gather + SDPA
(`attention.resolve_attention_backend` says why at start-up).

Prefill chunks take the prefill kernel on CPUs with AVX-512 (bf16 with AVX512-BF16): each
chunk attends causally over its keys in place, its 16-token query tiles against 8 keys at a time
(bf16 in pair dot products). SDPA's CPU flash kernel needs a dense copy of a cached prefix and a
mask, and where MKL has no bf16 instructions to use (AMD's AVX512-BF16, no AMX) its bf16 products
run as fp32 sgemm on converted copies: measured on a 2-core Zen 5 at the default model's shapes
(9 query heads, 3 KV heads, head_dim 64), one layer's 512-token causal prefill takes 0.56 ms
against 3.5 ms in bf16, a 100-token chunk after 500 cached tokens 0.25 against 0.95 ms. CPUs
without AVX-512 keep SDPA.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from worker.engine.device import is_cpu
from worker.engine.kv_cache import KVCachePool

# one library: the decode and prefill kernels, the decoder layer's element-wise ops
# (cpu_layers.py) and the bf16 linear product (cpu_linear.py)
SOURCES = tuple(Path(__file__).with_name(name) for name in (
    "cpu_attention.cpp", "cpu_prefill.cpp", "cpu_layer_ops.cpp", "cpu_matmul.cpp"))
HEADERS = (Path(__file__).with_name("cpu_kernels.h"),)
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17")
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}  # the kernel's `dtype` argument
_ARGTYPES = (ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
             ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int,
             ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int,
             ctypes.c_float, ctypes.c_int)


_P, _I64, _I = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
PREFILL_ARGTYPES = {  # cpu_prefill.cpp
    "kvfleet_prefill_supported": (_I, _I),
    "kvfleet_paged_prefill": (_I, _P, _I64, _I64, _P, _P, _P, _I64, _P, _P, _P, _I, _I, _I, _I,
                              _I64, _I, ctypes.c_float, _I),
}
LAYER_OP_ARGTYPES = {  # cpu_layer_ops.cpp
    "kvfleet_rms_norm": (_I, _P, _P, _P, _P, _I64, _I, ctypes.c_float, _I),
    "kvfleet_rope": (_I, _P, _I64, _I, _I64, _I64, _I, _P, _P, _I),
    "kvfleet_silu_mul": (_I, _P, _P, _I64, _I, _I),
    "kvfleet_write_kv": (_I, _P, _P, _I64, _I64, _I, _I, _P, _I64, _P),
}
MATMUL_ARGTYPES = {  # cpu_matmul.cpp
    "kvfleet_linear_supported": (_I,),
    "kvfleet_pack_linear": (_I, _P, _I64, _I64, _P, _I),
    "kvfleet_linear": (_I, _P, _I64, _I64, _I64, _P, _I64, _P, _P, _I64, _I),
}


class KernelUnavailable(RuntimeError):
    """The kernel could not be built or loaded here (no compiler, a failed build)."""


@dataclass
class CpuDecodePlan:
    """The decoding sequences of a step, rows [0, num_seqs) of the flattened queries."""

    num_seqs: int
    block_tables: torch.Tensor  # [num_seqs, width] int32: the pages of each sequence's keys
    ctx_lens: torch.Tensor  # [num_seqs] int32: keys [0, ctx_len) including the step's token


@dataclass
class CpuPrefillPlan:
    """The prefill chunks of a step, for the prefill kernel (cpu_prefill.cpp)."""

    block_tables: torch.Tensor  # [num_chunks, width] int32: the pages of each chunk's keys
    q_starts: torch.Tensor  # [num_chunks] int32: the chunk's first row of the flattened queries
    q_lens: torch.Tensor  # [num_chunks] int32: its query tokens
    ctx_ends: torch.Tensor  # [num_chunks] int32: keys [0, ctx_end); queries at the last q_len


def kernel_cache_dir() -> Path:
    return Path(os.environ.get("KVFLEET_KERNEL_CACHE")
                or Path.home() / ".cache" / "kvfleet" / "kernels")


def _cpu_signature() -> str:
    """What -march=native depends on: the CPU's model and flags (first processor of cpuinfo)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    first = text.split("\n\n", 1)[0]
    keep = ("model name", "flags", "Features", "CPU part")
    return "\n".join(line for line in first.splitlines() if line.split(":")[0].strip() in keep)


def build_kernel(cache_dir: Path | None = None) -> Path:
    """Compile the kernel (once per source, flags, compiler and CPU) and return the library."""
    compiler = shutil.which(os.environ.get("CXX", "g++"))
    if compiler is None:
        raise KernelUnavailable(f"no C++ compiler ({os.environ.get('CXX', 'g++')}) on PATH")
    source = b"\0".join(p.read_bytes() for p in (*SOURCES, *HEADERS))
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True,
                                 timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise KernelUnavailable(f"{compiler} --version failed: {exc}") from exc
    key = hashlib.sha256(b"\0".join([source, " ".join(FLAGS).encode(), version.encode(),
                                     _cpu_signature().encode()])).hexdigest()[:16]
    cache_dir = cache_dir or kernel_cache_dir()
    target = cache_dir / f"cpu_attention-{key}.so"
    if target.exists():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    # build beside the target, then rename: workers starting together never load a partial file
    fd, partial = tempfile.mkstemp(suffix=".so", dir=cache_dir)
    os.close(fd)
    try:
        result = subprocess.run([compiler, *FLAGS, "-o", partial, *map(str, SOURCES)],
                                capture_output=True, text=True, timeout=300)
        if result.returncode != 0:
            names = " ".join(p.name for p in SOURCES)
            raise KernelUnavailable(f"compiling {names} failed: {result.stderr.strip()[-2000:]}")
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    return target


@functools.cache
def load_kernel() -> ctypes.CDLL:
    """The built kernel library (built on first call; raises KernelUnavailable)."""
    import torch  # noqa: F401  - torch's libgomp must be loaded first, so the kernel shares it
    try:
        lib = ctypes.CDLL(str(build_kernel()))
    except OSError as exc:
        raise KernelUnavailable(f"loading the kernel failed: {exc}") from exc
    lib.kvfleet_paged_decode.argtypes = _ARGTYPES
    for function, argtypes in (PREFILL_ARGTYPES | LAYER_OP_ARGTYPES | MATMUL_ARGTYPES).items():
        getattr(lib, function).argtypes = argtypes
    for function in ("kvfleet_paged_decode", *PREFILL_ARGTYPES, *LAYER_OP_ARGTYPES, *MATMUL_ARGTYPES):
        getattr(lib, function).restype = ctypes.c_int
    return lib


def unavailable_reason() -> str | None:
    """None when the kernel builds and loads here, else why not."""
    try:
        load_kernel()
    except KernelUnavailable as exc:
        return str(exc)
    return None


def supports(pool: KVCachePool, dtype: torch.dtype) -> bool:
    """The kernel reads plain float K/V in the model's own dtype (float32 or bfloat16); 8-bit
    formats and a K/V dtype other than the model's keep gather + SDPA."""
    fmt = pool.kv_format
    return (is_cpu(pool.device) and dtype in DTYPE_CODES and not fmt.is_quantized
            and fmt.storage == dtype and pool.rotation(dtype) is None)


def prefill_supported(pool: KVCachePool, dtype: torch.dtype, head_dim: int) -> bool:
    """The prefill kernel computes this pool's chunks here: K/V the decode kernel reads
    (`supports`), head_dim 64 or 128, a build for AVX-512 (float32) or AVX512-BF16 (bf16).
    Elsewhere prefill chunks keep SDPA."""
    if not supports(pool, dtype):
        return False
    try:
        return bool(load_kernel().kvfleet_prefill_supported(DTYPE_CODES[dtype], head_dim))
    except KernelUnavailable:
        return False


def _named(name: str):
    """The kernel's call named in a profile; nothing when no profiler runs (a record_function
    costs ~10 µs, 30 of them a step)."""
    if torch.autograd.profiler._is_profiler_enabled:
        return torch.profiler.record_function(name)
    return contextlib.nullcontext()


def paged_decode(query: torch.Tensor, pool: KVCachePool, layer: int, plan: CpuDecodePlan,
                 scaling: float, out: torch.Tensor) -> None:
    """Attention of the step's decode rows: query [H, T, D] (rows [0, num_seqs) are the
    decodes), written to out[:num_seqs] ([T, H, D], contiguous)."""
    if query.stride(-1) != 1:
        query = query.contiguous()
    num_heads, _, head_dim = query.shape
    kv = pool.layer(layer)  # [2, KVH, NB, bs, D], contiguous
    with _named("attention (cpu kernel)"):
        status = load_kernel().kvfleet_paged_decode(
            DTYPE_CODES[query.dtype], query.data_ptr(), query.stride(0), query.stride(1),
            kv.data_ptr(), out.data_ptr(), plan.block_tables.data_ptr(), plan.block_tables.shape[1],
            plan.ctx_lens.data_ptr(), plan.num_seqs, num_heads, pool.layout.num_kv_heads,
            head_dim, pool.num_blocks, pool.block_size, scaling, torch.get_num_threads())
    if status != 0:
        raise RuntimeError(f"kvfleet_paged_decode failed with status {status}")


def paged_prefill(query: torch.Tensor, pool: KVCachePool, layer: int, plan: CpuPrefillPlan,
                  scaling: float, out: torch.Tensor) -> None:
    """Causal attention of the step's prefill chunks over their keys in the pool (their own K/V
    already written): query [H, T, D] (last dim contiguous), out [T, H, D] contiguous; rows
    outside the chunks are left as they are."""
    if query.stride(-1) != 1:
        query = query.contiguous()
    num_heads, _, head_dim = query.shape
    kv = pool.layer(layer)  # [2, KVH, NB, bs, D], contiguous
    with _named("attention (cpu prefill kernel)"):
        status = load_kernel().kvfleet_paged_prefill(
            DTYPE_CODES[query.dtype], query.data_ptr(), query.stride(0), query.stride(1),
            kv.data_ptr(), out.data_ptr(), plan.block_tables.data_ptr(),
            plan.block_tables.shape[1], plan.q_starts.data_ptr(), plan.q_lens.data_ptr(),
            plan.ctx_ends.data_ptr(), plan.q_starts.shape[0], num_heads,
            pool.layout.num_kv_heads, head_dim, pool.num_blocks, pool.block_size, scaling,
            torch.get_num_threads())
    if status != 0:
        raise RuntimeError(f"kvfleet_paged_prefill failed with status {status}")


def write_kv(pool: KVCachePool, layer: int, key: torch.Tensor, value: torch.Tensor,
             rows: torch.Tensor) -> None:
    """The step's K and V ([T, KVH, D] views of one buffer, same strides, last two dims dense)
    into the pool at `rows` ([KVH * T] int64: h * slots + slot, AttentionMetadata.write_index),
    copied by the kernel library: no intermediate copy, no index_copy_."""
    assert key.stride() == value.stride() and key.stride(2) == 1 and key.stride(1) == key.shape[2]
    assert key.dtype == pool.kv_format.storage and rows.dtype == torch.int64 and rows.is_contiguous()
    kv = pool.layer(layer)  # [2, KVH, NB, bs, D]
    status = load_kernel().kvfleet_write_kv(
        DTYPE_CODES[key.dtype], key.data_ptr(), value.data_ptr(), key.stride(0), key.shape[0],
        key.shape[1], key.shape[2], rows.data_ptr(), kv.shape[1] * kv.shape[2] * kv.shape[3],
        kv.data_ptr())
    if status != 0:
        raise RuntimeError(f"kvfleet_write_kv failed with status {status}")
