#!/usr/bin/env bash
# The GPU benchmark as one script, sized for about 10 minutes on one H100 or H200 (`make bench-gpu`).
#
#   bench/gpu.sh [OUT]            # OUT defaults to runs/bench-gpu
#   bench/gpu.sh --check [OUT]    # `make gpu-check`: bench/gpu_check.py, every path on by default on a GPU, once
#
# What it runs (all-mpnet-base-v2's architecture as teacher and student, weights drawn from its config,
# 40,000 texts, max length 128, bf16):
#   1. floor: the card's bf16 matmul rate, then the bare loop at batch 32, 256 and 1024 (fused AdamW);
#   2. e2e: one cold and one warm toolkit run through torchrun (DDP on one GPU, NCCL), the peer
#      (sentence-transformers' recipe) and the floor over the toolkit's own batches, batch 256; then the same
#      for a BERT student (MiniLM's shape), whose run takes the unpadded path where the GPU allows it.
#   3. step: where a step's time goes (bench/gpu_step.py): kernels, host-busy and GPU-busy ms per step under
#      torch.profiler, and the share of the matmul rate, for the mpnet student (eager and fused attention, and
#      compiled), a BERT-base student at 32k real tokens a step, and a 7B-shaped decoder teacher encoding.
# Each part writes OUT/gpu-floor.json / OUT/gpu-e2e.json (OUT/bert/gpu-e2e.json) / OUT/gpu-step.json after every
# measurement, so a run cut short keeps what it measured. Every part runs; the script exits non-zero if any
# measurement failed.
#
# Offline machines (no Hub, no package index) read what `bench/gpu.sh --prepare` puts in .gpu/ and .whl/
# on a machine with the repository's .venv: the mpnet folder without its weights, the texts, and wheels
# of the versions this repository is tested with. Online, the script uses the Hub name and the
# installed packages.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "${1:-}" = "--prepare" ]; then
    mkdir -p .gpu .whl
    .venv/bin/python - <<'EOF'
import shutil, sys
from pathlib import Path
sys.path[:0] = ["bench", "."]
from distill.hub import resolve_model
from run import workload_texts
source = Path(resolve_model("sentence-transformers/all-mpnet-base-v2"))
shutil.rmtree(".gpu/mpnet", ignore_errors=True)
shutil.copytree(source, ".gpu/mpnet", ignore=shutil.ignore_patterns("*.safetensors", "*.bin", "onnx", "openvino"))
source = Path(resolve_model("sentence-transformers/all-MiniLM-L6-v2"))  # BERT-base's tokenizer, for gpu_step.py
shutil.rmtree(".gpu/minilm", ignore_errors=True)
shutil.copytree(source, ".gpu/minilm", ignore=shutil.ignore_patterns("*.safetensors", "*.bin", "onnx", "openvino"))
Path(".gpu/texts-40000.txt").write_text("\n".join(workload_texts(40000)[0]) + "\n")
EOF
    versions=$(.venv/bin/python -m pip list --format=freeze 2>/dev/null \
        | grep -iE '^(transformers|sentence-transformers|datasets|dill|multiprocess)==')
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl $versions
    du -sh .gpu .whl
    exit 0
fi

PYTHON=${PYTHON:-python3}
if compgen -G ".whl/*.whl" >/dev/null; then
    $PYTHON -m pip install -q --no-index --no-deps --upgrade --target /tmp/distill-site .whl/*.whl
    export PYTHONPATH=/tmp/distill-site:$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
if [ "${1:-}" = "--check" ]; then
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1}
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
    exec $PYTHON bench/gpu_check.py --out "${2:-runs/gpu-check}"
fi

OUT=${1:-runs/bench-gpu}
MODEL=sentence-transformers/all-mpnet-base-v2
TEXTS=()
BERT=sentence-transformers/all-MiniLM-L6-v2
if [ -d .gpu/mpnet ]; then MODEL=.gpu/mpnet; fi
if [ -d .gpu/minilm ]; then BERT=.gpu/minilm; fi
if [ -f .gpu/texts-40000.txt ]; then TEXTS=(--texts .gpu/texts-40000.txt); fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true

status=0
$PYTHON bench/gpu.py floor --model "$MODEL" --random_weights "${TEXTS[@]}" --samples 40000 \
    --only b32-bf16-fused,b256-bf16-fused,b1024-bf16-fused --out "$OUT" || status=1
$PYTHON bench/gpu.py e2e --model "$MODEL" --random_weights "${TEXTS[@]}" --samples 40000 \
    --batch_size 256 --repeats 1 --no_options --out "$OUT" || status=1
$PYTHON bench/gpu.py e2e --model "$BERT" --random_weights "${TEXTS[@]}" --samples 40000 \
    --batch_size 256 --repeats 1 --no_options --out "$OUT/bert" --workdir /tmp/distill-gpu-bench-bert || status=1
# without .gpu/, the texts gpu.py wrote to its scratch folder
$PYTHON bench/gpu_step.py --mpnet "$MODEL" --bert "$BERT" --texts "${TEXTS[1]:-/tmp/distill-gpu-bench/texts-40000.txt}" \
    --out "$OUT" || status=1
exit $status
