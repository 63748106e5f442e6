#!/usr/bin/env bash
# Makes a separate virtualenv with SGLang's router (the `sglang-router` package: a Rust router
# with a Python launcher), the peer of benchmarks/fleet_affinity.py: its `cache_aware` policy in
# front of independent one-worker kvfleet servers. It is kept apart from kvfleet's .venv.
#
#     bash benchmarks/sglang_router_env.sh            # -> $KVFLEET_SGLANG_ROUTER_VENV (below)
#     KVFLEET_SGLANG_ROUTER_VENV=/somewhere bash benchmarks/sglang_router_env.sh
#
# By hand, in front of servers on ports 8101 and 8102:
#     $KVFLEET_SGLANG_ROUTER_VENV/bin/python -m sglang_router.launch_router --port 8100 \
#       --worker-urls http://127.0.0.1:8101 http://127.0.0.1:8102 --policy cache_aware
set -euo pipefail

VENV="${KVFLEET_SGLANG_ROUTER_VENV:-$HOME/.cache/kvfleet/sglang-router-venv}"
ROUTER_REQ="${SGLANG_ROUTER_REQ:-sglang-router==0.3.2}"
PYTHON="${PYTHON:-python3}"

mkdir -p "$(dirname "$VENV")"
test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
if ! "$VENV/bin/python" -c "import sglang_router" 2>/dev/null; then
    "$VENV/bin/python" -m pip install --quiet --upgrade pip
    "$VENV/bin/python" -m pip install --quiet "$ROUTER_REQ"
fi
"$VENV/bin/python" -c "from importlib.metadata import version; print('sglang-router', version('sglang-router'))"
echo "sglang-router ready in $VENV"
