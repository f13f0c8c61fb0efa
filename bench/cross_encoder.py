"""The demo's reranker: a cross-encoder trained from the shipped MiniLM on the demo's training pairs.

    python bench/cross_encoder.py [--output runs/cache/cross-encoder] [--pairs 3000] [--negatives 3]

No cross-encoder ships on PyPI, so `configs/demo_reranker.yaml` reads one built here (the Augmented SBERT recipe:
a cross-encoder learns more from few labelled pairs than a bi-encoder, then teaches one). It is trained with
sentence-transformers' own `CrossEncoderTrainer` and `BinaryCrossEntropyLoss`:

- the pairs: the first `--pairs` inverse-cloze pairs of the demo's training articles (seed 42), the ones
  `configs/demo.yaml` reads;
- the negatives: `--negatives` per query, mined with sentence-transformers' `mine_hard_negatives` and the demo's
  teacher (all-MiniLM-L6-v2), drawn at random from its hits 3 to 30 (the top 2 are often other sentences of the
  same paragraph);
- one epoch, batch 32, learning rate 1e-4, max length 128 (the demo's student reads 128 tokens too). The
  classification head starts from nothing on a bi-encoder's weights: at 3e-5 its loss stayed at chance for 250 steps.

A folder that holds a finished model is kept: the step runs once per machine (about 20 minutes on 2 cores). Then
it scores the cross-encoder where it would serve: it reranks the teacher's top 100 of each held-out query of the
demo's evaluation set, and prints nDCG@10 beside the teacher's own, into `<output>/eval.json` too.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from distill import embedded
from distill.hub import resolve_model
from distill.metrics import ndcg_per_query, ranks_of

BASE = "sentence-transformers/all-MiniLM-L6-v2"


def train(output: Path, pairs: int, negatives: int, seed: int) -> None:
    import torch
    from datasets import Dataset
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.cross_encoder import (
        CrossEncoder,
        CrossEncoderTrainer,
        CrossEncoderTrainingArguments,
    )
    from sentence_transformers.cross_encoder.losses import BinaryCrossEntropyLoss
    from sentence_transformers.util import mine_hard_negatives

    folder = resolve_model(BASE)
    queries, passages = embedded.phase2_pairs(seed)
    data = Dataset.from_dict({"query": queries[:pairs], "passage": passages[:pairs]})
    mined = mine_hard_negatives(
        data,
        SentenceTransformer(folder, device="cpu"),
        range_min=2,
        range_max=30,
        num_negatives=negatives,
        sampling_strategy="random",
        output_format="labeled-pair",
        batch_size=128,
    )
    model = CrossEncoder(folder, num_labels=1, max_length=128, device="cpu")
    args = CrossEncoderTrainingArguments(
        output_dir=str(output.parent / f".{output.name}-trainer"),
        num_train_epochs=1,
        per_device_train_batch_size=32,
        learning_rate=1e-4,
        warmup_ratio=0.1,
        seed=seed,
        save_strategy="no",
        report_to="none",
        logging_steps=100,
    )
    loss = BinaryCrossEntropyLoss(model, pos_weight=torch.tensor(negatives))
    CrossEncoderTrainer(model=model, args=args, train_dataset=mined, loss=loss).train()
    model.save_pretrained(str(output))


def evaluate(output: Path, seed: int, depth: int) -> dict[str, float]:
    """nDCG@10 of the teacher on the demo's held-out set, and of the cross-encoder reranking its top `depth`."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.cross_encoder import CrossEncoder

    queries, corpus, relevant, _ = embedded.eval_set(seed, 1000)
    teacher = SentenceTransformer(resolve_model(BASE), device="cpu")
    q = teacher.encode(queries, batch_size=128, normalize_embeddings=True)
    c = teacher.encode(corpus, batch_size=128, normalize_embeddings=True)
    top = np.argsort(-(q @ c.T), axis=1)[:, :depth]
    reranker = CrossEncoder(str(output), device="cpu")
    scores = reranker.predict(
        [(queries[i], corpus[j]) for i in range(len(queries)) for j in top[i]], batch_size=64, show_progress_bar=True
    ).reshape(len(queries), depth)
    reranked = np.take_along_axis(top, np.argsort(-scores, axis=1, kind="stable"), axis=1)

    def ndcg(rows: np.ndarray) -> float:
        return float(ndcg_per_query(ranks_of(rows[:, :10], relevant)).mean())

    return {"queries": len(queries), "depth": depth, "teacher_ndcg@10": ndcg(top), "reranked_ndcg@10": ndcg(reranked)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output", default="runs/cache/cross-encoder")
    parser.add_argument("--pairs", type=int, default=3000)
    parser.add_argument("--negatives", type=int, default=3)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--depth", type=int, default=100, help="the teacher's hits the cross-encoder reranks")
    args = parser.parse_args()
    output = Path(args.output)
    if (output / "config.json").is_file():
        print(f"{output}: a trained cross-encoder is there already; delete the folder to train it again")
    else:
        started = time.perf_counter()
        train(output, args.pairs, args.negatives, args.seed)
        print(f"trained in {time.perf_counter() - started:.0f} s into {output}")
    report = output / "eval.json"
    if not report.is_file():
        report.write_text(json.dumps(evaluate(output, args.seed, args.depth), indent=2) + "\n")
    print(report.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
