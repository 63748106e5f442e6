"""A C++ kernel built with defines of a test's choosing (a variant the engine never builds: the
portable product, the AMX emulation), compiled and bound as the engine's kernels are."""

from __future__ import annotations

import ctypes
from pathlib import Path

from kvfleet.worker.engine.kernels import cpu_kernels
from kvfleet.worker.engine.kernels.kernel_binding import BoundKernel, read_header
from kvfleet.worker.engine.kernels.kernel_build import build


def build_variant(name: str, directory: Path, defines: tuple[str, ...]) -> BoundKernel:
    """Kernel `name` of cpu_kernels.KERNELS with each of `defines` set to 1 before its source,
    built in `directory` (a wrapper source that includes it, named by the defines)."""
    source = cpu_kernels.KERNELS[name]
    stem = "_".join([source.source.stem, *(d.lower() for d in defines)])
    wrapper = directory / f"{stem}.cpp"
    wrapper.write_text("".join(f"#define {d} 1\n" for d in defines)
                       + f'#include "{source.source}"\n')
    # instrumented as the engine's kernels are under the sanitizer test (KVFLEET_KERNEL_SANITIZE)
    library = build(wrapper, (source.source, source.header, *cpu_kernels.COMMON_HEADERS),
                    compiler=cpu_kernels.compiler_name(), cache_dir=directory,
                    sanitize=cpu_kernels.sanitizer())
    return BoundKernel(ctypes.CDLL(str(library)), read_header(source.header))
