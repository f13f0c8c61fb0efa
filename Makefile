# `make demo` and `make test` set up .venv/ on first use (CPU torch, no CUDA download), then run.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The CPU wheel of this release lies on this workplace's disk; elsewhere pip takes it from the index.
TORCH ?= torch==2.13.0
export HF_HUB_OFFLINE ?= 1
export TOKENIZERS_PARALLELISM ?= false

.PHONY: setup demo demo-reranker test test-fast lint bench bench-gpu bench-scale gpu-check clean quality

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --disable-pip-version-check "$(TORCH)"
	$(BIN)/python -m pip install -q --disable-pip-version-check -e ".[demo,test,onnx]"
	touch $(STAMP)

# tcmalloc keeps a CPU run's peak memory flat as the data grows (distill/allocator.py, docs/BENCHMARKS.md).
# demo, quality and bench install it once where they can (root with apt-get) and preload it when present;
# DISTILL_ALLOCATOR=glibc runs them on the system allocator. The tests do not need it.
ALLOCATOR := $(VENV)/.allocator
PRELOAD = preload="$$($(BIN)/python -m distill.allocator)" && LD_PRELOAD="$$preload"

$(ALLOCATOR): $(STAMP)
	@if [ -z "$$($(BIN)/python -c 'from distill.allocator import find_tcmalloc; print(find_tcmalloc() or "")')" ]; then \
	    if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	        echo "installing tcmalloc (Debian package libtcmalloc-minimal4) for a flat peak memory on CPU"; \
	        apt-get install -y -qq libtcmalloc-minimal4 >/dev/null 2>&1 \
	            || (apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq libtcmalloc-minimal4 >/dev/null 2>&1) \
	            || echo "note: could not install libtcmalloc-minimal4; running on glibc malloc"; \
	    else \
	        echo "note: tcmalloc not found; install libtcmalloc-minimal4 (or gperftools) for a flat peak memory on CPU"; \
	    fi; \
	fi
	touch $@

demo: $(ALLOCATOR)
	$(PRELOAD) $(BIN)/python -m distill.train --config configs/demo.yaml

# the demo with a reranker for phase 2: the cross-encoder is trained once (bench/cross_encoder.py, ~20 min), then kept
demo-reranker: $(ALLOCATOR)
	$(BIN)/python bench/cross_encoder.py --output runs/cache/cross-encoder
	$(PRELOAD) $(BIN)/python -m distill.train --config configs/demo_reranker.yaml

# distill's phase 1 vs sentence-transformers' own distillation recipe on the demo, side by side; writes
# runs/quality/QUALITY.md (~20 min), both in float32 as the peer trains for as many seconds as distill did.
# Phase 2's labels against their peer: bench/label_peer.py (docs/QUALITY.md).
quality: $(ALLOCATOR)
	$(PRELOAD) $(BIN)/python bench/quality.py --config configs/demo.yaml --skip_phase2 True --mixed_precision no

# Two pytest-xdist workers, one thread each (tests/conftest.py): most tests start processes that spend
# seconds importing torch and sentence-transformers on one core. TEST_WORKERS=0 runs the suite in one process.
TEST_WORKERS ?= 2
test: $(STAMP)
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist worksteal

# The edit-and-test loop: the unit tests, without end-to-end runs or multi-process launches.
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow and not multiprocess and not e2e"

lint: $(STAMP)
	$(BIN)/ruff check distill tests bench
	$(BIN)/ruff format --check distill tests bench
	$(BIN)/mypy

# The toolkit against sentence-transformers' recipe and a bare loop, plus --memory and --scaling
# (about 1.5 h on 2 CPU cores on tcmalloc; run it on a quiet machine). Writes runs/bench/BENCHMARKS.md.
# seconds and memory to the first training step at 125k to 1M texts: cold, rerun, 2 processes (about 10 min);
# the tokenizer on every core, as a run launched by hand has it
bench-scale: $(STAMP)
	env -u TOKENIZERS_PARALLELISM $(BIN)/python bench/scale.py

bench: $(ALLOCATOR)
	$(BIN)/python bench/run.py --all $(BENCH_FLAGS)

# The same student work on a CUDA GPU (mpnet student, bf16), about 10 minutes on one H100 or H200:
# floor at three batch sizes, toolkit vs peer vs floor, then where a step's time goes (kernels, host and
# GPU time per step; BERT-base and a 7B-shaped teacher too). Uses the python that has CUDA torch
# (PYTHON=...); `bench/gpu.sh --prepare` readies an offline machine's files (see bench/gpu.sh).
bench-gpu:
	bench/gpu.sh runs/bench-gpu

# Every path that is on by default on a GPU, run once (bench/gpu_check.py, about 4 minutes on one H100): run it
# first whenever a GPU is at hand. Writes runs/gpu-check/gpu-check.json; exits 1 if a check failed. Without CUDA
# it runs what a CPU can and lists the rest as skipped. PYTHON=... names the python with CUDA torch.
gpu-check:
	PYTHON="$${PYTHON:-$$([ -x $(BIN)/python ] && echo $(BIN)/python || echo python3)}" bench/gpu.sh --check runs/gpu-check

clean:
	rm -rf runs $(VENV)
