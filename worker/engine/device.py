"""The engine's device: selecting it, putting a model on it without losing its fp32 buffers, the
attention backend it runs, and telling an error that poisons the device from one that fails a
request."""

from __future__ import annotations

import torch

from worker.engine import cpu_attention
from worker.engine.triton_attention import interpreting, triton_available

ATTENTION_BACKENDS = ("auto", "sdpa", "cpu", "triton")
# Tokens per KV block by default. The C++ CPU decode kernel reads a bf16 pool page by page, and a
# page of 16 rows of one KV head (2 KB) is too short for the CPU's prefetchers: once a
# long-running pool's free blocks are in no order, every page start waits on memory. Pages of 64
# rows measured 8-13% faster bf16 decode steps at 32-64 streams, float32 only 3% (docs/
# BENCHMARKS.md, "KV blocks of 64 tokens for the bf16 CPU kernel"): too little for coarser prefix
# reuse where float32 is the default (AVX2-only CPUs, not measured). Everywhere else (float32
# pools, 8-bit pools, Triton on CUDA, gather + SDPA) 16.
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


def select_device(device: torch.device) -> None:
    """Make `device` the current CUDA device, so that `cuda:N` holds for every allocation, stream
    and kernel launch that names no device (Triton launches on the current device)."""
    if device.type == "cuda":
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


def resolve_block_size(block_size: int | None, attention_backend: str, dtype: torch.dtype,
                       kv_storage: torch.dtype) -> int:
    """The KV block size: the one configured, else the default for the resolved attention
    backend, the model's dtype and the pool's element type (`kv_storage`: uint8 for 8-bit
    formats; the CPU kernel reads a pool of the model's own dtype only)."""
    if block_size is not None:
        return block_size
    if attention_backend == "cpu" and kv_storage == dtype == torch.bfloat16:
        return CPU_BF16_BLOCK_SIZE
    return DEFAULT_BLOCK_SIZE


def resolve_attention_backend(name: str, device: torch.device) -> str:
    """'auto' -> the Triton paged kernel on CUDA when triton is importable; on a CPU the C++
    decode kernel when it builds here (cpu_attention.py), else gather + SDPA.

    'triton' on a device the compiled kernel cannot run on is refused here, at start-up, rather
    than failing every request at its first step; only Triton's interpreter (TRITON_INTERPRET=1,
    which the tests set) runs the kernel on CPU tensors.
    """
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}; "
                         f"got {name!r}")
    if name == "auto":
        if device.type == "cuda" and triton_available():
            return "triton"
        if device.type == "cpu" and cpu_attention.unavailable_reason() is None:
            return "cpu"
        return "sdpa"
    if name == "cpu" and device.type != "cpu":
        raise ValueError(f"attention_backend 'cpu' runs on the CPU only, and the device is {device}")
    if name == "cpu" and (reason := cpu_attention.unavailable_reason()) is not None:
        raise ValueError(f"attention_backend 'cpu' needs its C++ kernel, which is unavailable: "
                         f"{reason}")
    if name == "triton" and not triton_available():
        raise ValueError("attention_backend 'triton' needs the `triton` package")
    if name == "triton" and device.type != "cuda" and not interpreting():
        raise ValueError(f"attention_backend 'triton' runs on CUDA devices only, and the device is "
                         f"{device}: use 'auto' or 'sdpa' there")
    return name
