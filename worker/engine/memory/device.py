"""The engine's device and dtype: resolving and selecting them, telling what kind a device is,
putting a model on it without losing its fp32 buffers, the KV block size, and telling an error
that poisons the device from one that fails a request. The one place that compares device types
(the `is_*` predicates)."""

from __future__ import annotations

import torch

from kvfleet.shared.cpu_features import CpuFeatures, cpu_features

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Tokens per KV block by default. The C++ CPU decode kernel reads a bf16 pool page by page, and a
# page of 16 rows of one KV head is too short for the CPU's prefetchers: once a long-running
# pool's free blocks are in no order, every page start waits on memory. Pages of 64 rows make
# bf16 decode steps faster (docs/BENCHMARKS.md, "KV blocks of 64 tokens for the bf16 CPU
# kernel"); for float32 the gain is too small to give up finer prefix reuse. Everywhere else
# (float32 pools, 8-bit pools, Triton on CUDA, gather + SDPA) 16.
CPU_BF16_BLOCK_SIZE = 64
DEFAULT_BLOCK_SIZE = 16

# Messages of errors after which a CUDA context cannot run anything again (older torch raises
# them as plain RuntimeError; newer ones as torch.AcceleratorError).
_STICKY_MARKERS = (
    "CUDA error", "device-side assert", "illegal memory access", "unspecified launch failure",
    "CUBLAS_STATUS_EXECUTION_FAILED", "CUBLAS_STATUS_INTERNAL_ERROR", "cuDNN error",
    "misaligned address", "an illegal instruction",
)


class DeviceFailure(RuntimeError):
    """The device is in a state no later step can use. The worker process must exit: its requests
    stay pending in Redis and resume on another worker (a restarted process gets a fresh context)."""


def is_sticky_device_error(error: BaseException) -> bool:
    """Whether `error` leaves the device unusable (an out-of-memory error does not)."""
    if isinstance(error, torch.OutOfMemoryError):
        return False
    accelerator_error = getattr(torch, "AcceleratorError", None)
    if accelerator_error is not None and isinstance(error, accelerator_error):
        return True
    text = str(error)
    return isinstance(error, RuntimeError) and any(marker in text for marker in _STICKY_MARKERS)


def is_cuda(device: torch.device) -> bool:
    return device.type == "cuda"


def is_cpu(device: torch.device) -> bool:
    return device.type == "cpu"


def resolve_device(name: str) -> torch.device:
    """'auto' -> the first CUDA device when there is one, else the CPU; 'cuda' -> cuda:<current>."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if is_cuda(device) and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def resolve_dtype(name: str, device: torch.device, cpu: CpuFeatures | None = None) -> torch.dtype:
    """'auto' -> bfloat16 on CUDA and on CPUs with native bf16 (AMX or AVX512-BF16), else float32
    (where bf16 is emulated it is slower than float32). `cpu` defaults to this machine's."""
    if name == "auto":
        if is_cuda(device):
            return torch.bfloat16
        native = (cpu or cpu_features()).native_bf16 if is_cpu(device) else False
        return torch.bfloat16 if native else torch.float32
    if name not in _DTYPES:
        raise ValueError(f"dtype must be auto, {', '.join(_DTYPES)}; got {name!r}")
    return _DTYPES[name]


def select_device(device: torch.device) -> None:
    """Make `device` the current CUDA device, so that `cuda:N` holds for every allocation, stream
    and kernel launch that names no device (Triton launches on the current device)."""
    if is_cuda(device):
        torch.cuda.set_device(device)


def place_model(model: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """Move the model to `device` and cast its weights to `dtype`; fp32 buffers stay fp32.

    `model.to(dtype)` would also cast buffers such as RoPE's inv_freq: in bf16 the angles of far
    apart positions collapse. transformers' own `from_pretrained(dtype=...)` keeps them fp32.
    """
    fp32_buffers = [(name, buf) for name, buf in model.named_buffers()
                    if buf.dtype == torch.float32]
    model.to(device=device, dtype=dtype)
    for name, buf in fp32_buffers:
        owner_name, _, attr = name.rpartition(".")
        owner = model.get_submodule(owner_name) if owner_name else model
        owner._buffers[attr] = buf.to(device)
    return model


def resolve_block_size(block_size: int | None, cpu_kernel: bool, dtype: torch.dtype,
                       kv_storage: torch.dtype) -> int:
    """The KV block size: the one configured, else the default for the attention backend
    (`cpu_kernel`: it reads the pool page by page through the C++ kernel, AttentionBackend's
    property), the model's dtype and the pool's element type (`kv_storage`: uint8 for 8-bit
    formats)."""
    if block_size is not None:
        return block_size
    if cpu_kernel and kv_storage == dtype == torch.bfloat16:
        return CPU_BF16_BLOCK_SIZE
    return DEFAULT_BLOCK_SIZE
