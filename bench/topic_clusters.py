"""Time and peak memory of phase 2's topic clustering (`--topic_cluster_size`) on synthetic pair vectors.

    python bench/topic_clusters.py                      # this checkout's distill.batching.topic_clusters
    python bench/topic_clusters.py --rev 22e0ab5        # the function as it was at a git revision

Makes `--pairs` query and passage vectors of `--dim` dimensions as float16 `.npy` memory maps, as the teacher
cache holds them, around `pairs / cluster_size` planted topics, then clusters the pairs (query + positive
passage) once, timed, and prints one line: seconds, the process's peak RSS, how tight the clusters are (mean
cosine of a pair to its cluster's mean direction) and how well they recover the planted topics (adjusted Rand
index). Older revisions (before commit ed4c7d8) take the pairs as one float32 array, so for those the script
builds it, as `distill.train` did. Figures in docs/BENCHMARKS.md ("Topic clusters").
"""

from __future__ import annotations

import argparse
import importlib.util
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]


def planted_pairs(folder: Path, pairs: int, dim: int, topics: int, seed: int = 0) -> tuple[np.ndarray, ...]:
    """(queries, passages) as float16 memory maps, each row a noisy copy of its planted topic's centre; the topics."""
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((topics, dim)).astype(np.float32)
    truth = rng.integers(0, topics, pairs)
    arrays = []
    for name in ("queries", "passages"):
        array = np.lib.format.open_memmap(folder / f"{name}.npy", mode="w+", dtype=np.float16, shape=(pairs, dim))
        for start in range(0, pairs, 8192):
            rows = truth[start : start + 8192]
            noisy = centres[rows] + (8 / np.sqrt(dim)) * rng.standard_normal((len(rows), dim)).astype(np.float32)
            array[start : start + len(rows)] = noisy / np.linalg.norm(noisy, axis=1, keepdims=True)
        array.flush()
        arrays.append(np.load(folder / f"{name}.npy", mmap_mode="r"))
    return arrays[0], arrays[1], truth


def batching_at(rev: str | None):
    if rev is None:
        sys.path.insert(0, str(REPO))
        import distill.batching

        return distill.batching
    source = subprocess.run(
        ["git", "show", f"{rev}:distill/batching.py"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout
    path = Path(tempfile.mkdtemp()) / "batching_at_rev.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("batching_at_rev", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=200_000)
    parser.add_argument("--dim", type=int, default=768)
    parser.add_argument("--cluster_size", type=int, default=128)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--rev", help="time distill/batching.py as it was at this git revision")
    args = parser.parse_args()
    from sklearn.metrics import adjusted_rand_score

    batching = batching_at(args.rev)
    with tempfile.TemporaryDirectory() as folder:
        topics = max(1, args.pairs // args.cluster_size)
        queries, passages, truth = planted_pairs(Path(folder), args.pairs, args.dim, topics)
        positives = np.arange(args.pairs)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        started = time.perf_counter()
        if hasattr(batching, "PairVectors"):
            labels = batching.topic_clusters(
                batching.PairVectors(queries, passages, positives), args.cluster_size, args.seed
            )
        else:  # an older revision: one float32 array of every pair, as distill.train built it
            vectors = np.asarray(queries, dtype=np.float32) + np.asarray(passages[positives], dtype=np.float32)
            labels = batching.topic_clusters(vectors, args.cluster_size, args.seed)
        seconds = time.perf_counter() - started
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        unit = np.asarray(queries, dtype=np.float32) + np.asarray(passages, dtype=np.float32)
        unit /= np.linalg.norm(unit, axis=1, keepdims=True)
        centres = np.zeros((labels.max() + 1, args.dim))
        np.add.at(centres, labels, unit)
        centres /= np.maximum(np.linalg.norm(centres, axis=1, keepdims=True), 1e-12)
        tightness = float((unit * centres[labels]).sum(axis=1).mean())
    print(
        f"topic_clusters at {args.rev or 'this checkout'}: {args.pairs:,} pairs x {args.dim} dims, cluster size "
        f"{args.cluster_size} ({len(np.unique(labels))} clusters): {seconds:.1f} s, peak RSS {peak:,.0f} MiB "
        f"({before:,.0f} before clustering), mean cosine to the cluster centre {tightness:.4f}, adjusted Rand index "
        f"against the planted topics {adjusted_rand_score(truth, labels):.4f}"
    )


if __name__ == "__main__":
    main()
