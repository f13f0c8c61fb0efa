"""Report: report.png and report.md are written whole, with or without Matryoshka data or a phase 1."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from distill.errors import DistillError
from distill.report import report_figure, report_markdown, results_table, write_report

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
    """A results dict shaped like `RunResults.to_dict()` (Matryoshka keys are strings, as after a JSON round trip)."""
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


def mid_phase_axes(figure) -> list:
    return [a for a in figure.axes if a.get_ylabel().startswith("nDCG@10 (mid-phase")]


def test_report_shows_the_mid_phase_evaluations(tmp_path: Path) -> None:
    data = results()
    data["evaluations"] = {  # as the phases record them with --eval_steps: steps count within each phase
        "phase1": [{"step": 10, "ndcg@10": 0.47, "teacher_cosine": 0.8}, {"step": 20, "ndcg@10": 0.49}],
        "phase2": [{"step": 15, "ndcg@10": 0.52}],
    }
    _, md = write_report(tmp_path, data)
    text = md.read_text()
    assert "## Evaluations during training" in text
    assert "| phase | step | ndcg@10 | teacher_cosine |" in text
    assert "| phase1 | 10 | 0.4700 | 0.8000 |" in text and "| phase1 | 20 | 0.4900 |  |" in text
    assert "| phase2 | 15 | 0.5200 |  |" in text
    figure = report_figure(data)
    (axes,) = mid_phase_axes(figure)
    (line,) = axes.get_lines()
    # phase 2's step 15 lies after phase 1's 40 steps on the shared step axis
    assert list(line.get_xdata()) == [10, 20, 55] and list(line.get_ydata()) == [0.47, 0.49, 0.52]
    assert "nDCG@10 during training (right axis)" in [t.get_text() for t in figure.axes[0].get_legend().get_texts()]


def test_report_without_mid_phase_evaluations_has_no_such_section() -> None:
    data = results()
    assert mid_phase_axes(report_figure(data)) == []
    assert "during training" not in report_markdown(data)


def test_failed_write_leaves_nothing(tmp_path: Path) -> None:
    (tmp_path / "report.png").mkdir()  # a directory where the file should go: the rename fails
    with pytest.raises(DistillError, match=r"cannot write .*report\.png .*make the output_dir writable"):
        write_report(tmp_path, results())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.png"]
    assert not (tmp_path / "report.md").exists()


def test_projection_metrics_reach_the_report_table() -> None:
    """Projection mode's own rows (the student's dimension, the teacher-built index) are in report.md and the card."""
    data = results(matryoshka=False)
    for row, (own, asymmetric) in {"student_before": (0.44, 0.31), "student_after": (0.53, 0.47)}.items():
        data[row] |= {"ndcg@10_student_dim": own, "ndcg@10_asymmetric": asymmetric}
    text = report_markdown(data)
    assert "| ndcg@10_student_dim |  | 0.4400 |  | 0.5300 |" in text  # no teacher or after_phase1 value here
    assert "| ndcg@10_asymmetric |  | 0.3100 |  | 0.4700 |" in text
    assert results_table(data) in text  # the table the model card and the console get


def test_negative_metrics_are_drawn_below_zero() -> None:
    """An untrained student's STS Spearman can be negative: its bar and label show below the axis, not cut off."""
    data = results()
    data["student_before"]["sts_spearman"] = -0.2
    (axes,) = [a for a in report_figure(data).axes if a.get_title() == "(b) evaluation"]
    bottom, top = axes.get_ylim()
    assert bottom < -0.2 and top > 0.6
    assert "-0.200" in [t.get_text() for t in axes.texts]


def test_the_loss_panels_legend_covers_no_curve_with_mid_phase_evaluations() -> None:
    """Loss and nDCG@10 curves on two scales leave no free corner: the legend sits outside the plot, below it."""
    data = results()
    data["evaluations"] = {"phase1": [{"step": s, "ndcg@10": 0.4 + s / 400} for s in range(5, 41, 5)]}
    figure = report_figure(data)
    figure.canvas.draw()
    axes = figure.axes[0]
    legend, plot = axes.get_legend().get_window_extent(), axes.get_window_extent()
    assert legend.y1 <= plot.y0  # wholly below the plotting area


def test_a_second_run_in_one_output_dir_is_refused_while_the_first_is_alive(tmp_path: Path) -> None:
    """Two runs in one --output_dir mixed their checkpoints and results. The first holds a lock for its life; a
    second one (another process: here the launcher's early check, and a run started elsewhere) refuses in one line.
    Released, the lock file goes, and so does a folder the run made and left empty."""
    import subprocess
    import sys

    from distill.report import probe_output_dir, release_output_dir

    out = tmp_path / "out"
    probe_output_dir(out, fresh=True, hold=True)
    try:
        busy = r"output_dir '.*out' is in use by another run \(host .+, pid \d+\); wait for it to end, or pass another"
        with pytest.raises(DistillError, match=busy):
            probe_output_dir(out, fresh=True)  # the launcher's check, which holds nothing
        second = "from pathlib import Path; from distill.report import probe_output_dir as p; p(Path(%r), True, True)"
        done = subprocess.run([sys.executable, "-c", second % str(out)], capture_output=True, text=True)
        assert done.returncode != 0 and "is in use by another run" in done.stderr
    finally:
        release_output_dir()
    assert not out.exists()
    probe_output_dir(out, fresh=True)  # free again


def test_the_phases_table_names_phase_twos_hard_negatives() -> None:
    data = results()
    data["phases"]["phase2"] |= {"terms": {"similarity_kl": 1.0, "mnrl": 4.0}}
    assert "| similarity_kl 1, mnrl 4 |" in report_markdown(data)  # in-batch negatives alone: nothing more said
    data["phases"]["phase2"]["negatives"] = {"per_query": 2, "from": "the data"}
    assert "| similarity_kl 1, mnrl 4; 2 hard negatives per query (the data) |" in report_markdown(data)
