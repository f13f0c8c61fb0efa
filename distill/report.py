"""Results: `<output_dir>/results.json` (written whole or not at all) and the table printed at the end."""

from __future__ import annotations

import json
import os
from pathlib import Path

from accelerate import Accelerator

from distill.errors import DistillError

ROWS = ("teacher", "student_before", "after_phase1", "student_after")
METRICS = ("ndcg@10", "mrr@10", "sts_spearman", "teacher_cosine", "ndcg@10_student_dim")


def results_table(results: dict) -> str:
    """A Markdown table: one column per model state, one row per metric."""
    columns = [name for name in ROWS if isinstance(results.get(name), dict)]
    metrics = [m for m in METRICS if any(m in results[c] for c in columns)]
    lines = ["| metric | " + " | ".join(columns) + " |", "|---|" + "---|" * len(columns)]
    for metric in metrics:
        cells = [f"{results[c][metric]:.4f}" if metric in results[c] else "" for c in columns]
        lines.append(f"| {metric} | " + " | ".join(cells) + " |")
    matryoshka = results.get("student_after", {}).get("matryoshka_ndcg@10")
    if matryoshka:
        lines += ["", "| Matryoshka dim | nDCG@10 |", "|---|---|"]
        lines += [f"| {dim} | {value:.4f} |" for dim, value in matryoshka.items()]
    return "\n".join(lines)


def write_json_atomic(path: Path, payload: dict) -> None:
    staging = path.parent / f".{path.name}.tmp-{os.getpid()}"
    try:
        staging.write_text(json.dumps(payload, indent=2, default=str))
        os.replace(staging, path)
    except OSError as e:
        staging.unlink(missing_ok=True)
        raise DistillError(f"cannot write {path} ({e.strerror or e}); make the output_dir writable") from None


def write_results(accelerator: Accelerator, output_dir: str | os.PathLike, results: dict) -> Path:
    """Main process writes results.json; every process waits for it."""
    path = Path(output_dir) / "results.json"
    if accelerator.is_main_process:
        write_json_atomic(path, results)
    accelerator.wait_for_everyone()
    return path
