#!/usr/bin/env bash
# The system's g++ with `-march=native` replaced by `-march=$KVFLEET_BENCH_MARCH` (default
# znver3: AMD Zen 3, AVX2 and FMA, no AVX-512), so that kvfleet's kernels build as on that CPU
# kind while running on this one (which must run that code: a newer x86 CPU does). For measuring
# the code an older kind runs, e.g. the float32 path of an AVX2-only CPU on an AVX-512 machine:
#
#     CXX=benchmarks/cxx_march.sh .venv/bin/python -m benchmarks.step_cost --dtype float32 ...
#
# The kernels' cache names hash the compiler's path, so these builds sit beside the native ones.
# Only the kernels change: the engine still reads this CPU's flags (pass --dtype float32 for the
# default of an AVX2-only CPU).
set -euo pipefail
args=()
for arg in "$@"; do
    [ "$arg" = "-march=native" ] && arg="-march=${KVFLEET_BENCH_MARCH:-znver3}"
    args+=("$arg")
done
exec "${KVFLEET_BENCH_CXX:-g++}" "${args[@]}"
