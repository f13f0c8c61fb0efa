"""Paired comparison of finished distill runs: one change against its base, query by query.

    python bench/paired.py runs/base_s42:runs/change_s42 runs/base_s1:runs/change_s1 ...

Each argument is BASE:CHANGED, the output_dirs of two runs with the same seed (so the same evaluation queries).
A side may name one of its run's evaluations as DIR@STAGE (after_phase1, student_before, teacher; student_after
when none is named): `runs/x@after_phase1:runs/x` is what the run's phase 2 added, `runs/x@teacher:runs/x` how the
student stands against its teacher.
For each pair it prints the change's nDCG@10 difference with a 95% paired-bootstrap interval over the queries
(bench/quality.py's `paired_difference`), and with several pairs one interval over all their queries. On the
demo's 867 queries two distill variants' interval on one seed was about +-0.0025 to +-0.0043 wide (docs/QUALITY.md),
narrower than distill against the peer (+-0.0085): two runs of one recipe rank queries alike.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from quality import paired_cells, paired_difference

STAGES = ("student_after", "after_phase1", "student_before", "teacher")


def load(side: str) -> tuple[dict, dict]:
    """The run's results and the evaluation `side` names (DIR or DIR@STAGE)."""
    run, _, stage = side.partition("@")
    stage = stage or "student_after"
    if stage not in STAGES:
        raise SystemExit(f"{side}: expected DIR or DIR@STAGE with STAGE one of {', '.join(STAGES)}")
    path = Path(run) / "results.json"
    if not path.is_file():
        raise SystemExit(f"{run}: expected a finished distill run (its results.json); check the output_dir")
    results = json.loads(path.read_text())
    if stage not in results:
        raise SystemExit(f"{side}: the run has no {stage} evaluation (a one-phase run has no after_phase1)")
    if "ranks@10" not in results[stage]:
        raise SystemExit(f"{run}: expected per-query ranks (ranks@10) in results.json; re-run it with this version")
    return results, results[stage]


def reading(paired: dict[str, float]) -> str:
    if paired["low"] > 0:
        return "higher"
    if paired["high"] < 0:
        return "lower"
    return "a tie (the interval holds 0)"


def table(pairs: list[str]) -> str:
    lines = [
        "| base | changed | seed | base nDCG@10 | changed nDCG@10 | Δ | 95% CI | queries higher / lower | reading |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    base_ranks: list[int] = []
    changed_ranks: list[int] = []
    for pair in pairs:
        if pair.count(":") != 1:
            raise SystemExit(f"expected BASE_DIR:CHANGED_DIR, got {pair!r}")
        base_dir, changed_dir = pair.split(":")
        (base, b), (changed, a) = load(base_dir), load(changed_dir)
        seeds = base["config"].get("seed"), changed["config"].get("seed")
        if seeds[0] != seeds[1]:
            raise SystemExit(f"{pair}: the runs have seeds {seeds[0]} and {seeds[1]}; pair runs of the same seed")
        paired = paired_difference(a["ranks@10"], b["ranks@10"])
        changed_ranks += a["ranks@10"]
        base_ranks += b["ranks@10"]
        lines.append(
            f"| {base_dir} | {changed_dir} | {seeds[0]} | {b['ndcg@10']:.4f} | {a['ndcg@10']:.4f} "
            f"| {paired_cells(paired)} | {reading(paired)} |"
        )
    if len(pairs) > 1:
        paired = paired_difference(changed_ranks, base_ranks)
        lines.append(f"| **pooled** | | | | | {paired_cells(paired, bold=True)} | {reading(paired)} |")
    return "\n".join(lines)


def main() -> int:
    if len(sys.argv) < 2:
        raise SystemExit(__doc__.strip().splitlines()[2].strip())
    print(table(sys.argv[1:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
