"""Peak memory and time of `--mine_hard_negatives` against the number of pairs, one process on the CPU.

    python bench/mining.py --pairs 25000,50000,100000 [--dim 384] [--count 4] [--out runs/bench-mining]

Each size: one process writes random unit vectors (float16, as the teacher cache keeps them) to `.npy` files;
another memory-maps them, as the cache is read, and `distill.stages.negatives.mine_rows` mines every query. The
table gives the mining process's peak RSS before and after mining, and the seconds; the vectors' own bytes are the
map's.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def write(pairs: int, dim: int, folder: Path) -> None:
    """Random unit vectors for `pairs` queries and passages, float16, as .npy files (a process of their own, so
    that the writing's pages are not the mining process's)."""
    import numpy as np

    rng = np.random.default_rng(0)
    for name in ("queries", "passages"):
        array = np.lib.format.open_memmap(folder / f"{name}.npy", mode="w+", dtype=np.float16, shape=(pairs, dim))
        for start in range(0, pairs, 65536):  # written a block at a time, as the cache's writer does
            block = rng.standard_normal((min(65536, pairs - start), dim)).astype(np.float32)
            array[start : start + len(block)] = block / np.linalg.norm(block, axis=1, keepdims=True)
        array.flush()
        del array


def measure(pairs: int, dim: int, count: int, folder: Path) -> dict:
    """In this process: map and mine `pairs` pairs; the peak RSS (MiB) before and after mining, and the seconds."""
    import numpy as np

    sys.path.insert(0, str(ROOT))
    from distill.stages.negatives import mine_rows

    queries, passages = (np.load(folder / f"{name}.npy", mmap_mode="r") for name in ("queries", "passages"))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    started = time.perf_counter()
    mined, _ = mine_rows(queries, passages, count)
    seconds = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    assert mined.shape == (pairs, count)
    vectors = 2 * pairs * dim * 2 / 2**20
    return {"pairs": pairs, "peak_before_mib": round(before), "peak_after_mib": round(after),
            "vectors_mib": round(vectors), "seconds": round(seconds, 1)}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", default="25000,50000,100000", help="pair counts, comma-separated")
    parser.add_argument("--dim", type=int, default=384)
    parser.add_argument("--count", type=int, default=4, help="negatives per query (--mine_hard_negatives)")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "bench-mining")
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)  # a child process: measure this size
    parser.add_argument("--write", type=int, help=argparse.SUPPRESS)  # a child process: write this size's vectors
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.write:
        folder = args.out / f"vectors-{args.write}"
        folder.mkdir(exist_ok=True)
        write(args.write, args.dim, folder)
        return 0
    if args.one:
        print(json.dumps(measure(args.one, args.dim, args.count, args.out / f"vectors-{args.one}")))
        return 0
    rows = []
    for pairs in (int(p) for p in args.pairs.split(",")):
        sizes = ["--dim", str(args.dim), "--count", str(args.count), "--out", str(args.out)]
        subprocess.run([sys.executable, __file__, "--write", str(pairs), *sizes], check=True)
        done = subprocess.run(
            [sys.executable, __file__, "--one", str(pairs), *sizes], capture_output=True, text=True, check=True
        )
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(rows[-1], flush=True)
    lines = [
        "| pairs | vectors (mapped) | peak RSS before mining | peak RSS after | seconds |",
        "|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        mapped, before, after = r["vectors_mib"], r["peak_before_mib"], r["peak_after_mib"]
        lines.append(f"| {r['pairs']:,} | {mapped:,} MiB | {before:,} MiB | {after:,} MiB | {r['seconds']} |")
    (args.out / "mining.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
