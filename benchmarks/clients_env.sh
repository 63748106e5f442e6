#!/usr/bin/env bash
# Makes a virtualenv for each of the benchmark clients benchmarks/clients.py runs, as released on
# PyPI and unmodified: GuideLLM and NVIDIA's AIPerf. They are kept apart from kvfleet's .venv
# (and from each other and vLLM's, benchmarks/vllm_env.sh, which brings `vllm bench serve`): each
# pins its own transformers, pydantic and HTTP stack.
#
#     bash benchmarks/clients_env.sh              # -> ~/.cache/kvfleet/{guidellm,aiperf}-venv
#     KVFLEET_GUIDELLM_VENV=/somewhere KVFLEET_AIPERF_VENV=/elsewhere bash benchmarks/clients_env.sh
#     GUIDELLM_REQ=guidellm==0.8.1 AIPERF_REQ=aiperf==0.13.0 bash benchmarks/clients_env.sh
#
# Neither client downloads anything when benchmarks/clients.py runs it: it gives each the model
# directory kvfleet converted (~/.cache/kvfleet/models/<name>) as its tokenizer, with the hubs
# switched off (HF_HUB_OFFLINE=1).
set -euo pipefail

CACHE="$HOME/.cache/kvfleet"
GUIDELLM_VENV="${KVFLEET_GUIDELLM_VENV:-$CACHE/guidellm-venv}"
AIPERF_VENV="${KVFLEET_AIPERF_VENV:-$CACHE/aiperf-venv}"
GUIDELLM_REQ="${GUIDELLM_REQ:-guidellm==0.8.1}"
AIPERF_REQ="${AIPERF_REQ:-aiperf==0.13.0}"
PYTHON="${PYTHON:-python3}"
# GuideLLM requires torch (only to import): the build this machine's pip index serves, as the
# Makefile's TORCH (PyTorch's CPU build here); installed first, so that pip does not pull a CUDA
# build and its libraries for a client that never runs a model.
TORCH="${TORCH:-torch==2.13.0}"

# make_venv DIR REQUIREMENT MODULE [FIRST]: DIR holds REQUIREMENT once MODULE imports there
# (FIRST, when given, installed before it)
make_venv() {
    local venv="$1" req="$2" module="$3" first="${4:-}"
    mkdir -p "$(dirname "$venv")"
    test -x "$venv/bin/python" || "$PYTHON" -m venv "$venv"
    if ! "$venv/bin/python" -c "import $module" 2>/dev/null; then
        "$venv/bin/python" -m pip install --quiet --upgrade pip
        test -z "$first" || "$venv/bin/python" -m pip install --quiet "$first"
        "$venv/bin/python" -m pip install --quiet "$req"
    fi
    "$venv/bin/python" -c "import importlib.metadata as m; print('$module', m.version('$module'))"
}

make_venv "$GUIDELLM_VENV" "$GUIDELLM_REQ" guidellm "$TORCH"
make_venv "$AIPERF_VENV" "$AIPERF_REQ" aiperf
echo "GuideLLM ready in $GUIDELLM_VENV, AIPerf in $AIPERF_VENV"
