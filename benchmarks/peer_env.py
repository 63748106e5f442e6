"""The environment of every server or process a benchmark starts to compare against (vLLM's
server and offline run, SGLang's router, `kvfleet up` beside them): this process's, less the
variables that tune another program's threads, math libraries or allocator.

A shell that exports OMP_WAIT_POLICY=PASSIVE GOMP_SPINCOUNT=10000 (what `kvfleet up` gives its
own workers, and what the in-process benchmarks are run with) would otherwise hand them to vLLM,
whose preloaded Intel OpenMP reads OMP_WAIT_POLICY too; an LD_PRELOAD or MALLOC_CONF of the
shell would swap the peer's allocator. Each peer gets its own settings instead: vLLM its CPU
guide's (benchmarks/vllm_peer.py: its own LD_PRELOAD, VLLM_CPU_* kept from the caller),
`kvfleet up` the OpenMP settings it gives its workers. Everything else (PATH, HOME, the peers'
own VLLM_*/KVFLEET_* variables, proxies, caches) is passed on.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

# OpenMP runtimes (GNU, Intel/LLVM), Intel MKL, OpenBLAS/BLIS, oneDNN; allocators: glibc malloc,
# jemalloc (MALLOC_CONF and its prefixed builds), tcmalloc, mimalloc
DROPPED_PREFIXES = ("OMP_", "GOMP_", "KMP_", "MKL_", "OPENBLAS_", "BLIS_", "DNNL_", "ONEDNN_",
                    "MALLOC_", "JEMALLOC_", "JE_MALLOC_", "_RJEM_MALLOC_", "TCMALLOC_",
                    "MIMALLOC_")
DROPPED_NAMES = frozenset({"LD_PRELOAD", "GLIBC_TUNABLES"})


def is_dropped(name: str) -> bool:
    """Whether a variable of the caller's is kept from the peers."""
    return name in DROPPED_NAMES or name.startswith(DROPPED_PREFIXES)


def dropped_names(base: Mapping[str, str] | None = None) -> list[str]:
    """The variables of `base` (default: this process's environment) no peer receives."""
    return sorted(name for name in (os.environ if base is None else base) if is_dropped(name))


def peer_env(own: Mapping[str, str] | None = None,
             base: Mapping[str, str] | None = None) -> dict[str, str]:
    """`base` (default: this process's environment) without the caller's OpenMP, math-library
    and allocator variables, then the peer's `own` settings on top (these are kept whatever
    their names: a peer's own LD_PRELOAD is its setup, not the caller's)."""
    env = {name: value for name, value in (os.environ if base is None else base).items()
           if not is_dropped(name)}
    env.update(own or {})
    return env


def dropped_line(base: Mapping[str, str] | None = None,
                 peers: str = "the servers it starts") -> str | None:
    """A line for a benchmark's header naming what its `peers` did not receive, or None."""
    names = dropped_names(base)
    if not names:
        return None
    return (f"# not passed to {peers}: {', '.join(names)} (from this shell; each gets its own "
            f"settings: benchmarks/peer_env.py)")
