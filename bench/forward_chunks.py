"""Phase 2's step time with a batch's queries and passages forwarded whole or in length chunks (`--forward_chunks`).

    python bench/forward_chunks.py --steps 30 --repeats 3 --chunks 1,4

Times the first `--steps` phase-2 batches of the demo (its 4,980 inverse-cloze pairs, seed 42, batch 32, the
toolkit's own sampler and collate) through the demo's student (all-MiniLM-L6-v2 cut to 3 layers, attention
dropout 0, as trained): forward of queries and passages, the in-batch similarity loss, backward, AdamW step.
Each repeat runs every setting once, in turn, so a machine that speeds up or slows down shows as spread, not as
a difference. Prints a markdown table (median of the repeats, min-max) with the padding of each setting, the
machine, the versions and the command.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from quality import machine, versions

from distill import embedded
from distill.batching import LengthGroupedBatchSampler, Phase2Batches, TokenizedTexts, assemble_chunks
from distill.student import load_student

MODEL = "sentence-transformers/all-MiniLM-L6-v2"


def step(student, optimizer, batch: dict) -> None:
    """One phase-2 optimizer step: queries and passages (chunked as the collate made them), loss, backward, step."""
    parts = [*batch["queries"]["chunks"], *batch["passages"]["chunks"]]
    outputs = [student(dict(features))["sentence_embedding"] for features in parts]
    count = len(batch["queries"]["chunks"])
    queries = assemble_chunks(outputs[:count], batch["queries"])  # (batch, dim)
    passages = assemble_chunks(outputs[count:], batch["passages"])
    scores = queries @ passages.T / 0.05
    labels = torch.arange(len(queries))
    loss = torch.nn.functional.cross_entropy(scores, labels) + (1 - (queries * passages).sum(1)).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def measure(
    student,
    queries: list[str],
    passages: list[str],
    settings: list[int],
    steps: int,
    repeats: int,
    seed: int = 42,
) -> dict[int, dict]:
    """Per `--forward_chunks` setting: forward calls per step, padded tokens per real one, and each repeat's seconds.

    The batches are the toolkit's (length-grouped sampler, phase-2 collate), the first `steps` of an epoch; every
    setting trains the same batches, one setting after the other within each repeat.
    """
    student.train()
    optimizer = torch.optim.AdamW([p for p in student.parameters() if p.requires_grad], lr=5e-5)
    max_length = student.max_seq_length
    tokenized_queries = TokenizedTexts(student.tokenizer, queries, max_length)
    tokenized_passages = TokenizedTexts(student.tokenizer, passages, max_length)
    lengths = tokenized_queries.lengths + tokenized_passages.lengths
    batches = list(LengthGroupedBatchSampler(lengths, 32, seed))[:steps]
    rows, unit = np.arange(len(queries))[:, None], np.zeros((len(queries), 1), dtype=np.float16)
    collates = {c: Phase2Batches(tokenized_queries, tokenized_passages, rows, unit, unit, c) for c in settings}
    collated = {c: [collates[c](b) for b in batches] for c in settings}
    real = sum(int(lengths[b].sum()) for b in batches)
    seconds: dict[int, list[float]] = {c: [] for c in settings}
    step(student, optimizer, collated[settings[0]][0])  # warm-up: first-call allocations
    for _ in range(repeats):
        for c in settings:
            started = time.perf_counter()
            for batch in collated[c]:
                step(student, optimizer, batch)
            seconds[c].append(time.perf_counter() - started)
    results = {}
    for c in settings:
        parts = [f for b in collated[c] for f in [*b["queries"]["chunks"], *b["passages"]["chunks"]]]
        results[c] = {
            "calls_per_step": len(parts) / len(batches),
            "padding": sum(f["input_ids"].numel() for f in parts) / real,
            "step_seconds": [s / len(batches) for s in seconds[c]],
        }
    return results


def table(results: dict[int, dict]) -> list[str]:
    """Markdown rows: median seconds per step (min-max) and the ratio to the first setting."""
    settings = list(results)
    first = f"vs {settings[0]} chunk{'s' if settings[0] > 1 else ''}"
    lines = [
        f"| --forward_chunks | forward calls per step | padded tokens per real one | seconds per step | {first} |",
        "|---|---|---|---|---|",
    ]
    base = statistics.median(results[settings[0]]["step_seconds"])
    for c, row in results.items():
        per_step = row["step_seconds"]
        median = statistics.median(per_step)
        lines.append(
            f"| {c} | {row['calls_per_step']:.2f} | {row['padding']:.3f} | {median:.3f} "
            f"({min(per_step):.3f}-{max(per_step):.3f}) | {median / base:.2f} |"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30, help="phase-2 batches timed per setting and repeat")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--chunks", default="1,4", help="comma-separated --forward_chunks settings")
    args = parser.parse_args()
    settings = [int(c) for c in args.chunks.split(",")]
    torch.manual_seed(42)
    student = load_student(MODEL, num_layers=3, max_seq_length=128, attention_dropout=0.0)
    queries, passages = embedded.inverse_cloze_pairs(embedded.train_articles(), 42, 2)
    results = measure(student, queries, passages, settings, args.steps, args.repeats)
    command = f"python bench/forward_chunks.py --steps {args.steps} --repeats {args.repeats} --chunks {args.chunks}"
    print(f"Command: `{command}`  ")
    print(f"Machine: {machine()}  \nVersions: {versions()}\n")
    print("\n".join(table(results)))


if __name__ == "__main__":
    main()
