"""The data stage: the texts of both phases and the evaluation set, read (distill/records.py) and cleaned.

Phase 1 needs texts; phase 2 needs (query, passage) pairs with optional hard negatives; evaluation needs
held-out queries with one relevant passage each in a corpus, and optionally scored pairs for STS.
Bad rows (empty, whitespace-only, non-string) are dropped with a count; exact duplicates are dropped;
`max_samples` counts the texts (pairs) kept, so a source is read in chunks until that many are usable; without
it a source is read whole. A cap the source reaches is said in one line, and kept in `DistillData.capped` for
results.json. A phase left with nothing is an error that says why.
"""

from __future__ import annotations

import logging
import random
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from itertools import chain
from typing import TYPE_CHECKING, Any

import numpy as np
from accelerate.logging import get_logger

from distill.config.schema import DataConfig
from distill.errors import DistillError, first_line
from distill.records import (
    EMBEDDED,
    PASSAGE_COLUMNS,
    QUERY_COLUMNS,
    TEXT_COLUMNS,
    _head_and_rest,
    first_item,
    pick_column,
    revision,
)

if TYPE_CHECKING:
    pass


logger = get_logger(__name__)


NANOBEIR = "nanobeir"


NANOBEIR_HUB = "sentence-transformers/NanoBEIR-en"  # sentence-transformers' NanoBEIREvaluator's default


# hard negatives: one text per column (negative, negative_1, neg_2, ...) or one list column (negatives, neg)
NEGATIVE_COLUMN = re.compile(r"(hard_)?(negative|negatives|neg)(_?(\d+))?$")


@dataclass
class Pairs:
    """Phase-2 training pairs; `negatives[i]` are hard negatives of query i (same count for every query).

    `candidates`, where the data is kept as one column (distill/prepared.py): the positives, then every query's
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


COLLECTORS: list[list[str]] = []  # what `warn` said inside each open `collected()` block


@contextmanager
def collected() -> Iterator[list[str]]:
    """The lines `warn` says inside the block, so that a run reading the data back can say them again."""
    said: list[str] = []
    COLLECTORS.append(said)
    try:
        yield said
    finally:
        COLLECTORS.remove(said)


def warn(message: str) -> None:
    """A warning from the main process; also where no Accelerate state exists (a Python caller of `load_data`),
    for which accelerate's logger has no rank to ask."""
    from accelerate.state import PartialState

    for said in COLLECTORS:
        said.append(message)
    if PartialState._shared_state:
        logger.warning(message, main_process_only=True)
    else:
        logging.getLogger(__name__).warning(message)


@dataclass
class DistillData:
    phase1_texts: Sequence[str]
    phase2: Pairs
    evaluation: EvalSet | None
    capped: dict[str, int] = field(default_factory=dict)  # the caps the data reached: option name -> the cap
    stamps: dict[str, str] = field(default_factory=dict)  # each source read -> a digest of its files or commit


def load_data(config: DataConfig, seed: int, need_phase1: bool = True, need_phase2: bool = True) -> DistillData:
    """Everything the run trains and evaluates on, cleaned and capped."""
    capped: dict[str, int] = {}
    phase1 = load_phase1_texts(config.phase1_data, config.max_samples_phase1, capped) if need_phase1 else []
    holdout = 0
    if config.eval_data == "auto" and config.phase2_data != EMBEDDED:
        holdout = config.max_eval_queries
    cap2 = None if config.max_samples_phase2 is None else config.max_samples_phase2 + holdout
    phase2 = load_pairs(config.phase2_data, cap2, seed, capped) if need_phase2 or holdout else Pairs([], [])
    evaluation = None
    if config.eval_data == EMBEDDED or (config.eval_data == "auto" and config.phase2_data == EMBEDDED):
        evaluation = embedded_eval_set(seed, config.max_eval_queries)
    elif config.eval_data == "auto":
        phase2, evaluation = hold_out(phase2, holdout, seed)
    elif config.eval_data.split(":", 1)[0] == NANOBEIR:
        evaluation = nanobeir_eval_set(config.eval_data, config.nanobeir_datasets)
    elif config.eval_data != "none":
        raise DistillError(
            f"eval_data: expected auto, embedded, nanobeir, nanobeir:DATASET or none, got {config.eval_data!r}"
        )
    if "max_samples_phase2" in capped and config.max_samples_phase2 is not None:
        capped["max_samples_phase2"] = config.max_samples_phase2  # the cap, not the cap plus the held-out queries
    if not need_phase2:
        phase2 = Pairs([], [])
        capped.pop("max_samples_phase2", None)  # read for the held-out queries only
    elif config.max_samples_phase2 is not None and len(phase2) > config.max_samples_phase2:
        cap = config.max_samples_phase2
        phase2 = Pairs(phase2.queries[:cap], phase2.passages[:cap], phase2.negatives[:cap])
    if "max_samples_phase2" in capped:
        besides = f", and {holdout:,} held out for evaluation" if holdout else ""
        what, cap = f"phase-2 data {config.phase2_data!r}", capped["max_samples_phase2"]
        report_cap(what, "pairs", "max_samples_phase2", cap, None, besides=besides)
    return DistillData(phase1, phase2, evaluation, capped)


def load_phase1_texts(source: str, max_samples: int | None, capped: dict[str, int] | None = None) -> list[str]:
    """Phase 1's texts from `source`, cleaned, at most `max_samples` (None: all); a cap reached goes into
    `capped`."""
    raw: Iterable[Any]
    if source == EMBEDDED:
        from distill import embedded  # the demo, loaded only when named

        raw = embedded.phase1_texts()
    else:
        head, rest = _head_and_rest(source)
        column = pick_column(head, TEXT_COLUMNS, source, "phase-1 text", allow_single=True)
        raw = (r.get(column) for r in chain(head, rest))
    texts = clean_texts(raw, f"phase-1 data {source!r}", limit=max_samples, capped=capped)
    if not texts:
        raise DistillError(
            f"phase-1 data {source!r} has no usable text after dropping empty and non-string rows; "
            "give a file with non-empty texts or pass --skip_phase1"
        )
    return texts


def load_pairs(source: str, max_samples: int | None, seed: int, capped: dict[str, int] | None = None) -> Pairs:
    if source == EMBEDDED:
        from distill import embedded  # the demo, loaded only when named

        queries, passages = embedded.phase2_pairs(seed)
        return _clean_pairs(((q, p, []) for q, p in zip(queries, passages, strict=True)), source, 0)
    head, rest = _head_and_rest(source)
    query_col = pick_column(head, QUERY_COLUMNS, source, "phase-2 query")
    passage_col = pick_column(head, tuple(c for c in PASSAGE_COLUMNS if c != query_col), source, "phase-2 passage")
    negatives_of, count = negative_reader(head, source, exclude=(query_col, passage_col))
    rows = ((r.get(query_col), first_item(r.get(passage_col)), negatives_of(r)) for r in chain(head, rest))
    return _clean_pairs(rows, source, count, limit=max_samples, capped=capped)


def negative_reader(
    head: list[dict[str, Any]], source: str, exclude: tuple[str, ...] = ()
) -> tuple[Callable[[dict[str, Any]], list[Any]], int]:
    """How to read a row's hard negatives, and how many each pair keeps (0: none).

    Either one list column (`negatives`, `neg`, ...: every pair keeps the count that at least 90% of the
    rows of the first chunk have, longer lists are cut, pairs with fewer are dropped with a count) or text
    columns `negative`, `negative_1`, `negative_2`, ... in the order of their numbers. Other columns
    (`negative_score`, ...) are not negatives.
    """
    named = [c for c in head[0] if c not in exclude and NEGATIVE_COLUMN.match(c)]
    lists = [c for c in named if any(isinstance(r.get(c), list) for r in head)]
    if len(lists) > 1:
        raise DistillError(
            f"data {source!r} has several hard-negative list columns ({', '.join(lists)}); keep one of them"
        )
    if lists:
        column = lists[0]
        lengths = sorted(len(r[column]) if isinstance(r.get(column), list) else 0 for r in head)
        count = lengths[len(lengths) // 10]  # what at least 90% of the rows have
        if count == 0 and lengths[-1] > 0:
            warn(
                f"phase-2 data {source!r}: over a tenth of the rows have no {column!r}, so no hard negatives are "
                "used; drop those rows to train with them",
            )
        return (lambda r: r.get(column) if isinstance(r.get(column), list) else []), count
    texts = sorted(named, key=lambda c: int(NEGATIVE_COLUMN.match(c).group(4) or 0))  # type: ignore[union-attr]
    return (lambda r: [r.get(c) for c in texts]), len(texts)


def _clean_pairs(
    rows: Iterable[tuple[Any, Any, list[Any]]],
    source: str,
    count: int,
    limit: int | None = None,
    capped: dict[str, int] | None = None,
) -> Pairs:
    """Drop pairs whose query, passage or any negative is not a non-empty string, and duplicate pairs.

    Every pair keeps `count` negatives: longer lists are cut, pairs with fewer are dropped. Stops once
    `limit` pairs are kept.
    """
    kept: list[list[str]] = []  # [query, passage, *negatives]
    seen: set[tuple[str, str]] = set()
    bad = duplicates = short = 0
    for query, passage, negatives in rows:
        if limit is not None and len(kept) >= limit:
            # said by `load_data`, which knows the cap apart from the held-out queries, and whether phase 2 trains
            report_cap(f"phase-2 data {source!r}", "pairs", "max_samples_phase2", limit, capped, say=capped is None)
            break
        if len(negatives) < count:
            short += 1
            continue
        row = [query, passage, *negatives[:count]]
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
    if short:
        warn(
            f"phase-2 data {source!r}: dropped {short} pairs with fewer than {count} hard negatives (the count "
            "at least 90% of the rows have); every pair of a batch needs the same number",
        )
    if not kept:
        raise DistillError(
            f"phase-2 data {source!r} has no usable (query, passage) pair after dropping empty and non-string "
            "rows; give pairs of non-empty strings or pass --skip_phase2"
        )
    return Pairs([r[0] for r in kept], [r[1] for r in kept], [r[2:] for r in kept] if count else [])


def clean_texts(
    texts: Iterable[Any], what: str, limit: int | None = None, capped: dict[str, int] | None = None
) -> list[str]:
    """Non-empty strings, whitespace collapsed, exact duplicates dropped; counts of what was dropped are logged.

    Stops reading `texts` once `limit` texts are kept, and says so if any were left (phase 1's cap, into `capped`).
    """
    kept, bad, duplicates, more = _normalized_unique(texts, limit)
    _report_dropped(what, bad, duplicates, len(kept))
    if more and limit is not None:
        report_cap(what, "texts", "max_samples_phase1", limit, capped)
    return kept


def report_cap(
    what: str, unit: str, option: str, limit: int, capped: dict[str, int] | None, say: bool = True, besides: str = ""
) -> None:
    """One line (with `say`): the source holds more than the cap let in, `besides` what else was read; recorded in
    `capped` too, where given."""
    if capped is not None:
        capped[option] = limit
    if say:
        warn(
            f"{what}: stopped reading at {limit:,} {unit} (--{option}){besides}; the source holds more: drop the "
            "option to train on all of them",
        )


def _normalized_unique(texts: Iterable[Any], limit: int | None = None) -> tuple[list[str], int, int, bool]:
    """Non-empty strings with whitespace collapsed, first occurrence of each; the counts of empty rows and repeats,
    and whether `limit` stopped the reading with texts left."""
    kept: list[str] = []
    seen: set[str] = set()
    bad = duplicates = 0
    for text in texts:
        if limit is not None and len(kept) >= limit:
            return kept, bad, duplicates, True
        if not isinstance(text, str) or not text.strip():
            bad += 1
            continue
        text = " ".join(text.split())
        if text in seen:
            duplicates += 1
            continue
        seen.add(text)
        kept.append(text)
    return kept, bad, duplicates, False


def _report_dropped(what: str, bad: int, duplicates: int, kept: int) -> None:
    if (bad or duplicates) and kept:  # none kept: the caller's error says so, as the run's one line
        warn(
            f"{what}: dropped {bad} empty or non-string rows and {duplicates} duplicates; {kept} remain",
        )


def hold_out(pairs: Pairs, count: int, seed: int) -> tuple[Pairs, EvalSet]:
    """Move `count` seeded-random pairs (at most a tenth) out of training into a retrieval evaluation set.

    The corpus holds each held-out passage once (two held-out queries with the same passage share it; a copy
    would tie with it and lower the score), and each held-out query has one pair (its other passages leave
    training with it, and stay out of the corpus, where they would count as misses). Training pairs that share
    any text with the held-out pairs (the same passage under another query, the same query, a held-out passage
    as a negative) are dropped too, with a count, so the student never trains toward the teacher's vector of an
    evaluation text.
    """
    count = min(count, len(pairs) // 10)
    if count == 0:
        raise DistillError(
            f"phase-2 data has {len(pairs)} pairs, too few to hold out evaluation queries; "
            "give at least 10 pairs, or pass --eval_data embedded or --eval_data none"
        )
    order = list(range(len(pairs)))
    random.Random(seed).shuffle(order)
    # one pair per query: a query held out with two passages would count either answer as a miss for the other
    held: list[int] = []
    held_queries: set[str] = set()
    for i in order:
        if len(held) == count:
            break
        if pairs.queries[i] not in held_queries:
            held_queries.add(pairs.queries[i])
            held.append(i)
    chosen = set(held)
    held = sorted(held)
    corpus = list(dict.fromkeys(pairs.passages[i] for i in held))
    position = {passage: i for i, passage in enumerate(corpus)}
    evaluation = EvalSet(
        queries=[pairs.queries[i] for i in held],
        corpus=corpus,
        relevant=[position[pairs.passages[i]] for i in held],
    )
    held_texts = set(evaluation.queries) | set(corpus)

    def shares_text(i: int) -> bool:
        row = [pairs.queries[i], pairs.passages[i], *(pairs.negatives[i] if pairs.negatives else [])]
        return any(text in held_texts for text in row)

    rest = [i for i in range(len(pairs)) if i not in chosen]
    train = [i for i in rest if not shares_text(i)]
    if len(train) < len(rest):
        warn(
            f"evaluation hold-out: also dropped {len(rest) - len(train)} training pairs that share a query or "
            f"passage with the {count} held-out pairs; {len(train)} remain for training",
        )
    negatives = [pairs.negatives[i] for i in train] if pairs.negatives else []
    return Pairs([pairs.queries[i] for i in train], [pairs.passages[i] for i in train], negatives), evaluation


def embedded_eval_set(seed: int, max_queries: int) -> EvalSet:
    """The demo's evaluation: inverse-cloze retrieval over the held-out Wikipedia articles, plus Lee STS."""
    from distill import embedded  # the demo, loaded only when named

    queries, corpus, relevant, (sts_texts, sts_pairs, sts_scores) = embedded.eval_set(seed, max_queries)
    return EvalSet(queries, corpus, relevant, sts_texts, sts_pairs, sts_scores)


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


def nanobeir_eval_set(eval_data: str, names: str | None) -> EvalSet:
    """NanoBEIR (`nanobeir`, or `nanobeir:DATASET` for another language's copy or a local folder) as the run's
    evaluation set: the datasets `names` lists (comma-separated; default all 13), each a group ranked on its own.

    The data is read as sentence-transformers' `NanoBEIREvaluator` reads it: subsets corpus, queries and qrels,
    one split per dataset named Nano<Dataset>.
    """
    from sentence_transformers.sentence_transformer.evaluation.nano_beir import DATASET_NAME_TO_HUMAN_READABLE

    dataset_id = eval_data.split(":", 1)[1] if ":" in eval_data else NANOBEIR_HUB
    chosen = (
        [n.strip().lower() for n in names.split(",") if n.strip()] if names else list(DATASET_NAME_TO_HUMAN_READABLE)
    )
    unknown = [n for n in chosen if n not in DATASET_NAME_TO_HUMAN_READABLE]
    if unknown:
        raise DistillError(
            f"nanobeir_datasets: unknown {', '.join(unknown)}; choose from {', '.join(DATASET_NAME_TO_HUMAN_READABLE)}"
        )
    evaluation = EvalSet([], [], [])
    for name in chosen:
        split = f"Nano{DATASET_NAME_TO_HUMAN_READABLE[name]}"
        corpus = {r["_id"]: r["text"] for r in _nanobeir_rows(dataset_id, "corpus", split) if r["text"]}
        queries = {r["_id"]: r["text"] for r in _nanobeir_rows(dataset_id, "queries", split) if r["text"]}
        judged: dict[str, set[str]] = {}
        for r in _nanobeir_rows(dataset_id, "qrels", split):
            ids = r["corpus-id"] if isinstance(r["corpus-id"], list) else [r["corpus-id"]]
            judged.setdefault(r["query-id"], set()).update(i for i in ids if i in corpus)
        rows = {doc: row for row, doc in enumerate(corpus)}
        asked = [q for q in queries if judged.get(q)]  # a query with no judged passage in the corpus scores nothing
        first_query, first_passage = len(evaluation.queries), len(evaluation.corpus)
        evaluation.queries += [queries[q] for q in asked]
        evaluation.corpus += list(corpus.values())
        evaluation.groups.append(
            EvalGroup(
                split,
                range(first_query, len(evaluation.queries)),
                range(first_passage, len(evaluation.corpus)),
                [{rows[doc] for doc in judged[q]} for q in asked],
            )
        )
    return evaluation


def _nanobeir_rows(dataset_id: str, subset: str, split: str) -> Any:
    from datasets import load_dataset

    try:
        return load_dataset(dataset_id, subset, split=split, revision=revision(dataset_id))
    except Exception as e:  # offline, no such dataset or split: one line that says what NanoBEIR needs
        raise DistillError(
            f"eval_data nanobeir: cannot read {dataset_id!r} (subset {subset!r}, split {split!r}: {first_line(e)}); "
            "NanoBEIR needs the Hub, or a local copy in the same format: --eval_data nanobeir:FOLDER"
        ) from None
