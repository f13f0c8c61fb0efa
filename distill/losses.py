"""Distillation losses: embedding alignment (phase 1 and 2), the in-batch similarity KL (phase 2), the pairs' own
labels (phase 2, multiple-negatives ranking) and a reranker's scores of each query's candidates (phase 2); the last
two through sentence-transformers' losses.

All functions are pure: tensors in, scalar tensors out. `dims` selects the comparison space: None compares
the vectors as given (projection mode: projected student vs full teacher); a list of Matryoshka dims
compares, at each d, the first d coordinates of both, re-normalised, and averages (MRL mode).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

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
    reranker: float = 1.0  # weight of `reranker_loss`, where a reranker scored the candidates
    reranker_loss: str = "kl_div"  # or "margin_mse"
    reranker_temperature: float = 1.0  # the reranker's scores are divided by it
    label: float = 0.0  # weight of `label_loss`: each query's own passage against every other candidate
    label_margin: float = 0.0  # candidates the teacher scores within this of the positive are left out


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


@cache
def _ranking_loss(kind: str, temperature: float) -> torch.nn.Module:
    """sentence-transformers' DistillKLDivLoss or MarginMSELoss on the student's cosines / `temperature`.

    Only their `compute_loss_from_embeddings` is used: the loop embeds the texts itself (chunked, gathered, in
    Matryoshka dims), so the losses need no model. The student's temperature is applied in the similarity, so that
    DistillKLDivLoss's scaling by the student temperature squared is 1 and the weight compares with --kl_weight; the
    reranker's is applied to its scores beforehand (`reranker_loss`), for both losses alike.
    """
    from sentence_transformers.sentence_transformer.losses import DistillKLDivLoss, MarginMSELoss
    from sentence_transformers.util import pairwise_cos_sim

    def similarity(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return pairwise_cos_sim(a, b) / temperature

    if kind == "margin_mse":
        return MarginMSELoss(None, similarity_fct=similarity)
    return DistillKLDivLoss(None, similarity_fct=similarity)


def reranker_loss(
    queries: torch.Tensor,
    passages: torch.Tensor,
    teacher_scores: torch.Tensor,
    weights: LossWeights,
    dims: list[int] | None = None,
) -> torch.Tensor:
    """The student's scores of each query's own candidates against the reranker's (`teacher_scores`, (batch, ways)),
    the reranker's divided by --reranker_temperature.

    `passages` are the batch's positives, then each query's negatives in turn ((batch x ways, dim), as phase 2's
    batches hold them). kl_div: KL of each query's softmax over its candidates; margin_mse: MSE of the positive's
    margin over each negative.
    """
    batch, ways = teacher_scores.shape
    scores = teacher_scores.float().detach() / weights.reranker_temperature
    loss = _ranking_loss(weights.reranker_loss, weights.temperature)
    total = queries.new_zeros((), dtype=torch.float32)
    spaces = [None] if dims is None else dims
    for dim in spaces:
        q = queries.float() if dim is None else truncate(queries.float(), dim)
        p = passages.float() if dim is None else truncate(passages.float(), dim)
        negatives = p[batch:].reshape(batch, ways - 1, -1).unbind(1)
        total = total + loss.compute_loss_from_embeddings([q, p[:batch], *negatives], scores)
    return weights.reranker * total / len(spaces)


def false_negatives(teacher_queries: torch.Tensor, teacher_candidates: torch.Tensor, margin: float) -> torch.Tensor:
    """(queries, candidates) True where the teacher scores a candidate at least as high as the query's positive
    less `margin`: likelier an unlabelled positive than a negative (GISTEmbed's guide, absolute margin). Query i's
    positive is candidate i and is never left out; an exact copy of it elsewhere in the batch always is."""
    teacher_scores = F.normalize(teacher_queries.float(), dim=-1) @ F.normalize(teacher_candidates.float(), dim=-1).T
    positive = teacher_scores.diagonal().unsqueeze(1)  # (queries, 1)
    left_out = teacher_scores >= positive - margin
    left_out.fill_diagonal_(False)
    return left_out


def label_loss(
    queries: torch.Tensor,
    candidates: torch.Tensor,
    teacher_queries: torch.Tensor,
    teacher_candidates: torch.Tensor,
    weights: LossWeights,
    dims: list[int] | None = None,
) -> torch.Tensor:
    """The pairs' own labels: each query's softmax over every candidate, with its own passage as the target
    (multiple-negatives ranking, InfoNCE), through sentence-transformers' `MultipleNegativesRankingLoss`.

    `candidates` are every query's positive (query i's is row i), then each query's first negatives, its second,
    and so on ((queries x ways, dim)); the teacher's rows are laid out the same. Candidates the teacher ranks at
    the positive's level (`false_negatives`) are left out of the softmax, so the labels do not pull against it.
    The loss is given the global batch already gathered (phases.py keeps the gradient of the local rows) and each
    Matryoshka width in turn, which sentence-transformers' own gather and `MatryoshkaLoss` would do from a model.
    """
    from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss
    from sentence_transformers.util import cos_sim

    batch = queries.shape[0]
    left_out = false_negatives(teacher_queries, teacher_candidates, weights.label_margin)

    # MultipleNegativesRankingLoss scores the queries against all candidates with `similarity_fct` and takes the
    # cross-entropy of each query's own: the teacher's verdict enters as -inf scores, as GISTEmbedLoss masks them.
    def guided_cosine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return cos_sim(a, b).masked_fill(left_out, float("-inf"))

    scale = 1 / weights.temperature  # one temperature for phase 2's softmaxes: 0.05, MNRL's default scale of 20
    loss = MultipleNegativesRankingLoss(None, scale=scale, similarity_fct=guided_cosine)
    total = queries.new_zeros((), dtype=torch.float32)
    spaces = [None] if dims is None else dims
    for dim in spaces:
        q = queries.float() if dim is None else truncate(queries.float(), dim)
        c = candidates.float() if dim is None else truncate(candidates.float(), dim)
        total = total + loss.compute_loss_from_embeddings([q, *c.split(batch)], None)
    return weights.label * total / len(spaces)
