# Two entry points: `make demo` trains the tiny config, `make test` runs the suite.
# Both create .venv and install everything from this repo's pyproject.
PYTHON ?= python3
VENV ?= .venv
# CPU wheel by default; GPU users: make TORCH_SPEC='torch==2.14.1' ... (what sglang 0.5.23 pins: tests/contract)
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
CONTRACT_STAMP := $(VENV)/.installed-sglang-contract

.PHONY: demo test install clean browser gpu-wheels

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip 2>&1 | grep -v "^WARNING: Location" || true
	$(PY) -m pip install -q "$(TORCH_SPEC)" 2>&1 | grep -v "^WARNING: Location" || true
	$(PY) -m pip install -q -e ".[test]" 2>&1 | grep -v "^WARNING: Location" || true
	$(PY) -c "import torch, prefect, ray, transformers, sglang_router, s3fs"
	touch $(STAMP)

# SGLang's own classes for tests/contract (~1.3 GB, triton most of it): only the tests need them. sglang pins a CUDA
# torch, so it goes in without its dependencies, and the check after it fails if torch moved.
$(CONTRACT_STAMP): $(STAMP)
	$(PY) -m pip install -q -e ".[sglang-contract]" 2>&1 | grep -v "^WARNING: Location" || true
	$(PY) -m pip install -q --no-deps $$($(PY) tests/contract/sglang_env.py no-deps) 2>&1 | grep -v "^WARNING: Location" || true
	$(PY) tests/contract/sglang_env.py verify "$(TORCH_SPEC)"
	touch $(CONTRACT_STAMP)

install: $(STAMP)

# The demo starts afresh in runs/demo each time (a train run refuses a location holding checkpoints).
DEMO_DIR ?= runs/demo
demo: $(STAMP)
	rm -rf $(DEMO_DIR)
	$(VENV)/bin/spillover train --config configs/tiny.yaml run_dir=$(DEMO_DIR) $(ARGS)

# The deployment/UI e2e test drives Debian's chromium (installed once, skipped when present).
browser:
	@command -v chromium >/dev/null 2>&1 || { apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; }

# Bytecode first: with PYTHONDONTWRITEBYTECODE set (as on CI) every process the suite starts (runs, Ray
# workers, engines, learners) would compile the repo's modules again.
test: $(STAMP) $(CONTRACT_STAMP) browser
	$(PY) -m compileall -q -j 2 __init__.py flows tasks rollout infra tests bench > /dev/null
	$(PY) -m pytest -q $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) runs

# Wheels for a GPU machine without network (Python 3.12, x86_64): what bench/gpu_smoke.py and tests/gpu import beyond
# torch and transformers. bench/gpu_run.sh installs them there from this folder (carry .gpu-wheels).
GPU_WHEELS ?= .gpu-wheels
gpu-wheels: $(STAMP)
	$(PY) -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
		-d $(GPU_WHEELS) pydantic fastapi uvicorn orjson pyyaml 2>&1 | grep -v "^WARNING: Location" || true
