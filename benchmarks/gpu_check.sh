#!/usr/bin/env bash
# The prepared GPU check (docs/GPU.md): versions, the CUDA tests, then throughput against HF
# generate and transformers' continuous batching on this GPU. Needs no network: only the host's
# torch (CUDA build, which brings triton) and this repository's Python dependencies, installed
# already or from benchmarks/wheelhouse/ (`make wheelhouse` on a networked machine of the same
# Python version fills it). Sized for one H200 in under 8 minutes; each phase has its own limit.
#
#   bash benchmarks/gpu_check.sh            # writes gpu_throughput.json to $OUT (default: .)
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] && PY=.venv/bin/python
OUT=${OUT:-.}
start=$(date +%s)
status=0

echo "== versions"
"$PY" - <<'PYEOF'
import platform, torch
print("python", platform.python_version(), "| torch", torch.__version__, "| CUDA", torch.version.cuda)
try:
    import triton
    print("triton", triton.__version__)
except ImportError:
    print("triton: not installed (the worker falls back to gather + SDPA)")
if torch.cuda.is_available():
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        print(f"cuda:{i} {p.name}, {p.total_memory / 1e9:.1f} GB, sm_{p.major}{p.minor}")
else:
    print("no CUDA device: this check needs one")
PYEOF

need="transformers safetensors gguf pydantic_settings redis msgpack pytest pytest_timeout llguidance"
need="$need opentelemetry"
if ! "$PY" -c "import ${need// /, }" 2>/dev/null; then
    if [ -d benchmarks/wheelhouse ]; then
        echo "== installing the Python dependencies from benchmarks/wheelhouse (offline)"
        "$PY" -m pip install --quiet --no-index --find-links benchmarks/wheelhouse --no-deps \
            benchmarks/wheelhouse/*.whl || status=1
        "$PY" -m pip install --quiet --no-index --no-deps --no-build-isolation -e . || status=1
    else
        echo "missing Python modules (one of: $need) and no benchmarks/wheelhouse/; see make wheelhouse"
        exit 2
    fi
fi

echo "== CUDA tests (pytest -m cuda)"
timeout 230 "$PY" -m pytest -m cuda tests/cuda -q -rA -s -p no:cacheprovider --timeout=200 \
    -o addopts="--strict-markers" 2>&1 | tail -40
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
echo "   ($(( $(date +%s) - start )) s so far)"

echo "== throughput: kvfleet vs HF generate vs transformers continuous batching"
models=default,8b
"$PY" -c "from kvfleet.shared.models import DEFAULT_MODEL, resolve_model_path; resolve_model_path(DEFAULT_MODEL)" \
    >/dev/null 2>&1 || { echo "   the default model is not available offline here: 8B-shaped model only"; models=8b; }
timeout $(( 470 - ( $(date +%s) - start ) )) env OMP_WAIT_POLICY=PASSIVE GOMP_SPINCOUNT=10000 "$PY" -m benchmarks.gpu_throughput \
    --models "$models" --json "$OUT/gpu_throughput.json" || status=1
echo "== done in $(( $(date +%s) - start )) s, status $status"
exit $status
