"""The reranker stage: every phase-2 query's candidates scored once by the reranker (--reranker_model).

A query's candidates are its positive, then its negatives: the data's own, or those `--mine_hard_negatives` found
with the teacher's vectors (the teacher stage, distill/stages/targets.py). The reranker scores each (query, candidate)
pair through the teacher cache, as a source of 1-wide rows of role "pair": the pairs are sharded over the processes,
written in resumable blocks, and found again per pair by a later run (distill/teachers/reranker.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from accelerate import Accelerator
from accelerate.logging import get_logger

from distill.allocator import release_freed_memory
from distill.config.schema import RerankerConfig
from distill.data.containers import DistillData, passage_texts
from distill.errors import DistillError
from distill.stages.targets import CacheSettings, TeacherCache
from distill.teachers import TeacherContext, make_reranker
from distill.teachers.reranker import candidate_pairs

logger = get_logger(__name__)


@dataclass(frozen=True)
class RerankerScores:
    """The reranker's score of each query's candidates, (queries, 1 + negatives): the positive's first."""

    scores: np.ndarray
    name: str
    seconds: float  # loading the reranker and scoring (0 on a warm cache)
    loaded: bool

    @property
    def pairs(self) -> int:
        return int(self.scores.size)

    def figures(self, loss: str) -> dict[str, object]:
        """What results.json says of it."""
        return {"model": self.name, "pairs": self.pairs, "seconds": round(self.seconds, 3), "loss": loss}


def check_candidates(data: DistillData, mined: int) -> None:
    """A reranker needs candidates beside each positive: the data's negatives, or `mined` ones (checked before the
    teacher encodes anything)."""
    if len(data.phase2) and not mined and not data.phase2.negatives:
        raise DistillError(
            "reranker_model: each query needs candidates beside its positive, and the phase-2 data has no negatives; "
            "pass --mine_hard_negatives N (or data with negatives)"
        )


def score_candidates(
    accelerator: Accelerator,
    settings: RerankerConfig,
    context: TeacherContext,
    cache: CacheSettings,
    data: DistillData,
    rows: np.ndarray,
) -> RerankerScores:
    """The reranker's scores of each phase-2 query's candidates (`rows`: its positive's passage row, then its
    negatives'), through the teacher cache (the run has `check_candidates`' word that there are negatives); the
    reranker is freed afterwards."""
    texts, _ = passage_texts(data.phase2)
    pairs = candidate_pairs(data.phase2.queries, texts, rows)
    logger.info(
        f"reranker {settings.reranker_model}: {len(pairs):,} pairs to score ({rows.shape[0]:,} queries x "
        f"{rows.shape[1]} candidates)",
        main_process_only=True,
    )
    source = make_reranker(settings, context)
    scores_cache = TeacherCache(accelerator, source, cache.folder, cache.batch_size)
    scores = np.asarray(scores_cache.embeddings(pairs, "pair"), dtype=np.float32).reshape(rows.shape)
    loaded = source.loaded
    source.release()
    release_freed_memory()
    return RerankerScores(scores, source.name, scores_cache.seconds, loaded)
