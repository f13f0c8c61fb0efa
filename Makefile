# `make demo` and `make test` set up .venv/ on first use (CPU torch, no CUDA download), then run.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The CPU wheel of this release lies on this workplace's disk; elsewhere pip takes it from the index.
TORCH ?= torch==2.13.0
export HF_HUB_OFFLINE ?= 1
export TOKENIZERS_PARALLELISM ?= false

.PHONY: setup demo test lint clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --disable-pip-version-check "$(TORCH)"
	$(BIN)/python -m pip install -q --disable-pip-version-check -e ".[demo,test]"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m distill.train --config configs/demo.yaml

test: $(STAMP)
	$(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check distill tests
	$(BIN)/ruff format --check distill tests

clean:
	rm -rf runs $(VENV)
