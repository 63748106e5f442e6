"""What this CPU can do for the engine: its model name, the widest matrix ISA it has (AMX,
AVX-512, AVX2) and whether bf16 matmuls run natively, read from /proc/cpuinfo (Linux x86).

`--dtype auto` picks bf16 only where it runs natively (AMX-BF16 tiles or AVX512-BF16 dot
products): where bf16 is emulated (AVX2 only, or an unknown CPU) torch converts to fp32 and back
around every matmul, slower than fp32 itself.
"""

from __future__ import annotations

import platform
from dataclasses import dataclass
from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")
_NATIVE_BF16_FLAGS = ("amx_bf16", "avx512_bf16")


@dataclass(frozen=True)
class CpuFeatures:
    model: str  # "AMD EPYC 9R14", or platform.processor() where /proc/cpuinfo has no name
    flags: frozenset[str]
    vendor: str = ""  # vendor_id: "GenuineIntel", "AuthenticAMD" ("" where not given)

    @property
    def isa(self) -> str:
        """The widest matrix ISA: 'AMX' | 'AVX-512' | 'AVX2' | 'other'."""
        if "amx_tile" in self.flags:
            return "AMX"
        if "avx512f" in self.flags:
            return "AVX-512"
        if "avx2" in self.flags:
            return "AVX2"
        return "other"

    @property
    def native_bf16(self) -> bool:
        """bf16 matmuls in hardware (AMX-BF16 or AVX512-BF16), not emulated through fp32."""
        return any(flag in self.flags for flag in _NATIVE_BF16_FLAGS)

    def describe(self) -> str:
        """One line for logs and benchmark headers: model, ISA and the bf16 verdict."""
        bf16 = "native bf16" if self.native_bf16 else "bf16 emulated"
        extras = [f for f in ("amx_bf16", "avx512_bf16", "avx512_vnni") if f in self.flags]
        return f"{self.model}; {self.isa} ({', '.join(extras) or 'no bf16/vnni flags'}); {bf16}"


def parse_cpuinfo(text: str) -> CpuFeatures:
    """The first processor's model name and flags from /proc/cpuinfo text."""
    model, flags, vendor = "", frozenset(), ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and not model:
            model = value.strip()
        elif key == "vendor_id" and not vendor:
            vendor = value.strip()
        elif key == "flags" and not flags:
            flags = frozenset(value.split())
        if model and flags and vendor:
            break
    return CpuFeatures(model or platform.processor() or platform.machine(), flags, vendor)


def cpu_features(cpuinfo: Path = CPUINFO) -> CpuFeatures:
    """This machine's features; no flags (so no native bf16) where /proc/cpuinfo is missing."""
    try:
        return parse_cpuinfo(cpuinfo.read_text())
    except OSError:
        return CpuFeatures(platform.processor() or platform.machine(), frozenset())
