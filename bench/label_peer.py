"""The peer for phase 2's labels: sentence-transformers' own recipe on the same pairs, after the same phase 1.

    python bench/label_peer.py --model runs/p1/model --output runs/peer -- --config configs/demo.yaml --seed 42

`--model` is a distill run's exported phase-1 student (a run with `--skip_phase2 True`). This script trains it one
epoch on that config's phase-2 pairs (distill's data stage reads and cleans them, so they are the very pairs
distill's phase 2 trains on) with `SentenceTransformerTrainer` and `losses.MultipleNegativesRankingLoss`
(scale 1/`--temperature`, 20 by default; the pairs' negatives, or those `--mine_hard_negatives` mines as the run
does, as further candidates; `BatchSamplers.NO_DUPLICATES`), at the config's phase-2 learning rate, batch size,
warm-up and seed. The labels alone: the teacher's vectors pick the mined negatives and nothing else.

The model is scored before and after by `distill.stages.scoring.evaluate_student` on the config's held-out set, and
OUTPUT/results.json holds both in the layout `bench/paired.py` reads (`student_before`, `student_after`, with
per-query ranks), so `python bench/paired.py RUN:OUTPUT` compares a distill run with it query by query.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a distill run's exported phase-1 student folder")
    parser.add_argument("--output", required=True, help="where results.json goes")
    parser.add_argument("distill_flags", nargs="*", help="after --: the distill flags of the run (--config, --seed)")
    args = parser.parse_args()

    from accelerate import Accelerator
    from datasets import Dataset
    from sentence_transformers import (
        SentenceTransformer,
        SentenceTransformerTrainer,
        SentenceTransformerTrainingArguments,
    )
    from sentence_transformers.sentence_transformer import losses
    from sentence_transformers.sentence_transformer.training_args import BatchSamplers

    from distill.config import load_config
    from distill.data import load_data
    from distill.data.containers import passage_texts, pick
    from distill.pipeline import teacher_stage
    from distill.stages.scoring import eval_inputs, evaluate_student
    from distill.students import student_kind
    from distill.students.head import DistillationModel, embedding_dim, matryoshka_dims

    config = load_config(args.distill_flags)
    training, output = config.training, Path(args.output)
    output.mkdir(parents=True, exist_ok=True)
    accelerator = Accelerator()
    data = load_data(config.data, training.seed, need_phase1=False, need_phase2=True)
    described = student_kind(config.student.student_model).describe(config.student, config.teacher)
    teacher = teacher_stage(accelerator, config, data, None, described)  # the evaluation's vectors: cache hits
    student = SentenceTransformer(args.model, device="cpu")
    dims = None if config.mode.use_projection else matryoshka_dims(embedding_dim(student), config.mode.matryoshka_dims)

    def evaluate() -> dict:
        inputs = eval_inputs(student, data, teacher.evaluation)
        return evaluate_student(accelerator, DistillationModel(student, None), inputs, 2 * training.batch_size, dims)

    before = evaluate()
    pairs = data.phase2
    # The candidates distill's phase 2 ranks: the data's own negatives, or those `--mine_hard_negatives` mined from
    # the teacher's cached vectors (the teacher stage above mines them, as the run does).
    texts, _ = passage_texts(pairs)
    rows = teacher.passage_rows
    columns = {"anchor": list(pairs.queries), "positive": list(pairs.passages)}
    for i in range(1, rows.shape[1]):
        columns[f"negative_{i}"] = pick(texts, rows[:, i])
    loss = losses.MultipleNegativesRankingLoss(student, scale=1 / config.losses.temperature)
    trainer_args = SentenceTransformerTrainingArguments(
        output_dir=str(output / "trainer"),
        per_device_train_batch_size=training.batch_size,
        num_train_epochs=config.phase2.epochs,
        learning_rate=config.phase2.lr,
        warmup_steps=training.warmup_ratio,  # transformers 5: a float below 1 is a ratio
        weight_decay=training.weight_decay,
        max_grad_norm=training.max_grad_norm,
        seed=training.seed,
        batch_sampler=BatchSamplers.NO_DUPLICATES,  # sentence-transformers' advice for in-batch negatives
        save_strategy="no",
        report_to="none",
        logging_steps=50,
        disable_tqdm=True,
    )
    trainer = SentenceTransformerTrainer(
        model=student, args=trainer_args, train_dataset=Dataset.from_dict(columns), loss=loss
    )
    started = time.perf_counter()
    steps = trainer.train().global_step
    seconds = time.perf_counter() - started
    student.eval()
    after = evaluate()
    results = {
        "recipe": f"SentenceTransformerTrainer + losses.MultipleNegativesRankingLoss(scale={loss.scale})",
        "model": args.model,
        "pairs": len(pairs),
        "negatives_per_pair": rows.shape[1] - 1,
        "optimizer_steps": steps,
        "train_seconds": round(seconds, 1),
        "student_before": before,
        "student_after": after,
        "config": {"seed": training.seed, "phase2_lr": config.phase2.lr, "batch_size": training.batch_size},
    }
    (output / "results.json").write_text(json.dumps(results, indent=2))
    print(
        f"peer: nDCG@10 {before['ndcg@10']:.4f} -> {after['ndcg@10']:.4f} in {steps} steps, {seconds:.0f} s "
        f"({output / 'results.json'})"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
