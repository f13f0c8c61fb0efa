"""bench/forward_chunks.py on the tiny student: the settings train the same batches and the table reports them."""

from __future__ import annotations

import sys
from pathlib import Path

from conftest import sentences

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import forward_chunks


def test_chunked_forward_pads_less_in_more_calls_and_the_table_shows_it(tiny_models) -> None:
    from distill.student import load_student

    student = load_student(str(tiny_models["student"]), max_seq_length=32, attention_dropout=0.0)
    # queries short, passages from 3 to about 60 words: within a batch the passages' lengths vary a lot
    queries = sentences(96, seed=11)
    passages = [" ".join(sentences(1 + i % 5, seed=100 + i)) for i in range(96)]
    results = forward_chunks.measure(student, queries, passages, [1, 4], steps=2, repeats=2)
    whole, chunked = results[1], results[4]
    assert whole["calls_per_step"] == 2  # queries, passages: one call each
    assert 2 < chunked["calls_per_step"] <= 8
    assert 1 <= chunked["padding"] < whole["padding"]  # never below the real tokens, and less padded than whole
    assert all(len(r["step_seconds"]) == 2 and min(r["step_seconds"]) > 0 for r in results.values())
    lines = forward_chunks.table(results)
    assert lines[0].endswith("| vs 1 chunk |") and len(lines) == 4
    assert lines[2].startswith("| 1 | 2.00 |") and lines[2].endswith("| 1.00 |")
    assert lines[3].startswith(f"| 4 | {chunked['calls_per_step']:.2f} | {chunked['padding']:.3f} |")
