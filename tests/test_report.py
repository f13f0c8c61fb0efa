"""Report: report.png and report.md are written whole, with or without Matryoshka data or a phase 1."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from distill.errors import DistillError
from distill.report import write_report

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def metrics(ndcg: float, matryoshka: dict[str, float] | None = None) -> dict:
    row = {"ndcg@10": ndcg, "mrr@10": ndcg - 0.05, "sts_spearman": 0.5}
    if matryoshka is not None:
        row["matryoshka_ndcg@10"] = matryoshka
    return row


def phase(steps: int, start: float) -> dict:
    losses = [start * math.exp(-i / 20) + 0.01 * (i % 3) for i in range(steps)]
    return {
        "teacher_seconds": 1.5,
        "train_seconds": 12.25,
        "train_samples": 32 * steps,
        "optimizer_steps": steps,
        "samples_per_second": 2.6 * steps,
        "final_loss": losses[-1],
        "losses": losses,
    }


def results(matryoshka: bool = True, phases: tuple[str, ...] = ("phase1", "phase2")) -> dict:
    """A results dict shaped like `train.run`'s (Matryoshka keys are strings, as after a JSON round trip)."""
    curve = {"64": 0.55, "32": 0.5, "16": 0.4} if matryoshka else None
    out: dict = {
        "world_size": 2,
        "mode": "matryoshka" if matryoshka else "projection",
        "teacher": {"ndcg@10": 0.6, "mrr@10": 0.55},  # no sts_spearman: a missing metric is skipped
        "student_before": metrics(0.45, curve and {d: v - 0.1 for d, v in curve.items()}),
        "phases": {name: phase(40, 1.0 if name == "phase1" else 0.7) for name in phases},
    }
    if len(phases) == 2:
        out["after_phase1"] = metrics(0.5)
    out["student_after"] = metrics(0.54, curve)
    return out


def check_png(path: Path) -> None:
    from matplotlib.image import imread

    assert path.read_bytes()[:8] == PNG_MAGIC
    height, width, _ = imread(path).shape
    assert width > 1000 and height > 300


@pytest.mark.parametrize(
    "case",
    [
        dict(matryoshka=True),
        dict(matryoshka=False),
        dict(matryoshka=True, phases=("phase2",)),
    ],
    ids=["matryoshka", "projection", "phase2_only"],
)
def test_report_files_written_whole(tmp_path: Path, case: dict) -> None:
    data = results(**case)
    png, md = write_report(tmp_path / "run", data)
    assert (png.name, md.name) == ("report.png", "report.md")
    check_png(png)
    text = md.read_text()
    assert "| metric | teacher | student_before |" in text
    assert "| ndcg@10 | 0.6000 | 0.4500 |" in text
    assert "keeps **90.0%** of the teacher's nDCG@10" in text  # 0.54 / 0.6
    assert "](report.png)" in text
    for name in data["phases"]:
        assert f"| {name} | 1.5000 | 12.2 | 1280 | 40 | 104.0 |" in text
    assert ("| Matryoshka dim |" in text) == case["matryoshka"]
    assert not [p.name for p in png.parent.iterdir() if p.name.startswith(".")]  # no staging files left


def test_report_without_evaluation_or_phases(tmp_path: Path) -> None:
    png, md = write_report(tmp_path, {"world_size": 1, "mode": "matryoshka", "phases": {}})
    check_png(png)
    text = md.read_text()
    assert "(no evaluation set)" in text and "(no training phase ran)" in text and "keeps" not in text


def test_failed_write_leaves_nothing(tmp_path: Path) -> None:
    (tmp_path / "report.png").mkdir()  # a directory where the file should go: the rename fails
    with pytest.raises(DistillError, match=r"cannot write .*report\.png .*make the output_dir writable"):
        write_report(tmp_path, results())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.png"]
    assert not (tmp_path / "report.md").exists()
