"""The data's types: what the data stage gives the run. A leaf: it imports no other distill module.

Phase 1 trains on texts; phase 2 on (query, passage) pairs with optional hard negatives; evaluation ranks held-out
queries against a corpus, and optionally scores STS pairs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np


@dataclass
class Pairs:
    """Phase-2 training pairs; `negatives[i]` are hard negatives of query i (same count for every query).

    `candidates`, where the data is kept as one column (distill/data/kept.py): the positives, then every query's
    negatives, as `passage_texts` lists them.
    """

    queries: Sequence[str]
    passages: Sequence[str]
    negatives: Sequence[list[str]] = field(default_factory=list)
    candidates: Sequence[str] | None = None

    def __len__(self) -> int:
        return len(self.queries)


@dataclass
class EvalGroup:
    """One benchmark dataset inside an evaluation set: its rows, and each query's relevant corpus rows.

    `relevant[i]` holds the rows, counted from the group's first corpus row, that judge query `queries[i]` relevant.
    """

    name: str
    queries: range
    corpus: range
    relevant: list[set[int]]


@dataclass
class EvalSet:
    """Held-out retrieval (query i is relevant to corpus[relevant[i]]) and optional STS pairs.

    A benchmark of several datasets (NanoBEIR) has `groups`: each query is ranked against its own dataset's
    corpus, and `relevant` is unused.
    """

    queries: list[str]
    corpus: list[str]
    relevant: list[int]
    sts_texts: list[str] = field(default_factory=list)
    sts_pairs: list[tuple[int, int]] = field(default_factory=list)
    sts_scores: list[float] = field(default_factory=list)
    groups: list[EvalGroup] = field(default_factory=list)


@dataclass
class EvalVectors:
    """Unit vectors of an `EvalSet`'s texts in one space (the teacher's, or the student's)."""

    queries: np.ndarray
    corpus: np.ndarray
    sts: np.ndarray | None


@dataclass
class DistillData:
    phase1_texts: Sequence[str]
    phase2: Pairs
    evaluation: EvalSet | None
    capped: dict[str, int] = field(default_factory=dict)  # the caps the data reached: option name -> the cap
    stamps: dict[str, str] = field(default_factory=dict)  # each source read -> a digest of its files or commit


def passage_texts(pairs: Pairs) -> tuple[Sequence[str], np.ndarray]:
    """Positives then all negatives, and for each query the rows of its positive and its negatives."""
    count, per_query = len(pairs), len(pairs.negatives[0]) if pairs.negatives else 0
    texts = pairs.candidates
    if texts is None:
        texts = list(pairs.passages) + [n for negatives in pairs.negatives for n in negatives]
    rows = np.arange(count)[:, None]
    if per_query:
        rows = np.concatenate([rows, count + np.arange(count * per_query).reshape(count, per_query)], axis=1)
    return texts, rows


def pick(texts: Sequence[str], rows: Sequence[int] | np.ndarray) -> list[str]:
    """`[texts[i] for i in rows]`, gathered at once where the texts can (a kept column's `pick`)."""
    gather = getattr(texts, "pick", None)
    if gather is not None:
        return gather(rows)
    return [texts[i] for i in rows]
