"""bench/read_corpus.py on a small corpus: it keeps the asked texts, measures a child's peak and a clean cache."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import read_corpus


def test_a_capped_read_keeps_what_it_asks_and_leaves_no_cache(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus.jsonl"
    rows = read_corpus.write_corpus(corpus, 1)
    lines = corpus.read_text().splitlines()
    assert len(lines) == rows and 1_000_000 <= corpus.stat().st_size < 1_000_200
    assert json.loads(lines[-1])["text"].startswith(f"sentence {rows - 1} ")
    kept, seconds, peak, left = read_corpus.read(corpus, 500, tmp_path / "cache")
    assert kept == 500 and seconds > 0 and peak > 50 * 2**20 and left == 0  # streamed: nothing converted
