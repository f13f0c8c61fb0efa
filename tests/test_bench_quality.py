"""bench/quality.py's verdict: a paired bootstrap over the queries both students answered."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import quality


def test_a_consistent_gain_is_a_win_and_noise_is_a_tie() -> None:
    rng = np.random.default_rng(0)
    theirs = rng.integers(-1, 10, size=800).tolist()
    # distill moves one query in four up by one place (or into the top 10): higher, and the interval says so
    ours = [
        max(r - 1, 0) if r != -1 and i % 4 == 0 else (9 if r == -1 and i % 4 == 0 else r) for i, r in enumerate(theirs)
    ]
    win = quality.paired_difference(ours, theirs)
    assert win["worse"] == 0 and win["better"] > 0 and 0 < win["low"] <= win["mean"] <= win["high"]
    assert quality.verdict(win).startswith("distill higher")
    # the same ranks shuffled between queries: the two means match, the per-query differences are noise
    shuffled = rng.permutation(theirs).tolist()
    tie = quality.paired_difference(shuffled, theirs)
    assert tie["mean"] == pytest.approx(0.0) and tie["low"] < 0 < tie["high"]
    assert quality.verdict(tie).startswith("a tie")
    assert quality.verdict(quality.paired_difference(theirs, ours)).startswith("distill NOT higher")
    with pytest.raises(ValueError, match="same queries on both sides"):
        quality.paired_difference(ours[:10], theirs)


def test_pooling_concatenates_the_runs_queries(tmp_path: Path) -> None:
    runs = []
    for seed, (ours, theirs) in enumerate((([0, 0, 1, -1], [1, 0, 1, -1]), ([0, 2, 3, 4], [0, 3, 3, 9]))):
        run = tmp_path / f"seed{seed}"
        for side, ranks in (("toolkit", ours), ("peer", theirs)):
            (run / side).mkdir(parents=True)
            after = {"ndcg@10": float(np.mean([r >= 0 for r in ranks])), "ranks@10": ranks}
            (run / side / "results.json").write_text(json.dumps({"student_after": after, "config": {"seed": seed}}))
        runs.append(str(run))
    text = quality.pooled_section("pooled", runs, "python bench/quality.py --pool ...")
    pooled = quality.paired_difference([0, 0, 1, -1, 0, 2, 3, 4], [1, 0, 1, -1, 0, 3, 3, 9])
    assert f"**{pooled['mean']:+.4f}**" in text and "| 3 / 0 |" in text  # 1 + 2 queries higher, none lower
    (tmp_path / "seed1" / "peer" / "results.json").write_text(json.dumps({"student_after": {"ndcg@10": 0.5}}))
    with pytest.raises(SystemExit, match="per-query ranks"):
        quality.pooled_section("pooled", runs, "")


def test_paired_runs_table_per_seed_and_pooled(tmp_path: Path) -> None:
    import paired

    def run(name: str, seed: int, ranks: list[int]) -> str:
        out = tmp_path / name
        out.mkdir()
        after = {"ndcg@10": float(np.mean([r >= 0 for r in ranks])), "ranks@10": ranks}
        (out / "results.json").write_text(json.dumps({"student_after": after, "config": {"seed": seed}}))
        return str(out)

    pairs = [
        f"{run('base1', 1, [0, 1, 5, -1])}:{run('change1', 1, [0, 0, 2, -1])}",
        f"{run('base2', 2, [3, 0, -1])}:{run('change2', 2, [3, 1, -1])}",
    ]
    text = paired.table(pairs)
    first = quality.paired_difference([0, 0, 2, -1], [0, 1, 5, -1])
    pooled = quality.paired_difference([0, 0, 2, -1, 3, 1, -1], [0, 1, 5, -1, 3, 0, -1])
    assert f"| {first['mean']:+.4f} |" in text and "| 2 / 0 |" in text  # seed 1: two queries rose, none fell
    assert f"**{pooled['mean']:+.4f}**" in text and "| 2 / 1 |" in text
    with pytest.raises(SystemExit, match="seeds 1 and 2"):
        paired.table([f"{tmp_path / 'base1'}:{tmp_path / 'change2'}"])
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "results.json").write_text(json.dumps({"student_after": {"ndcg@10": 0.5}, "config": {}}))
    with pytest.raises(SystemExit, match="per-query ranks"):
        paired.table([f"{tmp_path / 'old'}:{tmp_path / 'change1'}"])
    with pytest.raises(SystemExit, match="BASE_DIR:CHANGED_DIR"):
        paired.table([str(tmp_path / "base1")])


def test_paired_compares_two_evaluations_of_one_run(tmp_path: Path) -> None:
    """DIR@after_phase1:DIR is what the run's phase 2 added, on the same queries."""
    import paired

    out = tmp_path / "run"
    out.mkdir()
    phase1, final = {"ndcg@10": 0.4, "ranks@10": [2, 5, -1, 0]}, {"ndcg@10": 0.6, "ranks@10": [0, 1, -1, 0]}
    results = {"after_phase1": phase1, "student_after": final, "config": {"seed": 7}}
    (out / "results.json").write_text(json.dumps(results))
    text = paired.table([f"{out}@after_phase1:{out}"])
    gain = quality.paired_difference(final["ranks@10"], phase1["ranks@10"])
    assert f"| 0.4000 | 0.6000 | {gain['mean']:+.4f} |" in text and "| 2 / 0 |" in text
    with pytest.raises(SystemExit, match="STAGE one of student_after, after_phase1, student_before"):
        paired.table([f"{out}@phase3:{out}"])
    del results["after_phase1"]
    (out / "results.json").write_text(json.dumps(results))
    with pytest.raises(SystemExit, match="has no after_phase1 evaluation"):
        paired.table([f"{out}@after_phase1:{out}"])


def test_section_names_the_phases_the_toolkit_trained() -> None:
    metrics = {"ndcg@10": 0.5, "mrr@10": 0.4, "ranks@10": [0, 1, -1, 2]}
    peer = {
        "recipe": "SentenceTransformerTrainer + losses.MSELoss",
        "student_after": {"ndcg@10": 0.45, "mrr@10": 0.4, "ranks@10": [1, 1, -1, 3]},
        "train_seconds": 10.0,
        "train_samples": 64,
        "texts_available": 100,
        "lr": 1e-4,
        "budget_s": 10.0,
        "stopped_by_budget": True,
    }

    def text(phases: dict) -> str:
        toolkit = {
            "mode": "matryoshka",
            "teacher": metrics,
            "student_before": metrics,
            "student_after": metrics,
            "phases": {p: {"train_seconds": 5.0, "train_samples": 32} for p in phases},
        }
        return quality.section("x", toolkit, [peer], "python bench/quality.py", 12.0)

    both, first = text(["phase1", "phase2"]), text(["phase1"])
    assert "**distill** (two phases)" in both and "(phase-1 texts + phase-2 queries + passages," in both
    assert "**distill** (phase 1 only)" in first and "(phase-1 texts, labels" in first and "phase-2" not in first
    assert "| 5.000 | 32 |" in first and "| 10.000 | 64 |" in both  # the toolkit row: its one phase; the peer row
    assert "lr 0.0001 (warm-up and linear decay laid out over the full epochs)" in first
    peer["schedule_steps"] = 227  # --peer_max_steps: the decay fits the steps the budget allows
    assert "lr 0.0001 (warm-up and linear decay over 227 steps)" in text(["phase1"])
