"""Reading the CPU's model and ISA from /proc/cpuinfo, and the bf16 verdict behind --dtype auto."""

from __future__ import annotations

from kvfleet.shared.cpu_features import CpuFeatures, cpu_features, parse_cpuinfo

ZEN4 = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 9R14
flags\t\t: fpu sse2 avx avx2 fma avx512f avx512dq avx512_bf16 avx512_vnni
processor\t: 1
model name\t: AMD EPYC 9R14
flags\t\t: fpu sse2 avx avx2 fma avx512f avx512dq avx512_bf16 avx512_vnni
"""
SAPPHIRE_RAPIDS_FLAGS = "avx2 avx512f avx512_bf16 amx_bf16 amx_tile amx_int8"
HASWELL_FLAGS = "sse2 avx avx2 fma"


def cpu(flags: str) -> CpuFeatures:
    return parse_cpuinfo(f"model name\t: test CPU\nflags\t\t: {flags}\n")


def test_first_processor_gives_model_and_flags():
    features = parse_cpuinfo(ZEN4)
    assert features.model == "AMD EPYC 9R14"
    assert {"avx512f", "avx512_bf16"} <= features.flags
    assert (features.isa, features.native_bf16) == ("AVX-512", True)
    assert "AMD EPYC 9R14" in features.describe() and "native bf16" in features.describe()


def test_isa_and_bf16_by_cpu_kind():
    assert (cpu(SAPPHIRE_RAPIDS_FLAGS).isa, cpu(SAPPHIRE_RAPIDS_FLAGS).native_bf16) == ("AMX", True)
    assert (cpu(HASWELL_FLAGS).isa, cpu(HASWELL_FLAGS).native_bf16) == ("AVX2", False)
    # AVX-512 without the BF16 extension (Skylake-X, Ice Lake) still emulates bf16
    assert (cpu("avx2 avx512f avx512_vnni").isa, cpu("avx2 avx512f").native_bf16) == ("AVX-512", False)
    assert "bf16 emulated" in cpu(HASWELL_FLAGS).describe()


def test_missing_cpuinfo_means_no_native_bf16(tmp_path):
    features = cpu_features(tmp_path / "no-such-file")
    assert features.flags == frozenset() and not features.native_bf16 and features.model
    assert features.isa == "other"


def test_cpuinfo_gives_the_vendor():
    text = "processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: Xeon\nflags\t\t: avx2 fma\n"
    assert parse_cpuinfo(text) == CpuFeatures("Xeon", frozenset({"avx2", "fma"}), "GenuineIntel")
