"""Markdown table of the ablation runs: every <runs_dir>/<name>/results.json, with what its config changed.

python bench/ablation_table.py runs/quality mrl_short_base mrl_short_kl0 ...
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def row(name: str, results: dict, base: dict | None) -> str:
    teacher = results["teacher"]["ndcg@10"]
    after = results["student_after"]
    changed = ""
    if base is not None:
        diffs = {k: v for k, v in results["config"].items() if base["config"].get(k) != v and k != "output_dir"}
        changed = ", ".join(f"{k}={v}" for k, v in diffs.items()) or "(base)"
    mrl = after.get("matryoshka_ndcg@10") or {}
    half = ""
    if mrl:
        full = max(int(d) for d in mrl)
        h = str(full // 2)
        half = f"{mrl[h]:.3f} ({100 * mrl[h] / mrl[str(full)]:.1f}%)" if h in mrl else "–"
    asym = after.get("ndcg@10_asymmetric")
    own = after.get("ndcg@10_student_dim")
    seconds = sum(p["train_seconds"] for p in results["phases"].values())
    return (
        f"| {name} | {changed} | {teacher:.3f} | {results['student_before']['ndcg@10']:.3f} "
        f"| {results.get('after_phase1', {}).get('ndcg@10', float('nan')):.3f} | **{after['ndcg@10']:.3f}** "
        f"| {100 * after['ndcg@10'] / teacher:.1f}% | {half or '–'} | {f'{own:.3f}' if own is not None else '–'} "
        f"| {f'{asym:.3f}' if asym is not None else '–'} | {after.get('sts_spearman', float('nan')):.3f} "
        f"| {seconds:.0f} |"
    )


def main() -> int:
    runs, names = Path(sys.argv[1]), sys.argv[2:]
    loaded = {
        n: json.loads((runs / n / "results.json").read_text()) for n in names if (runs / n / "results.json").exists()
    }
    base = next(iter(loaded.values()), None)
    print(
        "| run | change vs first row | teacher | untrained | after phase 1 | after both | % of teacher "
        "| half-dim (% of full) | student-dim nDCG | asymmetric | STS | train s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, results in loaded.items():
        print(row(name, results, base))
    missing = [n for n in names if n not in loaded]
    if missing:
        print(f"\n(not finished: {', '.join(missing)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
