# Two entry points: `make demo` trains the tiny config, `make test` runs the suite.
# Both create .venv and install everything from this repo's pyproject.
PYTHON ?= python3
VENV ?= .venv
# CPU wheel by default; GPU users: make TORCH_SPEC='torch==2.9.1' ...
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test install clean browser

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/spillover train --config configs/tiny.yaml $(ARGS)

# The deployment/UI e2e test drives Debian's chromium (installed once, skipped when present).
browser:
	@command -v chromium >/dev/null 2>&1 || { apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; }

test: $(STAMP) browser
	$(PY) -m pytest -q $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) runs
