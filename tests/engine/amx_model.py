"""A scalar model, in numpy, of kvfleet's bf16 product on AMX tiles (worker/engine/kernels/cpu_amx.cpp):
the weights' tile layout, and the sums TDPBF16PS makes of them, step by step.

Each step is an fp32 fused multiply-add: the product of two bf16 values is exact in float64 (8
significant bits each), and float64's sum of it and an fp32 rounded to fp32 is the correctly
rounded fp32 sum (float64 has more than twice fp32's bits plus two, so rounding twice is
innocuous), which is what an FMA gives. Denormal inputs count as zero and denormal results are
flushed (DAZ, FTZ), as the instruction does; the output's conversion to bf16 is VCVTNEPS2BF16's
(round to nearest even, denormal inputs zero).

`sequential=False` is Intel's SDM pseudo-code (per tile of 32 columns, the even and the odd
columns summed apart from zero, then added together into the output's sum), `True` the
intrinsics guide's (one sum per output, each column added in order: the sums of cpu_matmul.cpp's
`fma` form).
"""

from __future__ import annotations

import numpy as np
import torch

TILE_K = 32  # bf16 columns per k tile
LANES = 16  # outputs per block
SMALLEST_NORMAL = np.float32(2.0 ** -126)


def bits(t: torch.Tensor) -> np.ndarray:
    """A bf16 tensor's bits as uint16."""
    return t.contiguous().view(torch.int16).numpy().view(np.uint16)


def widen(b: np.ndarray) -> np.ndarray:
    """bf16 bits -> float32 values (the high half of the fp32 bits)."""
    return (b.astype(np.uint32) << 16).view(np.float32)


def flush(v: np.ndarray) -> np.ndarray:
    """Denormals to zero of the same sign."""
    return np.where(np.abs(v) < SMALLEST_NORMAL, np.copysign(np.float32(0), v), v).astype(np.float32)


def to_bf16(v: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bits: denormals zero, round to nearest even (finite values)."""
    u = flush(v).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def k_tiles(k: int) -> int:
    return -(-k // TILE_K)


def packed_size(n: int, k: int) -> int:
    return -(-n // LANES) * LANES * k_tiles(k) * TILE_K


def pack(w: np.ndarray) -> np.ndarray:
    """w [n, k] bf16 bits -> the B tiles: [n/16][k/32 * 16 pairs][16 outputs][2], zero padded."""
    n, k = w.shape
    padded = np.zeros((-(-n // LANES) * LANES, k_tiles(k) * TILE_K), dtype=np.uint16)
    padded[:n, :k] = w
    blocks = padded.reshape(-1, LANES, padded.shape[1] // 2, 2)  # [block][lane][pair][h]
    return blocks.transpose(0, 2, 1, 3).reshape(-1)


def _fma_step(x: np.ndarray, w: np.ndarray, acc: np.ndarray) -> np.ndarray:
    """acc[i, j] + x[i] * w[j], the product exact, one rounding to fp32, FTZ."""
    exact = acc.astype(np.float64) + np.outer(x.astype(np.float64), w.astype(np.float64))
    return flush(exact.astype(np.float32))


def _add_step(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return flush(flush(a) + flush(b))


def product(x: np.ndarray, w: np.ndarray, bias: np.ndarray | None,
            sequential: bool = False) -> np.ndarray:
    """x [m, k] and w [n, k] bf16 bits, bias n float32 or None -> y [m, n] bf16 bits."""
    (m, k), n = x.shape, w.shape[0]
    width = k_tiles(k) * TILE_K
    xf = np.zeros((m, width), dtype=np.float32)
    wf = np.zeros((n, width), dtype=np.float32)
    xf[:, :k], wf[:, :k] = flush(widen(x)), flush(widen(w))
    sums = np.zeros((m, n), dtype=np.float32)
    for tile in range(width // TILE_K):
        columns = range(tile * TILE_K, (tile + 1) * TILE_K)
        if sequential:
            for c in columns:
                sums = _fma_step(xf[:, c], wf[:, c], sums)
            continue
        even = np.zeros((m, n), dtype=np.float32)
        odd = np.zeros((m, n), dtype=np.float32)
        for c in columns[::2]:
            even = _fma_step(xf[:, c], wf[:, c], even)
            odd = _fma_step(xf[:, c + 1], wf[:, c + 1], odd)
        sums = _add_step(sums, _add_step(even, odd))
    # the kernel adds the bias, or +0 (which turns a flushed -0 into +0), in fp32
    return to_bf16(sums + (np.zeros(n, np.float32) if bias is None else bias.astype(np.float32)))
