"""The run's outputs: its output folder, `results.json`, `report.png` and `report.md`, each whole or not at all."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from accelerate import Accelerator

from distill.checkpoint import checkpoint_root, list_checkpoints
from distill.config.flags import dump_config
from distill.config.schema import Config
from distill.distributed import job_id, main_decides, on_main_process
from distill.errors import DistillError
from distill.files import unique_suffix, write_atomic, write_json_atomic
from distill.results import ROWS, RunResults, negatives_phrase
from distill.stages.tradeoff import cost_table, trade_off_line
from distill.store import claim, holder, lock_held

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

METRICS = ("ndcg@10", "mrr@10", "sts_spearman", "teacher_cosine", "ndcg@10_student_dim", "ndcg@10_asymmetric")


def results_table(results: dict) -> str:
    """A Markdown table: one column per model state, one row per metric."""
    columns = [name for name in ROWS if isinstance(results.get(name), dict)]
    metrics = [m for m in METRICS if any(m in results[c] for c in columns)]
    lines = ["| metric | " + " | ".join(columns) + " |", "|---|" + "---|" * len(columns)]
    for metric in metrics:
        cells = [f"{results[c][metric]:.4f}" if metric in results[c] else "" for c in columns]
        lines.append(f"| {metric} | " + " | ".join(cells) + " |")
    datasets = [c for c in columns if "datasets_ndcg@10" in results[c]]
    if datasets:  # a benchmark of several datasets (NanoBEIR): each one's nDCG@10
        lines += ["", "| dataset (nDCG@10) | " + " | ".join(datasets) + " |", "|---|" + "---|" * len(datasets)]
        for name in results[datasets[0]]["datasets_ndcg@10"]:
            cells = [f"{results[c]['datasets_ndcg@10'].get(name, float('nan')):.4f}" for c in datasets]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    matryoshka = results.get("student_after", {}).get("matryoshka_ndcg@10")
    if matryoshka:
        lines += ["", "| Matryoshka dim | nDCG@10 |", "|---|---|"]
        lines += [f"| {dim} | {value:.4f} |" for dim, value in matryoshka.items()]
    return "\n".join(lines)


def evaluations_table(results: dict) -> str:
    """A Markdown table of the mid-phase evaluations (`--eval_steps`), one row per phase and step; "" if none."""
    history = [(phase, entry) for phase, entries in (results.get("evaluations") or {}).items() for entry in entries]
    if not history:
        return ""
    metrics = [m for m in METRICS if any(m in entry for _, entry in history)]
    lines = ["| phase | step | " + " | ".join(metrics) + " |", "|---|---|" + "---|" * len(metrics)]
    for phase, entry in history:
        cells = [f"{entry[m]:.4f}" if m in entry else "" for m in metrics]
        lines.append(f"| {phase} | {entry['step']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_results(accelerator: Accelerator, output_dir: Path, results: RunResults) -> Path:
    """The leaf writer of a run's figures: results.json, then report.png and report.md, by the main process.

    An unwritable report is a warning, not a failed run: the model and results.json are written by then.
    """
    path = output_dir / "results.json"

    def write() -> None:
        write_json_atomic(path, results.to_dict())
        try:
            write_report(output_dir, results.to_dict())
        except Exception as e:  # matplotlib or the disk: results.json holds every figure
            logger.warning(f"report not written ({type(e).__name__}: {e}); results.json holds every figure")

    on_main_process(accelerator, write)
    return path


def check_output_dir(accelerator: Accelerator, path: str, fresh: bool = False) -> Path:
    """Fail early if output_dir cannot be written, leaving nothing behind (folders made for the probe are removed).

    A `fresh` run (not resuming) also fails if output_dir holds an earlier run's checkpoints: its own would be
    ordered among them, pruned in their favour, and `latest` would pick the earlier run's.
    The main process probes and tells every process the verdict, so all of them stop, none waits alone.
    """
    output_dir = Path(path).expanduser()
    main_decides(accelerator, lambda: probe_output_dir(output_dir, fresh, hold=True))
    return output_dir


def probe_output_dir(output_dir: Path, fresh: bool, hold: bool = False) -> None:
    """Raise a DistillError if `output_dir` holds an earlier run (when `fresh`), cannot be written, or another live
    run holds it; with `hold`, this process holds it from now on (`hold_output_dir`)."""
    earlier = list_checkpoints(checkpoint_root(output_dir)) if fresh else []
    if earlier:
        raise DistillError(
            f"output_dir {str(output_dir)!r} holds checkpoints of an earlier run ({earlier[-1].name}, ...); pass "
            "--resume_from_checkpoint latest to continue it, or a fresh --output_dir (or delete "
            f"{checkpoint_root(output_dir)})"
        )
    missing = [p for p in [output_dir, *output_dir.parents] if not p.exists()]
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
        probe = output_dir / f".write-test-{unique_suffix()}"
        probe.write_text("ok")
        probe.unlink()
        if hold:
            hold_output_dir(output_dir, missing)
        elif lock_held(output_dir / RUN_LOCK):
            raise DistillError(busy(output_dir))
    except OSError as e:
        raise DistillError(
            f"output_dir {str(output_dir)!r} is not writable ({e.strerror or e}); pass a writable --output_dir"
        ) from None
    finally:
        if not HELD:
            remove_empty(missing)


RUN_LOCK = ".distill-run.lock"
HELD: list[tuple[int, Path, list[Path]]] = []  # this process's hold on its output_dir: (fd, lock file, folders made)


def hold_output_dir(output_dir: Path, made: list[Path]) -> None:
    """Hold `<output_dir>/.distill-run.lock` (flock) for the run's life, so a second run there refuses in one line
    while this one is alive: two runs would mix their checkpoints and results. A lock dies with its process (a
    crash, a SIGKILL, a requeue), so a run that resumes is never locked out. Where the filesystem has no locks,
    nothing is held, and that is said."""
    if HELD:
        return
    taken = claim(output_dir / RUN_LOCK, job_id())
    if taken.held:
        raise DistillError(busy(output_dir))
    if taken.fd is None:
        logger.warning(
            f"output_dir {output_dir} takes no file locks ({taken.unsupported}); nothing keeps a second run from "
            "writing there at the same time"
        )
        return
    HELD.append((taken.fd, output_dir / RUN_LOCK, made))


def busy(output_dir: Path) -> str:
    who = holder(output_dir / RUN_LOCK)
    return (
        f"output_dir {str(output_dir)!r} is in use by another run (host {who.get('host', '?')}, pid "
        f"{who.get('pid', '?')}); wait for it to end, or pass another --output_dir"
    )


def release_output_dir() -> None:
    """Let go of the output_dir's lock (the lock file goes while still held), and of the folders the probe made
    where nothing else came into them."""
    while HELD:
        fd, lock, made = HELD.pop()
        with contextlib.suppress(OSError):
            lock.unlink()
        os.close(fd)
        remove_empty(made)


def remove_empty(folders: list[Path]) -> None:
    for folder in folders:  # deepest first
        if folder.is_dir() and not any(folder.iterdir()):
            folder.rmdir()


def prepare_output_dir(accelerator: Accelerator, config: Config) -> Path:
    """Create output_dir with the resolved config.yaml, once the inputs have been validated."""
    output_dir = Path(config.output.output_dir).expanduser()

    def write() -> None:
        output_dir.mkdir(parents=True, exist_ok=True)
        dump_config(config, output_dir / "config.yaml")

    on_main_process(accelerator, write)
    return output_dir


BAR_METRICS = ("ndcg@10", "mrr@10", "sts_spearman")
PHASE_FIELDS = (
    "teacher_seconds",
    "train_seconds",
    "train_samples",
    "optimizer_steps",
    "samples_per_second",
    "final_loss",
)
ROW_LABELS = {
    "teacher": "teacher",
    "student_before": "student before",
    "after_phase1": "after phase 1",
    "student_after": "student after",
}


def write_report(output_dir: str | os.PathLike, results: dict) -> tuple[Path | None, Path]:
    """Write `report.png` (loss curves, metric bars, Matryoshka curve) and `report.md` into `output_dir`.

    A leaf writer: the caller runs it on the main process only, so nothing here touches another rank.
    A figure that cannot be drawn (matplotlib missing, say) is a warning, and `report.md` is written without
    it. Returns the (png or None, md) paths.
    """
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    png: Path | None = output_dir / "report.png"
    md = output_dir / "report.md"
    try:
        figure = report_figure(results)
    except Exception as e:  # the numbers matter more than the picture
        logger.warning(f"report.png not drawn ({type(e).__name__}: {e}); report.md has every figure")
        png = None
    else:  # the staging name has no .png suffix, so the format is given explicitly
        assert png is not None
        write_atomic(png, lambda staging: figure.savefig(staging, format="png", dpi=110))
    write_atomic(md, lambda staging: staging.write_text(report_markdown(results, png.name if png else None)))
    return png, md


def report_markdown(results: dict, image_name: str | None = "report.png") -> str:
    """The Markdown report: evaluation table, share of the teacher's nDCG@10 kept, per-phase table, figure link."""
    lines = [f"# Distillation report ({_run_description(results)})", ""]
    if image_name:
        lines += [f"![Distillation report]({image_name})", ""]
    lines += ["## Evaluation", ""]
    if any(isinstance(results.get(row), dict) for row in ROWS):
        lines.append(results_table(results))
        kept = _kept_share(results)
        if kept is not None:
            share, student, teacher = kept
            kept_line = f"The student keeps **{share:.1f}%** of the teacher's nDCG@10 ({student:.4f} vs {teacher:.4f})."
            lines += ["", kept_line]
    else:
        lines.append("(no evaluation set)")
    costs = cost_table(results)
    if costs:
        lines += ["", "## Cost", ""]
        trade_off = trade_off_line(results)
        lines += [trade_off, ""] if trade_off else []
        lines.append(costs)
    history = evaluations_table(results)
    if history:
        lines += ["", "## Evaluations during training (`--eval_steps`)", "", history]
    lines += ["", "## Phases", ""]
    phases = results.get("phases") or {}
    if phases:
        header = [*PHASE_FIELDS, "loss terms (weight)", "nDCG@10 added"]
        lines += ["| phase | " + " | ".join(header) + " |", "|---|" + "---|" * len(header)]
        for phase, stats in phases.items():
            cells = [_cell(stats.get(field)) for field in PHASE_FIELDS]
            terms = ", ".join(f"{name} {weight:g}" for name, weight in (stats.get("terms") or {}).items())
            if negatives := negatives_phrase(stats):
                terms += f"; {negatives}"
            gain = (stats.get("added") or {}).get("ndcg@10")
            cells += [terms, "" if gain is None else f"{gain:+.4f}"]
            lines.append(f"| {phase} | " + " | ".join(cells) + " |")
    else:
        lines.append("(no training phase ran)")
    return "\n".join(lines) + "\n"


def report_figure(results: dict) -> Figure:
    """The four-panel figure: loss per optimizer step, metric bars per model state, nDCG@10 per Matryoshka dim,
    and quality against encoding throughput (teacher, student before and after, each Matryoshka width)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    # A bare Figure on the Agg canvas: no pyplot, so no global backend switch and no figure left open.
    figure = Figure(figsize=(24, 5.6), layout="constrained")
    FigureCanvasAgg(figure)
    panels = figure.subplots(1, 4, width_ratios=(1.25, 1.0, 0.85, 0.9))
    _plot_losses(panels[0], results.get("phases") or {}, results.get("evaluations") or {})
    _plot_metrics(panels[1], results)
    _plot_matryoshka(panels[2], results)
    _plot_trade_off(panels[3], results)
    figure.suptitle(f"Distillation report: {_run_description(results)}", fontsize=14)
    return figure


def _run_description(results: dict) -> str:
    world = results.get("world_size", "?")
    return f"mode {results.get('mode', '?')}, world_size {world}"


def _kept_share(results: dict) -> tuple[float, float, float] | None:
    """(percent of the teacher's nDCG@10 the trained student reaches, student's, teacher's), if both exist."""
    teacher = (results.get("teacher") or {}).get("ndcg@10")
    student = (results.get("student_after") or {}).get("ndcg@10")
    if teacher is None or student is None or teacher <= 0:
        return None
    return 100.0 * student / teacher, student, teacher


def _cell(value: object) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.4f}" if abs(value) < 10 else f"{value:.1f}"
    return str(value)


def _moving_average(values: Sequence[float], window: int) -> np.ndarray:
    """Trailing mean over `window` steps; the first steps average what there is, so the length is unchanged."""
    values = np.asarray(values, dtype=float)
    sums = np.cumsum(np.insert(values, 0, 0.0))
    ends = np.arange(1, len(values) + 1)
    starts = np.maximum(ends - window, 0)
    return (sums[ends] - sums[starts]) / (ends - starts)


def _no_data(axes: Axes, message: str) -> None:
    axes.text(0.5, 0.5, message, ha="center", va="center", transform=axes.transAxes, fontsize=11, color="0.4")
    axes.set_xticks([])
    axes.set_yticks([])


def _plot_losses(axes: Axes, phases: dict, evaluations: dict) -> None:
    """Loss per step of each phase; with `--eval_steps`, the mid-phase nDCG@10 on a second axis at the right."""
    axes.set_title("(a) training loss per optimizer step")
    offset = 0
    scores: list[tuple[int, float]] = []  # (step on the shared axis, nDCG@10)
    for color, phase in zip(("C0", "C1"), ("phase1", "phase2")):
        losses = (phases.get(phase) or {}).get("losses") or []
        scores += [(offset + e["step"], e["ndcg@10"]) for e in evaluations.get(phase, []) if "ndcg@10" in e]
        if not losses:
            continue
        steps = np.arange(offset + 1, offset + len(losses) + 1)
        window = max(1, min(20, len(losses) // 25))  # short: ~4% of the phase, at most 20 steps
        label = f"phase {phase[-1]}" + (f" (moving average of {window})" if window > 1 else "")
        axes.plot(steps, losses, color=color, alpha=0.25, linewidth=0.8)
        axes.plot(steps, _moving_average(losses, window), color=color, linewidth=1.8, label=label)
        if offset:  # phase 2 continues phase 1's step count
            axes.axvline(offset + 0.5, color="0.3", linestyle=":", linewidth=1.2)
            axes.annotate(
                "phase 2",
                xy=(offset + 0.5, 0.0),
                xycoords=("data", "axes fraction"),
                xytext=(4, 6),
                textcoords="offset points",
                fontsize=9,
                color="0.3",
            )
        offset += len(losses)
    if not offset:
        _no_data(axes, "no training steps")
        return
    axes.set_xlabel("optimizer step")
    axes.set_ylabel("loss")
    axes.set_xlim(0, offset + 1)
    axes.grid(alpha=0.3)
    handles, labels = axes.get_legend_handles_labels()
    if scores:
        ndcg_axes = axes.twinx()
        (line,) = ndcg_axes.plot(*zip(*scores), color="C3", marker="o", markersize=4, linewidth=1.2)
        ndcg_axes.set_ylabel("nDCG@10 (mid-phase evaluations)", color="C3")
        ndcg_axes.tick_params(axis="y", colors="C3")
        handles.append(line)
        labels.append("nDCG@10 during training (right axis)")
    if scores:  # two curves on two scales leave no corner free: the legend goes under the x axis label
        axes.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=len(labels), fontsize=9)
    else:
        axes.legend(handles, labels, loc="upper right", fontsize=9)


def _plot_metrics(axes: Axes, results: dict) -> None:
    axes.set_title("(b) evaluation")
    rows = [row for row in ROWS if isinstance(results.get(row), dict)]
    metrics = [m for m in BAR_METRICS if any(m in results[row] for row in rows)]
    if not metrics:
        _no_data(axes, "no evaluation set")
        return
    width = 0.8 / len(rows)
    groups = np.arange(len(metrics))
    low = top = 0.0
    for i, row in enumerate(rows):
        present = [j for j, m in enumerate(metrics) if m in results[row]]
        values = [results[row][metrics[j]] for j in present]
        bars = axes.bar(groups[present] + (i - (len(rows) - 1) / 2) * width, values, width, label=ROW_LABELS[row])
        axes.bar_label(bars, fmt="%.3f", fontsize=8, rotation=90, padding=3)
        low, top = min([low, *values]), max([top, *values])
    axes.set_xticks(groups, metrics)
    span = top - low
    # room for the value labels and the legend above the bars, and below a negative one (an STS Spearman can be)
    axes.set_ylim(low - 0.25 * span if low < 0 else 0, top + 0.35 * span)
    if low < 0:
        axes.axhline(0, color="0.3", linewidth=0.8)
    axes.grid(axis="y", alpha=0.3)
    axes.legend(loc="upper center", ncol=len(rows), fontsize=9, frameon=False)


def _plot_matryoshka(axes: Axes, results: dict) -> None:
    axes.set_title("(c) Matryoshka: nDCG@10 per dimension")
    curves = [
        (row, curve)
        for row in ("student_before", "student_after")
        if (curve := (results.get(row) or {}).get("matryoshka_ndcg@10"))
    ]
    if not curves:
        reason = " (projection mode)" if results.get("mode") == "projection" else " in this run"
        _no_data(axes, f"no Matryoshka evaluation{reason}")
        return
    dims: set[int] = set()
    for row, curve in curves:
        points = sorted((int(dim), value) for dim, value in curve.items())  # JSON keys are strings
        dims.update(dim for dim, _ in points)
        after = row == "student_after"
        axes.plot(
            [d for d, _ in points],
            [v for _, v in points],
            marker="o",
            linestyle="-" if after else "--",
            color="C3" if after else "C1",
            alpha=1.0 if after else 0.6,
            label=ROW_LABELS[row],
        )
        if after:
            for dim, value in points:
                axes.annotate(f"{value:.3f}", (dim, value), xytext=(0, 7), textcoords="offset points", ha="center")
    teacher = (results.get("teacher") or {}).get("ndcg@10")
    if teacher is not None:
        axes.axhline(teacher, color="C0", linestyle="--", linewidth=1.2, label=f"teacher ({teacher:.3f})")
    axes.set_xscale("log", base=2)
    axes.set_xticks(sorted(dims), [str(d) for d in sorted(dims)])
    axes.minorticks_off()
    axes.set_xlabel("embedding dimension (first d coordinates)")
    axes.set_ylabel("nDCG@10")
    axes.margins(x=0.08, y=0.15)  # room for the value labels at the first and last dimension
    axes.grid(alpha=0.3)
    axes.legend(loc="lower right", fontsize=9)


FORM_COLOR = "C4"  # the served forms (ONNX float32, int8) on the quality-speed plot


def _plot_trade_off(axes: Axes, results: dict) -> None:
    """nDCG@10 against texts/s on the measuring device: what the student keeps, and what it gains in speed."""
    axes.set_title("(d) quality against encoding speed")
    efficiency = results.get("efficiency") or {}
    student = efficiency.get("student")
    points = []  # (label, texts/s, nDCG@10, color)
    teacher_cost, teacher_score = efficiency.get("teacher"), (results.get("teacher") or {}).get("ndcg@10")
    if teacher_cost and teacher_score is not None:
        points.append(("teacher", teacher_cost["texts_per_second"], teacher_score, "C0"))
    if student:
        for row, color in (("student_before", "C1"), ("student_after", "C3")):
            score = (results.get(row) or {}).get("ndcg@10")
            if score is not None:
                points.append((ROW_LABELS[row], student["texts_per_second"], score, color))
        widths = (results.get("student_after") or {}).get("matryoshka_ndcg@10") or {}
        for dim, score in sorted(((int(d), v) for d, v in widths.items()), reverse=True):
            if dim != student["dim"]:
                points.append((f"first {dim} dims", student["texts_per_second"], score, "C2"))
        for form in efficiency.get("forms") or []:  # the served forms: ONNX float32 and int8
            if form.get("ndcg") is not None:
                points.append((form["name"], form["texts_per_second"], form["ndcg"], FORM_COLOR))
    if not points:
        _no_data(axes, "no cost measured (--efficiency_texts 0)" if not student else "no evaluation set")
        return
    for label, speed, score, color in points:
        axes.scatter([speed], [score], s=60, color=color, zorder=3)
        above = color == FORM_COLOR  # a served form sits on or beside the PyTorch student: its label goes over it
        offset = (7, 8) if above else (7, -3)
        axes.annotate(f"{label} ({score:.3f})", (speed, score), xytext=offset, textcoords="offset points", fontsize=9)
    speeds = [speed for _, speed, _, _ in points]
    axes.set_xlim(0, max(speeds) * 1.6)  # room for the labels at the right of the fastest points
    axes.margins(y=0.15)
    axes.set_xlabel(f"texts/s, batch {efficiency.get('batch_size')}, on {efficiency.get('device', '?')}", fontsize=9)
    axes.set_ylabel("nDCG@10")
    axes.grid(alpha=0.3)
