"""The data stage: the texts of both phases and the evaluation set, read, cleaned and kept once per machine.

    sources and rows (reading.py) -> cleaning (cleaning.py) -> kept (kept.py) -> the run

`prepared_data` is the stage: each machine's first process reads and cleans the data once and keeps it as Arrow
files under `<teacher_cache_dir>/data/`, which every process memory-maps (kept.py says how it is keyed). `load_data`
reads and cleans without keeping: the planner's and the benches' call. The data's types are in containers.py.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from itertools import chain
from pathlib import Path
from typing import Any

from distill.config.schema import DataConfig
from distill.data.cleaning import clean_pairs, clean_texts, hold_out, report_cap
from distill.data.containers import DistillData, EvalSet, Pairs
from distill.data.kept import data_key, hub_commits, kept_data, source_stamps
from distill.data.reading import (
    EMBEDDED,
    PASSAGE_COLUMNS,
    QUERY_COLUMNS,
    TEXT_COLUMNS,
    embedded_eval_set,
    first_item,
    head_and_rest,
    lenient,
    nanobeir_eval_set,
    negative_reader,
    pick_column,
    pinned,
)
from distill.errors import DistillError


def prepared_data(
    config: DataConfig, seed: int, need_phase1: bool, need_phase2: bool, folder: Path | None
) -> DistillData:
    """The data stage: `load_data`'s result, read once per machine into `folder` and memory-mapped from there by
    every process (without a folder, or with phase data from a Hub dataset whose commit the Hub cannot name: read
    here). A Hub dataset is read at the commit the main process was told, on every machine.

    NanoBEIR is read beside the phases. It is kept with them where the Hub names its commit; where it cannot
    (offline), each process reads it (13 small datasets from datasets' own cache), and the phase data, which may be
    millions of texts, are kept still."""
    commits = hub_commits(config, need_phase1, need_phase2)
    stamps = source_stamps(config, need_phase1, need_phase2, commits)  # what a resume compares with its checkpoint's
    with pinned(commits):
        evaluated = lenient(config.eval_data)
        nanobeir, hub = evaluated.nanobeir, evaluated.hub_id
        beside = nanobeir and hub is not None and commits.get(hub) is None
        key = None if folder is None else data_key(config, seed, need_phase1, need_phase2, commits, not beside)

        def read() -> DistillData:
            data = load_phases(config, seed, need_phase1, need_phase2)
            if nanobeir and not beside:
                data.evaluation = load_evaluation(config)
            return data

        data = read() if folder is None or key is None else kept_data(folder / key, read)
        if beside:
            data.evaluation = load_evaluation(config)
    return dataclasses.replace(data, stamps=stamps)


def load_data(config: DataConfig, seed: int, need_phase1: bool = True, need_phase2: bool = True) -> DistillData:
    """Everything the run trains and evaluates on, cleaned and capped: the phases, then NanoBEIR where named."""
    data = load_phases(config, seed, need_phase1, need_phase2)
    if lenient(config.eval_data).nanobeir:
        data.evaluation = load_evaluation(config)
    return data


def load_evaluation(config: DataConfig) -> EvalSet:
    """NanoBEIR's datasets as the evaluation set: a source of its own, read beside the phases."""
    return nanobeir_eval_set(config.eval_data, config.nanobeir_datasets)


def load_phases(config: DataConfig, seed: int, need_phase1: bool, need_phase2: bool) -> DistillData:
    """The phases' data, cleaned and capped, with the evaluation set that comes with them: pairs held out of phase
    2's (`auto`), or the embedded one. NanoBEIR is another source: `load_evaluation`."""
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
    elif config.eval_data != "none" and not lenient(config.eval_data).nanobeir:
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
        head, rest = head_and_rest(source)
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
        return clean_pairs(((q, p, []) for q, p in zip(queries, passages, strict=True)), source, 0)
    head, rest = head_and_rest(source)
    query_col = pick_column(head, QUERY_COLUMNS, source, "phase-2 query")
    passage_col = pick_column(head, tuple(c for c in PASSAGE_COLUMNS if c != query_col), source, "phase-2 passage")
    negatives_of, count = negative_reader(head, source, exclude=(query_col, passage_col))
    rows = ((r.get(query_col), first_item(r.get(passage_col)), negatives_of(r)) for r in chain(head, rest))
    return clean_pairs(rows, source, count, limit=max_samples, capped=capped)
