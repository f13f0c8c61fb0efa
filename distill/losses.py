"""Distillation losses: embedding alignment (phase 1 and 2) and the in-batch similarity KL (phase 2).

All functions are pure: tensors in, scalar tensors out. `dims` selects the comparison space: None compares
the vectors as given (projection mode: projected student vs full teacher); a list of Matryoshka dims
compares, at each d, the first d coordinates of both, re-normalised, and averages (MRL mode).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class LossWeights:
    cosine: float = 1.0
    mse: float = 1.0
    kl: float = 1.0
    temperature: float = 0.05
    # MRL: the similarity loss at every dim d targets the teacher's similarities at the full (student) width,
    # instead of those of the teacher truncated to d (which a non-Matryoshka teacher ranks poorly at small d).
    matryoshka_full_teacher_similarity: bool = False


def truncate(vectors: torch.Tensor, dim: int) -> torch.Tensor:
    """First `dim` coordinates, re-normalised to unit length (how a Matryoshka vector is truncated)."""
    return F.normalize(vectors[:, :dim], dim=-1)


def _spaces(student: torch.Tensor, teacher: torch.Tensor, dims: list[int] | None):
    teacher = teacher.detach()  # the teacher is a fixed target: no gradient ever flows into it
    if dims is None:
        return [(student, teacher)]
    return [(truncate(student, d), truncate(teacher, d)) for d in dims]


def _pair_spaces(
    student_queries: torch.Tensor,
    student_passages: torch.Tensor,
    teacher_queries: torch.Tensor,
    teacher_passages: torch.Tensor,
    weights: LossWeights,
    dims: list[int] | None,
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(student queries, student passages, teacher queries, teacher passages) in each comparison space."""
    query_spaces = _spaces(student_queries.float(), teacher_queries.float(), dims)
    passage_spaces = _spaces(student_passages.float(), teacher_passages.float(), dims)
    full_teacher = weights.matryoshka_full_teacher_similarity and dims is not None
    # with full_teacher every space targets the first one's teacher: the full width (dims are sorted largest first)
    return [
        (sq, sp, *((query_spaces[0][1], passage_spaces[0][1]) if full_teacher else (tq, tp)))
        for (sq, tq), (sp, tp) in zip(query_spaces, passage_spaces)
    ]


def alignment_loss(
    student: torch.Tensor, teacher: torch.Tensor, weights: LossWeights, dims: list[int] | None = None
) -> torch.Tensor:
    """cosine * (1 - cos) + mse * squared distance, averaged over the batch (and over Matryoshka dims).

    The squared distance is summed over coordinates (not averaged), so it stays comparable to the cosine
    term whatever the dimension: for unit vectors it equals 2 * (1 - cos).
    """
    total = student.new_zeros(())
    spaces = _spaces(student.float(), teacher.float(), dims)
    for s, t in spaces:
        cosine = F.cosine_similarity(s, t, dim=-1)  # (batch,)
        squared = (s - t).pow(2).sum(dim=-1)  # (batch,)
        total = total + weights.cosine * (1 - cosine).mean() + weights.mse * squared.mean()
    return total / len(spaces)


def similarity_kl_loss(
    student_queries: torch.Tensor,
    student_passages: torch.Tensor,
    teacher_queries: torch.Tensor,
    teacher_passages: torch.Tensor,
    weights: LossWeights,
    dims: list[int] | None = None,
) -> torch.Tensor:
    """KL(teacher || student) of each query's softmax over all in-batch passages (positives and negatives).

    The student learns the teacher's whole ranking of the batch, not only which passage is positive.
    """
    total = student_queries.new_zeros(())
    spaces = _pair_spaces(student_queries, student_passages, teacher_queries, teacher_passages, weights, dims)
    for sq, sp, tq, tp in spaces:
        student_scores = F.normalize(sq, dim=-1) @ F.normalize(sp, dim=-1).T / weights.temperature  # (q, p)
        teacher_scores = F.normalize(tq, dim=-1) @ F.normalize(tp, dim=-1).T / weights.temperature  # (q, p)
        total = total + F.kl_div(
            F.log_softmax(student_scores, dim=-1),
            F.log_softmax(teacher_scores, dim=-1),
            reduction="batchmean",
            log_target=True,
        )
    return weights.kl * total / len(spaces)
