"""How K/V values are stored in the pool: plain floats, or 8-bit codes with a scale per token and
KV head (`--kv-dtype`).

fp8 (e4m3) and int8 store one byte per value plus one fp16 scale for each (token, KV head) row of
`head_dim` values: `value ~= code * scale`, with `scale = max|row| / qmax`. A row's scale is fixed
when the token is written (tokens are written once, in place), so no block is ever requantised and
a row's error never grows. With head_dim 64 that is 66 bytes instead of bf16's 128: 1.94x the
tokens; 1.97x at head_dim 128. Attention dequantises on read, in the model's dtype.

int8 rows are rotated before quantising (`rows @ R`, R orthonormal: a Hadamard matrix, or a
seeded random rotation when head_dim is not a power of two). Keys carry a few outlier channels
that set every row's max and leave the other channels few codes; rotating spreads them over all
channels, which cuts the int8 error of such keys (docs/BENCHMARKS.md, "KV cache formats").
Attention never un-rotates the cache: since R is orthonormal, q.k = (qR).(kR), so it rotates the
queries and un-rotates the output (p.V = (p.VR)R^T), a [T, D] x [D, D] product per call. fp8 is
not rotated: its error is relative to each value, and rotating made it slightly worse.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

KV_DTYPE_CHOICES = ("auto", "bf16", "fp16", "fp32", "fp8", "int8")
_FLOATS = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_MODEL_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
SCALE_DTYPE = torch.float16
# fp16's smallest subnormal is ~6e-8: a row whose values are all below this stores zeros.
_MIN_SCALE = 2.0 ** -24


@dataclass(frozen=True)
class KVFormat:
    """One storage format: the element type in the pool and, for 8-bit codes, the scale type.

    `storage` is what the pool tensor holds (fp8 codes are kept as uint8 and viewed as
    float8_e4m3fn when converted, because index copies are not implemented for float8 on every
    device); `code` is the type the codes mean.
    """

    name: str
    storage: torch.dtype
    code: torch.dtype | None = None  # None: values stored as they are (plain float format)
    qmax: float = 0.0  # largest code magnitude
    rotate: bool = False  # rows are stored rotated (see the module docstring)

    @property
    def is_quantized(self) -> bool:
        return self.code is not None

    @property
    def element_bytes(self) -> int:
        return torch.tensor([], dtype=self.storage).element_size()

    @property
    def scale_bytes(self) -> int:
        """Bytes of scale per (token, KV head) row."""
        return torch.tensor([], dtype=SCALE_DTYPE).element_size() if self.is_quantized else 0

    def row_bytes(self, head_dim: int) -> int:
        """Bytes for one token's K (or V) of one KV head."""
        return head_dim * self.element_bytes + self.scale_bytes

    def quantize(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[N, D] values -> ([N, D] storage codes, [N] scales or None)."""
        if not self.is_quantized:
            return rows.to(self.storage), None
        x = rows.float()
        scale = (x.abs().amax(dim=-1) / self.qmax).clamp_min(_MIN_SCALE).to(SCALE_DTYPE)
        # divide by the scale as stored, so that code * stored scale reconstructs the value
        codes = (x / scale.float().unsqueeze(-1)).clamp(-self.qmax, self.qmax)
        if self.code is torch.int8:
            return codes.round().to(torch.int8), scale
        return codes.to(self.code).view(self.storage), scale

    def dequantize(self, codes: torch.Tensor, scale: torch.Tensor | None,
                   dtype: torch.dtype) -> torch.Tensor:
        """[..., D] storage codes and [...] scales -> [..., D] values in `dtype`."""
        if not self.is_quantized:
            return codes.to(dtype)
        values = codes.view(self.code) if self.code is not torch.int8 else codes
        return values.to(dtype) * scale.to(dtype).unsqueeze(-1)


_FORMATS = {
    **{name: KVFormat(name, dtype) for name, dtype in _FLOATS.items()},
    "fp8": KVFormat("fp8", torch.uint8, torch.float8_e4m3fn, torch.finfo(torch.float8_e4m3fn).max),
    "int8": KVFormat("int8", torch.int8, torch.int8, 127.0, rotate=True),
}


def rotation_matrix(dim: int) -> torch.Tensor:
    """An orthonormal [dim, dim] float32 matrix: Sylvester's Hadamard / sqrt(dim) when dim is a
    power of two, else the Q of a seeded Gaussian's QR decomposition."""
    if dim & (dim - 1) == 0:
        h = torch.ones(1, 1)
        while h.shape[0] < dim:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
        return h / dim ** 0.5
    gaussian = torch.randn(dim, dim, generator=torch.Generator().manual_seed(dim))
    q, _ = torch.linalg.qr(gaussian)
    return q


def resolve_kv_format(name: str, model_dtype: torch.dtype) -> KVFormat:
    """'auto' -> the model's own dtype (no conversion); else the named format."""
    if name == "auto":
        name = _MODEL_DTYPE_NAMES[model_dtype]
    if name not in _FORMATS:
        raise ValueError(f"kv_dtype must be one of {', '.join(KV_DTYPE_CHOICES)}; got {name!r}")
    return _FORMATS[name]
