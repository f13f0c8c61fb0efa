"""Distillation losses: embedding alignment (phase 1 and 2), in-batch similarity KL and relative similarity (phase 2).

All functions are pure: tensors in, scalar tensors out. `dims` selects the comparison space: None compares
the vectors as given (projection mode: projected student vs full teacher); a list of Matryoshka dims
compares, at each d, the first d coordinates of both, re-normalised, and averages (MRL mode).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

SELF_SCORE = -1e4  # a text's own score in its in-batch softmax when it is excluded: exp() underflows to 0


@dataclass(frozen=True)
class LossWeights:
    cosine: float = 1.0
    mse: float = 1.0
    kl: float = 1.0
    temperature: float = 0.05
    # MRL: the similarity loss at every dim d targets the teacher's similarities at the full (student) width,
    # instead of those of the teacher truncated to d (which a non-Matryoshka teacher ranks poorly at small d).
    matryoshka_full_teacher_similarity: bool = False
    # Phase 1: weight of the in-batch text-to-text similarity KL (0: alignment only).
    phase1_kl: float = 0.0
    # Phase 2: weight and margin of the relative similarity loss (0: off).
    resim: float = 0.0
    resim_margin: float = 0.015
    # Phase 2: weight of the KL of each passage's softmax over the batch's queries (0: off).
    reverse_kl: float = 0.0
    # Phase 2: weight of the KL of each query's softmax over the other queries, and each passage's (0: off).
    within_kl: float = 0.0


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
    exclude_self: bool = False,
) -> torch.Tensor:
    """KL(teacher || student) of each query's softmax over all in-batch passages (positives and negatives).

    The student learns the teacher's whole ranking of the batch, not only which passage is positive.
    `exclude_self` (queries and passages are the same texts, as in phase 1) leaves each text's similarity
    to itself out of its softmax.
    """
    total = student_queries.new_zeros(())
    spaces = _pair_spaces(student_queries, student_passages, teacher_queries, teacher_passages, weights, dims)
    for sq, sp, tq, tp in spaces:
        student_scores = F.normalize(sq, dim=-1) @ F.normalize(sp, dim=-1).T / weights.temperature  # (q, p)
        teacher_scores = F.normalize(tq, dim=-1) @ F.normalize(tp, dim=-1).T / weights.temperature  # (q, p)
        if exclude_self:  # a large finite score, not -inf: KL's 0 * (-inf - -inf) would be NaN
            self_pairs = torch.eye(len(sq), dtype=torch.bool, device=sq.device)
            student_scores = student_scores.masked_fill(self_pairs, SELF_SCORE)
            teacher_scores = teacher_scores.masked_fill(self_pairs, SELF_SCORE)
        total = total + F.kl_div(
            F.log_softmax(student_scores, dim=-1),
            F.log_softmax(teacher_scores, dim=-1),
            reduction="batchmean",
            log_target=True,
        )
    return weights.kl * total / len(spaces)


def structure_kl_loss(
    student_queries: torch.Tensor,
    student_passages: torch.Tensor,
    teacher_queries: torch.Tensor,
    teacher_passages: torch.Tensor,
    weights: LossWeights,
    dims: list[int] | None = None,
) -> torch.Tensor:
    """The rest of the teacher's in-batch similarity structure, as softmax KLs (0 when both weights are 0).

    `reverse_kl`: each passage's softmax over the batch's queries, the query-passage matrix read the other way.
    `within_kl`: each query's softmax over the other queries, and each passage's over the other passages.
    None of them needs the student in the teacher's space: only the teacher's similarities are matched.
    """
    total = student_queries.new_zeros(())
    if weights.reverse_kl:
        reverse = replace(weights, kl=weights.reverse_kl)
        total = total + similarity_kl_loss(
            student_passages, student_queries, teacher_passages, teacher_queries, reverse, dims
        )
    if weights.within_kl:
        within = replace(weights, kl=weights.within_kl / 2)
        for student, teacher in ((student_queries, teacher_queries), (student_passages, teacher_passages)):
            total = total + similarity_kl_loss(student, student, teacher, teacher, within, dims, exclude_self=True)
    return total


def relative_similarity_loss(
    student_queries: torch.Tensor,
    student_passages: torch.Tensor,
    teacher_queries: torch.Tensor,
    teacher_passages: torch.Tensor,
    weights: LossWeights,
    dims: list[int] | None = None,
) -> torch.Tensor:
    """Jasper/Stella's relative similarity distillation over the batch's query-passage cosine scores.

    Every two scores of the (queries x passages) matrix, a and b, that the teacher orders a > b cost
    relu(margin - (s_a - s_b)) in the student: it must keep the teacher's order of any two pairs, across queries
    too, by at least the margin (0.015 in the paper). Averaged over all ordered pairs of scores the teacher
    does not tie. Memory is O((queries x passages)^2): 1M entries at 32 x 32.
    """
    total = student_queries.new_zeros(())
    spaces = _pair_spaces(student_queries, student_passages, teacher_queries, teacher_passages, weights, dims)
    for sq, sp, tq, tp in spaces:
        student_scores = (F.normalize(sq, dim=-1) @ F.normalize(sp, dim=-1).T).flatten()
        teacher_scores = (F.normalize(tq, dim=-1) @ F.normalize(tp, dim=-1).T).flatten()
        order = torch.sign(teacher_scores[:, None] - teacher_scores[None, :])  # (a, b): +1 where t_a > t_b
        gaps = student_scores[:, None] - student_scores[None, :]
        hinge = F.relu(weights.resim_margin - order * gaps)
        ordered = order != 0
        total = total + hinge[ordered].sum() / ordered.sum().clamp(min=1)
    return weights.resim * total / len(spaces)
