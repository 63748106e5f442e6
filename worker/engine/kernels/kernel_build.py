"""Compiling one C++ kernel source into its own shared library, cached on disk.

The kernels are plain C++ with OpenMP and no torch headers: each compiles in seconds with the
system's C++ compiler, for this machine's ISA (`-march=native`), under a name that hashes the
source, its headers, the flags, the compiler and the CPU, so a library is built once per machine
and rebuilt when any of them changes. Its OpenMP calls run on the libgomp that torch has already
loaded (the loader shares a library by its soname), so a kernel uses torch's thread pool and
thread count. `-Wl,-z,defs` makes a symbol the source does not define a build error rather than a
failure at load time.

A sanitizer build (`sanitize="address"`) adds AddressSanitizer's instrumentation: such a library
loads only into a process that has the ASan runtime loaded first (LD_PRELOAD), which is what the
sanitizer test does (tests/engine/test_kernel_sanitizer.py).
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17", "-Wl,-z,defs")
# -O1, as AddressSanitizer recommends: -O3 adds minutes to an instrumented build for no findings
SANITIZER_FLAGS = {"address": ("-O1", "-g", "-fsanitize=address", "-fno-omit-frame-pointer")}


class KernelUnavailable(RuntimeError):
    """A kernel could not be built or loaded here (no compiler, a failed build)."""


def flags_for(sanitize: str | None) -> tuple[str, ...]:
    if sanitize is None:
        return FLAGS
    if sanitize not in SANITIZER_FLAGS:
        raise ValueError(f"sanitizer {sanitize!r}: expected one of {', '.join(SANITIZER_FLAGS)}")
    return tuple(f for f in FLAGS if f != "-O3") + SANITIZER_FLAGS[sanitize]


def cpu_signature() -> str:
    """What -march=native depends on: the CPU's model and flags (first processor of cpuinfo)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    first = text.split("\n\n", 1)[0]
    keep = ("model name", "flags", "Features", "CPU part")
    return "\n".join(line for line in first.splitlines() if line.split(":")[0].strip() in keep)


@functools.cache
def compiler_version(compiler: str) -> str:
    try:
        return subprocess.run([compiler, "--version"], capture_output=True, text=True,
                              timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise KernelUnavailable(f"{compiler} --version failed: {exc}") from exc


def build_inputs(source: Path, headers: tuple[Path, ...], compiler_path: str,
                 flags: tuple[str, ...]) -> bytes:
    """What a library's code follows from but for the CPU: the source, its headers, the flags
    and the compiler's version (the numerics fingerprint hashes these; the CPU's part of
    -march=native it names by the CPU's flags)."""
    contents = b"\0".join(p.read_bytes() for p in (source, *headers))
    return b"\0".join([contents, " ".join(flags).encode(), compiler_version(compiler_path).encode()])


def build(source: Path, headers: tuple[Path, ...], *, compiler: str, cache_dir: Path,
          sanitize: str | None = None) -> Path:
    """Compile `source` (which includes `headers`) into cache_dir, once per source, headers,
    flags, compiler and CPU, and return the library; raises KernelUnavailable."""
    path = shutil.which(compiler)
    if path is None:
        raise KernelUnavailable(f"no C++ compiler ({compiler}) on PATH")
    flags = flags_for(sanitize)
    key = hashlib.sha256(b"\0".join([build_inputs(source, headers, path, flags),
                                     cpu_signature().encode()])).hexdigest()[:16]
    target = cache_dir / f"{source.stem}-{key}.so"
    if not target.exists():
        cache_dir.mkdir(parents=True, exist_ok=True)
        _compile(path, flags, source, target)
    return target


def _compile(compiler: str, flags: tuple[str, ...], source: Path, target: Path) -> None:
    # built beside the target, then renamed: workers starting together never load a partial file
    fd, partial = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        result = subprocess.run([compiler, *flags, "-o", partial, str(source)],
                                capture_output=True, text=True, timeout=300)
        if result.returncode != 0:
            raise KernelUnavailable(f"compiling {source.name} failed: "
                                    f"{result.stderr.strip()[-2000:]}")
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
