"""Cleaning: non-empty strings, whitespace collapsed, exact duplicates dropped, caps, held-out evaluation pairs; each
drop and each cap said in one line.

Bad rows (empty, whitespace-only, non-string) are dropped with a count; exact duplicates are dropped;
`max_samples` counts the texts (pairs) kept, so a source is read in chunks until that many are usable; without
it a source is read whole. A cap the source reaches is said in one line, and kept in `DistillData.capped` for
results.json. A phase left with nothing is an error that says why.
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from typing import Any

from distill.data.containers import EvalSet, Pairs
from distill.data.reading import warn
from distill.errors import DistillError


def clean_pairs(
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
