"""Reading a capped phase from a JSONL corpus far larger than what it keeps: seconds and peak memory.

    python bench/read_corpus.py --sizes 100,1000 --keep 20000

Writes a JSONL file of each size in MB (one short text per row) into --folder, then reads `--keep` phase-1
texts from it in a fresh process (`distill.data.load_phase1_texts`, as a run does) and reports the seconds of
the read, the process's peak RSS and what the read left in datasets' cache folder (pointed at a fresh one).
Prints a markdown table with the machine, the versions and the command.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from quality import machine, versions

READ = """
import sys, time
from distill.data import load_phase1_texts
started = time.perf_counter()
texts = load_phase1_texts(sys.argv[1], int(sys.argv[2]))
print(len(texts), time.perf_counter() - started)
"""


def write_corpus(path: Path, megabytes: int) -> int:
    """A JSONL file of about `megabytes` MB; returns its rows."""
    rows = 0
    with open(path, "w") as f:
        while f.tell() < megabytes * 1_000_000:
            f.write(json.dumps({"text": f"sentence {rows} of a corpus far larger than the phase keeps"}) + "\n")
            rows += 1
    return rows


def read(path: Path, keep: int, cache: Path) -> tuple[int, float, int, int]:
    """(texts kept, seconds, peak RSS in bytes, bytes left in datasets' cache) of one read in a fresh process."""
    shutil.rmtree(cache, ignore_errors=True)
    env = dict(os.environ, HF_DATASETS_CACHE=str(cache), HF_HUB_OFFLINE="1")
    done = subprocess.run(
        [sys.executable, "-c", READ, str(path), str(keep)], env=env, capture_output=True, text=True, check=True
    )
    kept, seconds = done.stdout.split()
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024  # the largest child so far
    left = sum(f.stat().st_size for f in cache.rglob("*") if f.is_file()) if cache.exists() else 0
    return int(kept), float(seconds), peak, left


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="100,1000", help="corpus sizes in MB, smallest first")
    parser.add_argument("--keep", type=int, default=20_000, help="phase-1 texts to keep")
    parser.add_argument("--folder", default=None, help="where to write the corpora (default: a temporary folder)")
    args = parser.parse_args()
    folder = Path(args.folder or tempfile.mkdtemp(prefix="distill-corpus-"))
    folder.mkdir(parents=True, exist_ok=True)
    print("| corpus | rows | texts kept | read (s) | peak RSS (MiB) | left in datasets' cache |")
    print("|---|---|---|---|---|---|")
    for megabytes in (int(s) for s in args.sizes.split(",")):  # smallest first: RUSAGE_CHILDREN keeps the max
        path = folder / f"corpus-{megabytes}mb.jsonl"
        rows = write_corpus(path, megabytes)
        kept, seconds, peak, left = read(path, args.keep, folder / "datasets-cache")
        figures = f"{kept:,} | {seconds:.2f} | {peak / 2**20:,.0f} | {left / 1e6:,.0f} MB"
        print(f"| {megabytes:,} MB | {rows:,} | {figures} |")
        path.unlink()
    import datasets

    print(f"\n{machine()}; {versions()}, datasets {datasets.__version__}")
    print(f"\n`python bench/read_corpus.py --sizes {args.sizes} --keep {args.keep}`")


if __name__ == "__main__":
    main()
