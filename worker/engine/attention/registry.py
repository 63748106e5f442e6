"""Which attention backend an engine runs: `--attention-backend auto|sdpa|cpu|triton` resolved
once, at start-up, from the device, the model's dtype, the pool's format and what builds here.
The one place that compares backend names."""

from __future__ import annotations

import torch

from kvfleet.worker.engine.kernels import cpu_attention
from kvfleet.worker.engine.attention.backend import AttentionBackend
from kvfleet.worker.engine.attention.cpu_backend import CpuBackend
from kvfleet.worker.engine.attention.sdpa_backend import SdpaBackend
from kvfleet.worker.engine.attention.triton_backend import TritonBackend
from kvfleet.worker.engine.memory.device import is_cpu, is_cuda
from kvfleet.worker.engine.memory.kv_cache import KVCachePool, KVLayout
from kvfleet.worker.engine.memory.kv_format import KVFormat
from kvfleet.worker.engine.kernels.triton_attention import interpreting, triton_available

ATTENTION_BACKENDS = ("auto", "sdpa", "cpu", "triton")


def resolve_backend_name(name: str, device: torch.device) -> str:
    """'auto' -> the Triton paged kernel on CUDA when triton is importable; on a CPU the C++
    kernels when they build here (cpu_attention.py), else gather + SDPA.

    'triton' on a device the compiled kernel cannot run on is refused here, at start-up, rather
    than failing every request at its first step; only Triton's interpreter (TRITON_INTERPRET=1,
    which the tests set) runs the kernel on CPU tensors.
    """
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}; "
                         f"got {name!r}")
    if name == "auto":
        if is_cuda(device) and triton_available():
            return "triton"
        if is_cpu(device) and cpu_attention.unavailable_reason() is None:
            return "cpu"
        return "sdpa"
    if name == "cpu" and not is_cpu(device):
        raise ValueError(f"attention_backend 'cpu' runs on the CPU only, and the device is {device}")
    if name == "cpu" and (reason := cpu_attention.unavailable_reason()) is not None:
        raise ValueError(f"attention_backend 'cpu' needs its C++ kernel, which is unavailable: "
                         f"{reason}")
    if name == "triton" and not triton_available():
        raise ValueError("attention_backend 'triton' needs the `triton` package")
    if name == "triton" and not is_cuda(device) and not interpreting():
        raise ValueError(f"attention_backend 'triton' runs on CUDA devices only, and the device is "
                         f"{device}: use 'auto' or 'sdpa' there")
    return name


def resolve_attention_backend(name: str, device: torch.device, dtype: torch.dtype,
                              kv_format: KVFormat, head_dim: int,
                              deterministic: bool = False) -> AttentionBackend:
    """The backend `name` resolves to (resolve_backend_name's errors for one that cannot run
    here), batch-invariant where `deterministic` and it can be. The CPU kernels read plain K/V in
    the model's dtype: for another pool format 'cpu' keeps gather + SDPA, and says so."""
    resolved = resolve_backend_name(name, device)
    if resolved == "triton":
        return TritonBackend(row_invariant=deterministic)
    if resolved == "sdpa":
        note = None
        if is_cpu(device):
            note = f"the C++ decode kernel: {cpu_attention.unavailable_reason() or 'not asked for'}"
        return SdpaBackend(note=note)
    # the kernels' own checks take a pool: a one-slot pool of the format asks them before the
    # real pool is sized (its block size depends on this answer)
    probe = KVCachePool(KVLayout(1, 1, head_dim, kv_format), 1, 1, device)
    if not cpu_attention.supports(probe, dtype):
        return SdpaBackend("cpu", note=f"gather + SDPA for --kv-dtype {kv_format.name}: the "
                                       f"kernel reads plain K/V")
    return CpuBackend(prefill_kernel=cpu_attention.prefill_supported(probe, dtype, head_dim),
                      row_invariant=deterministic,
                      amx_tiles=cpu_attention.amx_attention_supported(probe, dtype, head_dim),
                      prefill_rows=cpu_attention.prefill_rows_supported(probe, dtype, head_dim))
