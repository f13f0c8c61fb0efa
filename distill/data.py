"""Load and clean the texts of both phases and the evaluation set, from the Hub, local files or the embedded corpus.

Phase 1 needs texts; phase 2 needs (query, passage) pairs with optional hard negatives; evaluation needs
held-out queries with one relevant passage each in a corpus, and optionally scored pairs for STS.
Bad rows (empty, whitespace-only, non-string) are dropped with a count; exact duplicates are dropped;
a phase left with nothing is an error that says why.
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from accelerate.logging import get_logger

from distill import embedded
from distill.config import DataConfig
from distill.errors import DistillError

logger = get_logger(__name__)

EMBEDDED = "embedded"
LOCAL_FORMATS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet", ".txt": "text"}
TEXT_COLUMNS = ("text", "sentence", "sentences", "passage", "content", "document", "anchor")
QUERY_COLUMNS = ("query", "question", "anchor", "queries")
PASSAGE_COLUMNS = ("passage", "positive", "answer", "document", "pos", "context", "text")


@dataclass
class Pairs:
    """Phase-2 training pairs; `negatives[i]` are hard negatives of query i (same count for every query)."""

    queries: list[str]
    passages: list[str]
    negatives: list[list[str]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.queries)


@dataclass
class EvalSet:
    """Held-out retrieval (query i is relevant to corpus[relevant[i]]) and optional STS pairs."""

    queries: list[str]
    corpus: list[str]
    relevant: list[int]
    sts_texts: list[str] = field(default_factory=list)
    sts_pairs: list[tuple[int, int]] = field(default_factory=list)
    sts_scores: list[float] = field(default_factory=list)


@dataclass
class DistillData:
    phase1_texts: list[str]
    phase2: Pairs
    evaluation: EvalSet | None


def load_data(config: DataConfig, seed: int, need_phase1: bool = True, need_phase2: bool = True) -> DistillData:
    """Everything the run trains and evaluates on, cleaned and capped."""
    phase1 = (
        load_phase1_texts(config.phase1_data, config.max_samples_phase1, config.embedded_lee_background)
        if need_phase1
        else []
    )
    holdout = 0
    if config.eval_data == "auto" and config.phase2_data != EMBEDDED:
        holdout = config.max_eval_queries
    phase2 = (
        load_pairs(config.phase2_data, config.max_samples_phase2 + holdout, seed, config.embedded_pairs_per_paragraph)
        if need_phase2 or holdout
        else Pairs([], [])
    )
    evaluation = None
    if config.eval_data == EMBEDDED or (config.eval_data == "auto" and config.phase2_data == EMBEDDED):
        evaluation = embedded_eval_set(seed, config.max_eval_queries)
    elif config.eval_data == "auto":
        phase2, evaluation = hold_out(phase2, holdout, seed)
        evaluation.sts_texts, evaluation.sts_pairs, evaluation.sts_scores = optional_lee_sts()
    elif config.eval_data != "none":
        raise DistillError(f"eval_data: expected 'auto', 'embedded' or 'none', got {config.eval_data!r}")
    if not need_phase2:
        phase2 = Pairs([], [])
    elif len(phase2) > config.max_samples_phase2:
        phase2 = Pairs(*(column[: config.max_samples_phase2] for column in _columns(phase2)))
    return DistillData(phase1, phase2, evaluation)


def load_phase1_texts(source: str, max_samples: int, lee_background: bool = False) -> list[str]:
    if source == EMBEDDED:
        texts = embedded.wikipedia_sentences(embedded.train_articles())
        if lee_background:
            wikipedia = len(_normalized_unique(texts)[0])  # counted here, cleaned once with the Lee sentences below
            if max_samples <= wikipedia:
                raise DistillError(
                    f"embedded_lee_background: max_samples_phase1 {max_samples} is not above the {wikipedia} "
                    "embedded Wikipedia sentences, which come first, so no Lee background sentence would be "
                    f"trained on; raise --max_samples_phase1 above {wikipedia} or drop --embedded_lee_background"
                )
            texts = texts + embedded.lee_background()
    else:
        records = read_records(source, max_samples)
        column = pick_column(records, TEXT_COLUMNS, source, "phase-1 text", allow_single=True)
        texts = [r.get(column) for r in records]
    texts = clean_texts(texts, f"phase-1 data {source!r}")
    if not texts:
        raise DistillError(
            f"phase-1 data {source!r} has no usable text after dropping empty and non-string rows; "
            "give a file with non-empty texts or pass --skip_phase1"
        )
    return texts[:max_samples]


def load_pairs(source: str, max_samples: int, seed: int, embedded_per_paragraph: int = 1) -> Pairs:
    if source == EMBEDDED:
        queries, passages = embedded.inverse_cloze_pairs(embedded.train_articles(), seed, embedded_per_paragraph)
        return _clean_pairs(Pairs(queries, passages), source)
    records = read_records(source, max_samples)
    query_col = pick_column(records, QUERY_COLUMNS, source, "phase-2 query")
    passage_col = pick_column(records, tuple(c for c in PASSAGE_COLUMNS if c != query_col), source, "phase-2 passage")
    negative_cols = sorted(c for c in records[0] if c.startswith("negative"))
    negatives: list[list[Any]] = []
    if len(negative_cols) == 1 and isinstance(records[0][negative_cols[0]], list):
        lists = [r.get(negative_cols[0]) or [] for r in records]
        count = min(len(n) for n in lists)
        negatives = [list(n[:count]) for n in lists] if count else []
    elif negative_cols:
        negatives = [[r.get(c) for c in negative_cols] for r in records]
    pairs = Pairs([r.get(query_col) for r in records], [r.get(passage_col) for r in records], negatives)
    return _clean_pairs(pairs, source)


def _columns(pairs: Pairs) -> tuple[list, list, list]:
    return pairs.queries, pairs.passages, pairs.negatives


def _clean_pairs(pairs: Pairs, source: str) -> Pairs:
    """Drop pairs whose query, passage or any negative is not a non-empty string, and duplicate pairs."""
    kept, seen, bad, duplicates = [], set(), 0, 0
    for i in range(len(pairs)):
        row = [pairs.queries[i], pairs.passages[i], *(pairs.negatives[i] if pairs.negatives else [])]
        if not all(isinstance(t, str) and t.strip() for t in row):
            bad += 1
            continue
        row = [" ".join(t.split()) for t in row]
        key = (row[0], row[1])  # after whitespace cleanup, as clean_texts compares texts
        if key in seen:
            duplicates += 1
            continue
        seen.add(key)
        kept.append(row)
    _report_dropped(f"phase-2 data {source!r}", bad, duplicates, len(kept))
    if not kept:
        raise DistillError(
            f"phase-2 data {source!r} has no usable (query, passage) pair after dropping empty and non-string "
            "rows; give pairs of non-empty strings or pass --skip_phase2"
        )
    return Pairs([r[0] for r in kept], [r[1] for r in kept], [r[2:] for r in kept] if pairs.negatives else [])


def clean_texts(texts: Iterable[Any], what: str) -> list[str]:
    """Non-empty strings, whitespace collapsed, exact duplicates dropped; counts of what was dropped are logged."""
    kept, bad, duplicates = _normalized_unique(texts)
    _report_dropped(what, bad, duplicates, len(kept))
    return kept


def _normalized_unique(texts: Iterable[Any]) -> tuple[list[str], int, int]:
    """Non-empty strings with whitespace collapsed, first occurrence of each; the counts of empty rows and repeats."""
    kept, seen, bad, duplicates = [], set(), 0, 0
    for text in texts:
        if not isinstance(text, str) or not text.strip():
            bad += 1
            continue
        text = " ".join(text.split())
        if text in seen:
            duplicates += 1
            continue
        seen.add(text)
        kept.append(text)
    return kept, bad, duplicates


def _report_dropped(what: str, bad: int, duplicates: int, kept: int) -> None:
    if bad or duplicates:
        logger.warning(
            f"{what}: dropped {bad} empty or non-string rows and {duplicates} duplicates; {kept} remain",
            main_process_only=True,
        )


def read_records(source: str, max_rows: int | None = None) -> list[dict[str, Any]]:
    """Rows of a local file (.jsonl/.json/.csv/.parquet/.txt) or a Hub dataset's train split, as dicts."""
    path = Path(source).expanduser()
    looks_local = path.suffix.lower() in LOCAL_FORMATS or source.startswith((".", "/", "~"))
    if looks_local and not path.is_file():
        raise DistillError(
            f"data file {source!r} does not exist; pass an existing .jsonl/.json/.csv/.parquet/.txt file, "
            "a Hub dataset name, or 'embedded'"
        )
    if path.is_file():
        fmt = LOCAL_FORMATS.get(path.suffix.lower())
        if fmt is None:
            raise DistillError(
                f"data file {source!r} has an unsupported extension {path.suffix!r}; "
                f"use one of {', '.join(LOCAL_FORMATS)}"
            )
        if fmt == "text":
            lines = path.read_text(encoding="utf8").splitlines()
            return [{"text": line} for line in lines[:max_rows]]
        dataset = _load_dataset(fmt, source, data_files=str(path))
    else:
        dataset = _load_dataset(source, source)
    if max_rows is not None and len(dataset) > max_rows:
        dataset = dataset.select(range(max_rows))
    if len(dataset) == 0:
        raise DistillError(f"data {source!r} has no rows; give a file or dataset with at least one row")
    return dataset.to_list()


def _load_dataset(name: str, source: str, **kwargs: Any):  # noqa: ANN202 - datasets.Dataset
    import datasets

    datasets.disable_progress_bars()
    try:
        return datasets.load_dataset(name, split="train", **kwargs)
    except (FileNotFoundError, ConnectionError, OSError, ValueError) as e:
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DistillError(
            f"data {source!r} could not be loaded ({first_line[:200]}); pass a local "
            ".jsonl/.json/.csv/.parquet/.txt file or 'embedded' when the Hub is not reachable"
        ) from None


def pick_column(
    records: list[dict[str, Any]], candidates: tuple[str, ...], source: str, role: str, allow_single: bool = False
) -> str:
    """The first candidate column present; for texts, also the only string column if there is exactly one."""
    columns = list(records[0])
    for name in candidates:
        if name in columns:
            return name
    if allow_single:
        strings = [c for c in columns if isinstance(records[0][c], str)]
        if len(strings) == 1:
            return strings[0]
    raise DistillError(
        f"data {source!r} has no {role} column: expected one of {', '.join(candidates)}, "
        f"found {', '.join(columns) or 'none'}; rename the column"
    )


def hold_out(pairs: Pairs, count: int, seed: int) -> tuple[Pairs, EvalSet]:
    """Move `count` seeded-random pairs (at most a tenth) out of training into a retrieval evaluation set."""
    count = min(count, len(pairs) // 10)
    if count == 0:
        raise DistillError(
            f"phase-2 data has {len(pairs)} pairs, too few to hold out evaluation queries; "
            "give at least 10 pairs, or pass --eval_data embedded or --eval_data none"
        )
    order = list(range(len(pairs)))
    random.Random(seed).shuffle(order)
    held, train = set(order[:count]), order[count:]
    train.sort()
    evaluation = EvalSet(
        queries=[pairs.queries[i] for i in sorted(held)],
        corpus=[pairs.passages[i] for i in sorted(held)],
        relevant=list(range(count)),
    )
    negatives = [pairs.negatives[i] for i in train] if pairs.negatives else []
    return Pairs([pairs.queries[i] for i in train], [pairs.passages[i] for i in train], negatives), evaluation


def embedded_eval_set(seed: int, max_queries: int) -> EvalSet:
    """Inverse-cloze retrieval over the held-out Wikipedia articles, plus Lee STS."""
    queries, corpus = embedded.inverse_cloze_pairs(embedded.eval_articles(), seed)
    chosen = sorted(random.Random(seed).sample(range(len(queries)), min(max_queries, len(queries))))
    sts_texts, sts_pairs, sts_scores = embedded.lee_sts()
    return EvalSet([queries[i] for i in chosen], corpus, chosen, sts_texts, sts_pairs, sts_scores)


def optional_lee_sts() -> tuple[list[str], list[tuple[int, int]], list[float]]:
    """Lee STS when gensim is installed, else nothing (STS is then left out of the results)."""
    try:
        return embedded.lee_sts()
    except DistillError:
        return [], [], []
