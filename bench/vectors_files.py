"""Peak memory of reading a `--teacher_vectors` file, by format, at a given size.

    python bench/vectors_files.py --rows 1000000 --dim 384 [--formats npy,parquet,jsonl] [--workdir runs/bench-vectors]

Each format holds the same texts and vectors. For each, a fresh process does what a run's teacher stage does with
the file: reads it (a .parquet or .jsonl file through its streamed copy, made first and timed), builds the text ->
row map, and serves every text's vector through the encoder in the cache's batches, touching every row. The
table gives that process's peak RSS (VmHWM, memory-mapped pages included) and its seconds; its last column is the
peak over the .npy format's, which reads the same data through a memory map with no copy.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

READ = """
import sys, time
from pathlib import Path
import numpy as np
from distill.teachers.vectors import VectorsTeacher

path, workdir = Path(sys.argv[1]), Path(sys.argv[2])
started = time.perf_counter()
teacher = VectorsTeacher(str(path), caches=None, workdir=workdir)
texts = teacher.texts()
encoder = teacher.encoder(None, texts, "document")
for start in range(0, len(texts), encoder.batch_size):
    encoder.encode(list(range(start, min(start + encoder.batch_size, len(texts)))))
# VmHWM: this process's own peak (ru_maxrss would carry the parent's across the fork)
peak = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:"))
print(time.perf_counter() - started, peak * 1024)
"""


def write_files(folder: Path, rows: int, dim: int, formats: list[str]) -> dict[str, Path]:
    """The same texts and vectors as each format, written once and reused."""
    folder.mkdir(parents=True, exist_ok=True)
    texts = [f"text number {i} of the benchmark corpus" for i in range(rows)]
    paths = {}
    vectors = None
    for kind in formats:
        path = folder / f"vectors-{rows}.{kind}"
        paths[kind] = path
        if path.exists():
            continue
        if vectors is None:
            vectors = np.random.default_rng(0).standard_normal((rows, dim)).astype(np.float32)
        if kind == "npy":
            np.save(path, vectors)
            path.with_suffix(".txt").write_text("\n".join(texts) + "\n")
        elif kind == "parquet":
            import pyarrow as pa
            import pyarrow.parquet as pq

            column = pa.FixedSizeListArray.from_arrays(pa.array(vectors.reshape(-1)), dim)
            pq.write_table(pa.table({"text": texts, "embedding": column}), path, row_group_size=65536)
        elif kind == "jsonl":
            with path.open("w") as out:
                for text, vector in zip(texts, vectors):
                    out.write(json.dumps({"text": text, "embedding": vector.round(6).tolist()}) + "\n")
    return paths


def measure(path: Path, workdir: Path) -> tuple[float, int]:
    done = subprocess.run([sys.executable, "-c", READ, str(path), str(workdir)], capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(done.stderr[-3000:])
    seconds, peak = done.stdout.split()
    return float(seconds), int(peak)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--dim", type=int, default=384)
    parser.add_argument("--formats", default="npy,parquet,jsonl")
    parser.add_argument("--workdir", type=Path, default=Path("runs/bench-vectors"))
    args = parser.parse_args()
    formats = args.formats.split(",")
    started = time.perf_counter()
    paths = write_files(args.workdir / "files", args.rows, args.dim, formats)
    print(f"files written in {time.perf_counter() - started:.0f} s", file=sys.stderr)
    results = {kind: measure(path, args.workdir / "streamed") for kind, path in paths.items()}
    base = results.get("npy", (0.0, 0))[1]
    print("| format | rows x dim | seconds | peak RSS | over .npy |\n|---|---|---:|---:|---:|")
    for kind, (seconds, peak) in results.items():
        over = f"{(peak - base) / 2**30:+.2f} GiB" if base else ""
        print(f"| .{kind} | {args.rows:,} x {args.dim} | {seconds:.1f} | {peak / 2**30:.2f} GiB | {over} |")
    print(f"(this process: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB)", file=sys.stderr)


if __name__ == "__main__":
    main()
