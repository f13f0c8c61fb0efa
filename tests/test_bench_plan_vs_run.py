"""bench/plan_vs_run.py on a tiny config: it plans, runs from a cold cache, and writes its table into a page."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import plan_vs_run


def test_the_table_puts_each_planned_figure_beside_the_measured_one(tiny_models, tiny_data, tmp_path, monkeypatch):
    config = tmp_path / "tiny.yaml"
    settings = {
        "teacher_model": str(tiny_models["teacher"]),
        "student_model": str(tiny_models["student"]),
        "phase1_data": str(tiny_data["texts"]),
        "phase2_data": str(tiny_data["pairs"]),
        "max_eval_queries": 16,
        "batch_size": 8,
        "max_seq_length": 32,
        "efficiency_texts": 0,
    }
    config.write_text(yaml.safe_dump(settings))
    page = tmp_path / "BENCHMARKS.md"
    page.write_text("# Benchmarks\n\n## By hand\n")
    argv = ["--configs", str(config), "--checkpoint_steps", "20", "--workdir", str(tmp_path / "work")]
    assert plan_vs_run.main([*argv, "--write", str(page)]) == 0
    table = [line for line in page.read_text().splitlines() if line.startswith(f"| `{config}` |")]
    assert [line.split(" | ")[1] for line in table] == [
        "teacher seconds (cold cache, every text)",
        "training seconds (the phases' loops)",
        "peak memory (planner: the larger stage; run: peak RSS)",
        "teacher cache on disk",
        "one checkpoint on disk",
    ]
    cache, checkpoint = (line.split(" | ")[4] for line in table[3:])
    assert 0.9 <= float(cache) <= 1.1  # sizes the planner counts exactly
    assert 0.9 <= float(checkpoint) <= 1.1
    assert "<!-- bench:plan:begin -->" in page.read_text()
    # --reuse_runs plans again and takes the runs' figures from the workdir: no run starts
    measured = (tmp_path / "work" / "0" / "measured.json").read_text()
    monkeypatch.setattr(plan_vs_run, "run_process", lambda *a, **k: pytest.fail("--reuse_runs ran the config again"))
    assert plan_vs_run.main([*argv, "--write", str(page), "--reuse_runs"]) == 0
    again = [line for line in page.read_text().splitlines() if line.startswith(f"| `{config}` |")]
    assert [line.split(" | ")[3] for line in again] == [line.split(" | ")[3] for line in table]  # the same runs
    assert "The runs' figures are those measured by " in page.read_text()
    assert (tmp_path / "work" / "0" / "measured.json").read_text() == measured
    # the same file name with other settings in it is run again, not read back (the run stopped as it starts)
    config.write_text(yaml.safe_dump({**settings, "batch_size": 4}))

    class RunAgain(Exception):
        pass

    def run_again(command: list[str], *args: object, **kwargs: object) -> None:
        raise RunAgain(" ".join(map(str, command)))

    monkeypatch.setattr(plan_vs_run, "plan", lambda *args: {})
    monkeypatch.setattr(plan_vs_run, "run_process", run_again)
    with pytest.raises(RunAgain, match="-m distill.train --config"):
        plan_vs_run.main([*argv, "--reuse_runs"])
