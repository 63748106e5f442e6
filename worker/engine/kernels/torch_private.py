"""Every private torch API kvfleet calls, in one module: each behind a check and a public fallback,
so that a torch release that renames or changes one costs speed, never a wrong result or a crash.

| private API                                   | what for                        | fallback            |
|-----------------------------------------------|---------------------------------|---------------------|
| torch.ops.mkldnn._reorder_linear_weight,      | linear weights packed once for  | F.linear            |
| torch.ops.mkldnn._linear_pointwise            | oneDNN (cpu_linear.PackedLinear)|                     |
| torch.ops.mkldnn._is_mkldnn_bf16_supported    | whether oneDNN packs bf16 here  | /proc/cpuinfo flags |
| torch.autograd.profiler._is_profiler_enabled  | kernel calls named in a profile | calls left unnamed  |
|                                               | only while a profiler runs      |                     |

On the torch versions in CHECKED_TORCH (the test suite passed there,
tests/engine/test_torch_private.py among it) the ops are used where they exist. On any other
version the packed product is first tried once per dtype on a small matrix against F.linear, and
used only if it runs and agrees; else F.linear stays, and the log says why. The profiler flag is
read only where it is the bool it has always been; a missing one leaves kernel calls unnamed
rather than naming every call (a record_function costs microseconds, dozens per step).
"""

from __future__ import annotations

import contextlib
import functools
import logging

import torch
import torch.autograd.profiler as _profiler
import torch.nn.functional as F

from kvfleet.shared.cpu_features import cpu_features

log = logging.getLogger(__name__)

# torch (major, minor) versions the private calls below were checked on: add one after the test
# suite passes on it (pyproject allows torch>=2.5; other versions take the probe)
CHECKED_TORCH = ((2, 13),)
_PROBE_TOLERANCE = {torch.bfloat16: 2 ** -7, torch.float32: 1e-5}  # relative to the output


def torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def version_checked() -> bool:
    return torch_version() in CHECKED_TORCH


def _mkldnn_op(name: str):
    """torch.ops.mkldnn.<name>, or None where this build has no such op."""
    try:
        return getattr(torch.ops.mkldnn, name)
    except (AttributeError, RuntimeError):
        return None


@functools.cache
def onednn_bf16_supported() -> bool:
    """oneDNN computes bf16 natively here (AVX512-BF16, AMX or AVX-NE-CONVERT)."""
    check = _mkldnn_op("_is_mkldnn_bf16_supported")
    if check is not None:
        try:
            return bool(check())
        except RuntimeError as exc:
            log.warning("torch.ops.mkldnn._is_mkldnn_bf16_supported failed (%s): the CPU's "
                        "flags decide", exc)
    return cpu_features().native_bf16


@functools.cache
def onednn_packing_available(dtype: torch.dtype) -> bool:
    """oneDNN's packed linear (pack_linear_weight, linear_op) computes `dtype` here."""
    if (dtype not in _PROBE_TOLERANCE or not torch.backends.mkldnn.is_available()
            or _mkldnn_op("_reorder_linear_weight") is None
            or _mkldnn_op("_linear_pointwise") is None
            or (dtype == torch.bfloat16 and not onednn_bf16_supported())):
        return False
    if version_checked():
        return True
    try:
        agrees = _probe_packed_linear(dtype)
    except RuntimeError as exc:
        log.warning("torch %s: oneDNN's packed linear fails (%s); linears stay on F.linear",
                    torch.__version__, exc)
        return False
    if not agrees:
        log.warning("torch %s: oneDNN's packed linear disagrees with F.linear; linears stay on "
                    "F.linear", torch.__version__)
    return agrees


def _probe_packed_linear(dtype: torch.dtype) -> bool:
    """The packed product of a small random linear, with bias, against F.linear."""
    generator = torch.Generator().manual_seed(0)
    weight, bias, x = (torch.randn(*shape, generator=generator).to(dtype)
                       for shape in ((48, 40), (48,), (3, 40)))
    expected = F.linear(x, weight, bias).float()
    got = linear_op()(x, pack_linear_weight(weight, 64), bias, "none", [], "").float()
    scale = expected.abs().max().item()
    return got.shape == expected.shape and (got - expected).abs().max().item() <= (
        _PROBE_TOLERANCE[dtype] * scale)


def pack_linear_weight(weight: torch.Tensor, batch_hint: int) -> torch.Tensor:
    """`weight` [out, in] in oneDNN's blocked layout (an opaque mkldnn tensor), tuned for
    `batch_hint` rows; only where onednn_packing_available(weight.dtype)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, batch_hint)


def linear_op():
    """The op computing `op(x, packed, bias, "none", [], "")` = F.linear over a packed weight,
    resolved once by the caller (a decode step calls it a few hundred times)."""
    return torch.ops.mkldnn._linear_pointwise


_HAS_PROFILER_FLAG = isinstance(getattr(_profiler, "_is_profiler_enabled", None), bool)
_UNNAMED = contextlib.nullcontext()


def named_while_profiling(name: str):
    """record_function(name) while a profiler runs; else a context that does nothing (a
    record_function costs microseconds even with no profiler)."""
    if _HAS_PROFILER_FLAG and _profiler._is_profiler_enabled:
        return torch.profiler.record_function(name)
    return _UNNAMED
