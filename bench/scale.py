"""Seconds and memory to a run's first training step, as the corpus grows: cold, rerun, and on two processes.

    python bench/scale.py [--sizes 125000,250000,500000,1000000] [--workdir runs/bench-scale]

The run: a synthetic corpus of texts about 60 tokens long, a `.npy` vectors teacher (384-d), a 1-layer MiniLM
student, `--max_seq_length 64 --batch_size 256`, phase 1 only. For each size it runs the toolkit three times:

- cold: an empty teacher cache (the vectors are read into it, the texts tokenized);
- rerun: the same command again, every cache warm;
- rerun on 2 processes (`accelerate_configs/cpu_2proc.yaml`).

Each process stops at its first training step and records the seconds since the command started and its peak RSS
(VmHWM) and PSS (shared pages counted once). The table sums them over the processes. Beside each size it times the
student's tokenizer alone on the corpus's texts (the `tokenizers` backend's `encode_batch`, truncated to 64), on
every core (`TOKENIZERS_PARALLELISM` unset), in a fresh process: the floor a cold run's tokenizing cannot beat; a
last table gives the cold run over it, as a ratio and in seconds. Below the first table: each column's
least-squares growth per million texts.
With `--steps N`, a rerun also trains N steps at each size and records its RSS then: what an epoch's reading of
the teacher's vectors and the tokens leaves in the process.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
DRIVER = """
import json, os, sys, time
import distill.loop as loop

trained = loop.train_step
steps = [0]

def step(*args, **kwargs):
    steps[0] += 1
    if steps[0] < int(os.environ["BENCH_STEPS"]):
        return trained(*args, **kwargs)
    status = dict(line.split(":", 1) for line in open("/proc/self/status") if ":" in line)
    pss = sum(int(line.split()[1]) for line in open("/proc/self/smaps_rollup") if line.startswith("Pss:"))
    figures = {"seconds": time.time() - float(os.environ["BENCH_STARTED"]),
               "peak_rss": int(status["VmHWM"].split()[0]) * 1024, "pss": pss * 1024,
               "rss": int(status["VmRSS"].split()[0]) * 1024}
    Path = __import__("pathlib").Path
    Path(os.environ["BENCH_OUT"] + "." + os.environ.get("RANK", "0")).write_text(json.dumps(figures))
    os._exit(0)  # what is measured is done: no need to train on

loop.train_step = step
from distill.train import main
sys.exit(main(sys.argv[1:]))
"""
TOKENIZER_ALONE = """
import sys, time
from transformers import AutoTokenizer
from distill.hub import resolve_model

texts = open(sys.argv[1], encoding="utf8").read().splitlines()
backend = AutoTokenizer.from_pretrained(resolve_model("sentence-transformers/all-MiniLM-L6-v2")).backend_tokenizer
backend.enable_truncation(64)
started = time.perf_counter()
for start in range(0, len(texts), 65536):
    backend.encode_batch(texts[start : start + 65536], add_special_tokens=True)
print(time.perf_counter() - started)
"""
WORDS = (
    "river stone city north built old road water field king house light wind winter bridge market tower "
    "forest valley church island harbour garden mountain village wall gate morning evening summer"
).split()


def corpus(folder: Path, size: int) -> tuple[Path, Path]:
    """`size` distinct texts of about 60 tokens (one per line) and 384-d unit vectors beside them."""
    texts_file, vectors_file = folder / f"texts-{size}.txt", folder / f"vectors-{size}.npy"
    if texts_file.exists() and vectors_file.exists():
        return texts_file, vectors_file
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(size)
    words = np.asarray(WORDS)[rng.integers(0, len(WORDS), (size, 52))]
    lines = [" ".join(row) + f" number {i}" for i, row in enumerate(words)]
    texts_file.write_text("\n".join(lines) + "\n")
    vectors = rng.standard_normal((size, 384)).astype(np.float32)
    np.save(vectors_file, vectors / np.linalg.norm(vectors, axis=1, keepdims=True))
    shutil.copy(texts_file, vectors_file.with_suffix(".txt"))  # the vectors file's own texts, beside it
    return texts_file, vectors_file


def run(workdir: Path, size: int, texts: Path, vectors: Path, processes: int, name: str, steps: int = 1) -> dict:
    """One run to its first step; the figures of its processes, summed (seconds: the slowest)."""
    out = workdir / f"{size}-{name}"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    (out / "driver.py").write_text(DRIVER)
    flags = ["--teacher_vectors", str(vectors), "--student_model", "sentence-transformers/all-MiniLM-L6-v2"]
    flags += ["--student_num_layers", "1", "--phase1_data", str(texts), "--eval_data", "none", "--skip_phase2"]
    flags += ["--max_seq_length", "64", "--batch_size", "256", "--efficiency_texts", "0", "--log_with", "none"]
    flags += ["--output_dir", str(out / "run"), "--teacher_cache_dir", str(workdir / f"cache-{size}")]
    launcher = [sys.executable]
    if processes > 1:
        launcher += [
            "-m",
            "accelerate.commands.launch",
            "--config_file",
            str(REPO / "accelerate_configs/cpu_2proc.yaml"),
        ]
    env = dict(os.environ, BENCH_STARTED=str(time.time()), BENCH_OUT=str(out / "first-step"), HF_HUB_OFFLINE="1")
    env["BENCH_STEPS"] = str(steps)
    done = subprocess.run([*launcher, str(out / "driver.py"), *flags], env=env, capture_output=True, text=True)
    found = [json.loads(p.read_text()) for p in sorted(out.glob("first-step.*"))]
    if len(found) != processes:
        raise SystemExit(f"{size} {name}: {len(found)} of {processes} processes reached a step\n{done.stderr[-3000:]}")
    return {figure: (max if figure == "seconds" else sum)(f[figure] for f in found) for figure in found[0]}


def tokenizer_seconds(texts: Path) -> float:
    """The student's tokenizer alone on `texts`, on every core (a fresh process, the file read before the clock)."""
    env = {k: v for k, v in os.environ.items() if k != "TOKENIZERS_PARALLELISM"}
    env["HF_HUB_OFFLINE"] = "1"
    done = subprocess.run([sys.executable, "-c", TOKENIZER_ALONE, str(texts)], env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(done.stderr[-3000:])
    return float(done.stdout.split()[-1])


def growth(rows: list[tuple[int, str, dict]], name: str, figure: str) -> float:
    """The least-squares slope of `figure` against the corpus size, per million texts, over the runs `name`."""
    points = [(size / 1e6, figures[figure]) for size, run, figures in rows if run == name]
    if len(points) < 2:
        return float("nan")
    sizes, values = np.array(points).T
    return float(np.polyfit(sizes, values, 1)[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="125000,250000,500000,1000000")
    parser.add_argument("--workdir", type=Path, default=Path("runs/bench-scale"))
    parser.add_argument("--steps", type=int, default=0, help="Also train a rerun this many steps and measure then.")
    args = parser.parse_args()
    rows, trained = [], []
    for size in (int(s) for s in args.sizes.split(",")):
        texts, vectors = corpus(args.workdir / "data", size)
        shutil.rmtree(args.workdir / f"cache-{size}", ignore_errors=True)
        for name, processes in (("cold", 1), ("rerun", 1), ("rerun, 2 processes", 2)):
            figures = run(args.workdir, size, texts, vectors, processes, name.replace(", ", "-").replace(" ", "-"))
            rows.append((size, name, figures))
            print(f"{size:,} {name}: {figures}", file=sys.stderr)
        rows.append((size, "tokenizer alone", {"seconds": tokenizer_seconds(texts)}))
        print(f"{size:,} tokenizer alone: {rows[-1][2]}", file=sys.stderr)
        if args.steps > 1:
            trained.append((size, run(args.workdir, size, texts, vectors, 1, "steps", steps=args.steps)))
            print(f"{size:,} {args.steps} steps: {trained[-1][1]}", file=sys.stderr)
    print_tables(rows)
    if trained:
        print(f"\n| corpus | seconds to step {args.steps} | RSS at it | peak RSS to it |\n|---|---:|---:|---:|")
        for size, figures in trained:
            rss, peak = figures["rss"] / 2**30, figures["peak_rss"] / 2**30
            print(f"| {size:,} | {figures['seconds']:.0f} | {rss:.2f} GiB | {peak:.2f} GiB |")


def print_tables(rows: list[tuple[int, str, dict]]) -> None:
    """The table of runs, and each column's growth per million texts."""
    print("| corpus | run | seconds to the first step | peak RSS before it | PSS at it |\n|---|---|---:|---:|---:|")
    for size, name, figures in rows:
        if name == "tokenizer alone":
            print(f"| {size:,} | the tokenizer alone (`encode_batch`), every core | {figures['seconds']:.0f} | | |")
            continue
        rss, pss = figures["peak_rss"] / 2**30, figures["pss"] / 2**30
        print(f"| {size:,} | {name} | {figures['seconds']:.0f} | {rss:.2f} GiB | {pss:.2f} GiB |")
    print("\n| run | seconds per million texts | peak RSS per million | PSS per million |\n|---|---:|---:|---:|")
    for name in ("cold", "rerun", "rerun, 2 processes", "tokenizer alone"):
        per = [growth(rows, name, "seconds")]
        if name != "tokenizer alone":
            per += [growth(rows, name, figure) / 2**30 for figure in ("peak_rss", "pss")]
            print(f"| {name} | {per[0]:.0f} | {per[1]:.2f} GiB | {per[2]:.2f} GiB |")
        else:
            print(f"| {name} | {per[0]:.0f} | | |")
    alone = {size: figures["seconds"] for size, name, figures in rows if name == "tokenizer alone"}
    print("\n| corpus | cold run | the tokenizer alone | ratio | above it |\n|---|---:|---:|---:|---:|")
    for size, name, figures in rows:
        if name == "cold" and size in alone:
            cold, floor = figures["seconds"], alone[size]
            print(f"| {size:,} | {cold:.0f} s | {floor:.0f} s | {cold / floor:.2f} | {cold - floor:+.0f} s |")


if __name__ == "__main__":
    main()
