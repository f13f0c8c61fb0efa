"""The static student against model2vec's own two steps, on the same texts and teacher vectors.

    python bench/static_peer.py --config configs/demo_static.yaml      # after that config's run

model2vec builds a static model in two steps: `distill` (every vocabulary token through the teacher, PCA to the
width) and `StaticModelForSimilarity.fit` on a corpus with the teacher's vectors of it (tokenlearn's recipe:
cosine loss, early stopping on a held-out tenth). The peer here is exactly that, on the run's phase-1 texts, with
the teacher's vectors from the run's cache in their top principal axes (the width the table has), starting from
the very table the run distilled (kept in the teacher cache folder). Both are scored by distill's evaluation on
the run's evaluation set; the run's own figures are read from its results.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/demo_static.yaml")
    parser.add_argument("--seed", type=int, default=42)
    args = parser.parse_args(argv)

    import torch
    from accelerate import Accelerator
    from model2vec import StaticModel
    from model2vec.train import StaticModelForSimilarity

    from distill.config import load_config
    from distill.data import load_data
    from distill.data.containers import EvalVectors
    from distill.hub import model_fingerprint, resolve_model
    from distill.metrics import score
    from distill.pipeline import teacher_context
    from distill.stages.targets import TeacherCache
    from distill.students.head import pca_basis
    from distill.students.static import DEFAULT_DIM, source_model
    from distill.teachers.local import LocalTeacher, TeacherSpec

    config = load_config(["--config", args.config, "--seed", str(args.seed)])
    accelerator = Accelerator(cpu=True)
    data = load_data(config.data, config.training.seed, need_phase2=False)
    assert data.evaluation is not None
    spec = TeacherSpec.from_config(config.teacher, teacher_context(config, accelerator.device))
    cache = TeacherCache(accelerator, LocalTeacher(spec), config.output.teacher_cache_dir, 64)
    targets = np.asarray(cache.embeddings(data.phase1_texts, "document"), dtype=np.float32)
    dim = config.student.student_dim or DEFAULT_DIM
    basis = pca_basis(targets)[:, :dim]  # the teacher in its top principal axes, as the run reads it
    source = resolve_model(source_model(config.student.student_model, config.teacher.teacher_model))
    table = Path(config.output.teacher_cache_dir).expanduser() / f"static-{model_fingerprint(source)[:16]}-{dim}"
    distilled = StaticModel.from_pretrained(str(table), force_download=False)

    def scored(model: StaticModel) -> dict:
        e = data.evaluation
        vectors = EvalVectors(model.encode(e.queries), model.encode(e.corpus), model.encode(e.sts_texts))
        return score(vectors, e)

    started = time.perf_counter()
    peer = StaticModelForSimilarity.from_static_model(model=distilled, out_dim=dim)
    peer.fit(data.phase1_texts, torch.from_numpy(targets @ basis), device="cpu", random_seed=args.seed)
    seconds = time.perf_counter() - started
    rows = {
        "model2vec distill alone": scored(distilled),
        "model2vec distill + StaticModelForSimilarity.fit": scored(peer.to_static_model()),
    }
    run = json.loads((Path(config.output.output_dir) / "results.json").read_text())
    rows["distill (both phases)"] = run["student_after"]
    teacher = run["teacher"]["ndcg@10"]
    print(f"| student ({dim} dims) | nDCG@10 | % of teacher | STS |\n|---|---:|---:|---:|")
    print(f"| the teacher | {teacher:.4f} | | {run['teacher'].get('sts_spearman', float('nan')):.3f} |")
    for name, metrics in rows.items():
        ndcg, sts = metrics["ndcg@10"], metrics.get("sts_spearman", float("nan"))
        print(f"| {name} | {ndcg:.4f} | {100 * ndcg / teacher:.1f}% | {sts:.3f} |")
    print(f"\npeer fit: {seconds:.0f} s on {len(data.phase1_texts):,} texts; {torch.get_num_threads()} threads")
    return 0


if __name__ == "__main__":
    sys.exit(main())
