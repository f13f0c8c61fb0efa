"""Distillation losses on hand-computed examples."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from distill.losses import (
    LossWeights,
    alignment_loss,
    relative_similarity_loss,
    similarity_kl_loss,
    structure_kl_loss,
    truncate,
)


def unit(rows: list[list[float]]) -> torch.Tensor:
    return F.normalize(torch.tensor(rows, dtype=torch.float32), dim=-1)


def random_unit(rows: int, dim: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return F.normalize(torch.randn(rows, dim, generator=generator), dim=-1)


# ---------------------------------------------------------------- alignment


def test_alignment_is_zero_for_identical_unit_vectors() -> None:
    vectors = random_unit(6, 16, seed=0)
    loss = alignment_loss(vectors, vectors.clone(), LossWeights())
    assert loss.shape == ()
    assert loss.item() == pytest.approx(0.0, abs=1e-6)
    assert alignment_loss(vectors, vectors.clone(), LossWeights(), dims=[16, 8, 4]).item() == pytest.approx(
        0.0, abs=1e-6
    )


def test_alignment_matches_hand_computed_value() -> None:
    # row 0: unit vectors, cos = 0.6, |a - b|^2 = 0.4^2 + 0.8^2 = 0.8
    # row 1: a = (3, 4) against b = (1, 0): cos = 0.6, |a - b|^2 = 2^2 + 4^2 = 20
    student = torch.tensor([[1.0, 0.0], [3.0, 4.0]])
    teacher = torch.tensor([[0.6, 0.8], [1.0, 0.0]])
    weights = LossWeights(cosine=2.0, mse=0.5)
    expected = 2.0 * (1 - 0.6) + 0.5 * (0.8 + 20.0) / 2
    assert alignment_loss(student, teacher, weights).item() == pytest.approx(expected, rel=1e-6)
    # each weight scales its own term only
    assert alignment_loss(student, teacher, LossWeights(cosine=1.0, mse=0.0)).item() == pytest.approx(0.4, rel=1e-6)
    assert alignment_loss(student, teacher, LossWeights(cosine=0.0, mse=1.0)).item() == pytest.approx(10.4, rel=1e-6)


def test_alignment_squared_distance_is_summed_not_averaged() -> None:
    student, teacher = random_unit(5, 64, seed=1), random_unit(5, 64, seed=2)
    cosine = (student * teacher).sum(dim=-1)
    mse_only = alignment_loss(student, teacher, LossWeights(cosine=0.0, mse=1.0))
    # for unit vectors the summed squared distance is 2 * (1 - cos), whatever the dimension
    assert mse_only.item() == pytest.approx((2 * (1 - cosine)).mean().item(), rel=1e-5)


def test_alignment_accepts_half_precision_inputs() -> None:
    student, teacher = random_unit(4, 8, seed=3), random_unit(4, 8, seed=4)
    full = alignment_loss(student, teacher, LossWeights())
    half = alignment_loss(student.half(), teacher.half(), LossWeights())
    assert half.dtype == torch.float32
    assert half.item() == pytest.approx(full.item(), rel=1e-2)


# ---------------------------------------------------------------- Matryoshka


def test_truncate_renormalises() -> None:
    vectors = torch.tensor([[3.0, 4.0, 12.0], [0.0, 2.0, 5.0]])
    truncated = truncate(vectors, 2)
    assert torch.allclose(truncated, torch.tensor([[0.6, 0.8], [0.0, 1.0]]))
    assert torch.allclose(truncated.norm(dim=-1), torch.ones(2))
    assert torch.allclose(truncate(vectors, 3), F.normalize(vectors, dim=-1))


def test_matryoshka_alignment_averages_over_truncated_spaces() -> None:
    s = 1 / math.sqrt(2)
    student = torch.tensor([[s, 0.0, s]])
    teacher = torch.tensor([[s, 0.0, -s]])
    weights = LossWeights(cosine=1.0, mse=1.0)
    # full dim: cos = 0, |a - b|^2 = 2 -> 3; first 2 dims: both (1, 0) after re-normalising -> 0
    assert alignment_loss(student, teacher, weights, dims=[3]).item() == pytest.approx(3.0, rel=1e-6)
    assert alignment_loss(student, teacher, weights, dims=[2]).item() == pytest.approx(0.0, abs=1e-6)
    assert alignment_loss(student, teacher, weights, dims=[3, 2]).item() == pytest.approx(1.5, rel=1e-6)
    # the teacher may be wider than the student: it is truncated to each dim too
    wide_teacher = torch.tensor([[s, 0.0, -s, 5.0]])
    assert alignment_loss(student, wide_teacher, weights, dims=[2]).item() == pytest.approx(0.0, abs=1e-6)


def test_matryoshka_compares_renormalised_prefixes() -> None:
    student = torch.tensor([[2.0, 0.0, 1.0, 1.0]])
    teacher = torch.tensor([[0.5, 0.0, -3.0, 7.0]])  # same direction in the first 2 dims, scale differs
    loss = alignment_loss(student, teacher, LossWeights(), dims=[2])
    assert loss.item() == pytest.approx(0.0, abs=1e-6)
    assert alignment_loss(student, teacher, LossWeights(), dims=[4]).item() > 0.5


# ---------------------------------------------------------------- similarity KL


def reference_kl(sq: np.ndarray, sp: np.ndarray, tq: np.ndarray, tp: np.ndarray, temperature: float) -> float:
    def log_softmax(scores: np.ndarray) -> np.ndarray:
        shifted = scores - scores.max(axis=1, keepdims=True)
        return shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))

    def normalise(x: np.ndarray) -> np.ndarray:
        return x / np.linalg.norm(x, axis=1, keepdims=True)

    log_s = log_softmax(normalise(sq) @ normalise(sp).T / temperature)
    log_t = log_softmax(normalise(tq) @ normalise(tp).T / temperature)
    return float((np.exp(log_t) * (log_t - log_s)).sum() / len(sq))


def test_similarity_kl_is_zero_when_student_equals_teacher() -> None:
    queries, passages = random_unit(4, 12, seed=5), random_unit(7, 12, seed=6)
    loss = similarity_kl_loss(queries, passages, queries.clone(), passages.clone(), LossWeights())
    assert loss.item() == pytest.approx(0.0, abs=1e-5)
    # scaling the vectors changes nothing: similarities are cosines
    loss = similarity_kl_loss(3 * queries, 0.5 * passages, queries, passages, LossWeights())
    assert loss.item() == pytest.approx(0.0, abs=1e-5)


def test_similarity_kl_is_positive_and_matches_reference() -> None:
    sq, sp = random_unit(4, 12, seed=7), random_unit(6, 12, seed=8)
    tq, tp = random_unit(4, 12, seed=9), random_unit(6, 12, seed=10)
    weights = LossWeights(kl=1.0, temperature=0.1)
    loss = similarity_kl_loss(sq, sp, tq, tp, weights)
    assert loss.item() > 0.01
    expected = reference_kl(sq.numpy(), sp.numpy(), tq.numpy(), tp.numpy(), 0.1)
    assert loss.item() == pytest.approx(expected, rel=1e-4)
    doubled = similarity_kl_loss(sq, sp, tq, tp, LossWeights(kl=2.0, temperature=0.1))
    assert doubled.item() == pytest.approx(2 * loss.item(), rel=1e-6)


def test_similarity_kl_excluding_self_matches_a_softmax_over_the_other_texts() -> None:
    student, teacher = random_unit(6, 12, seed=21), random_unit(6, 12, seed=22)
    weights = LossWeights(kl=0.5, temperature=0.1)
    loss = similarity_kl_loss(student, student, teacher, teacher, weights, exclude_self=True)
    assert math.isfinite(loss.item()) and loss.item() > 0.01
    # reference: each row's softmax over the 5 other texts only
    rows = []
    for i in range(6):
        others = [j for j in range(6) if j != i]
        rows.append(
            reference_kl(
                student[i : i + 1].numpy(),
                student[others].numpy(),
                teacher[i : i + 1].numpy(),
                teacher[others].numpy(),
                0.1,
            )
        )
    assert loss.item() == pytest.approx(0.5 * float(np.mean(rows)), rel=1e-4)
    # without the exclusion, the self-similarity (1 / T) dominates every row and the loss is much smaller
    with_self = similarity_kl_loss(student, student, teacher, teacher, weights)
    assert with_self.item() < 0.5 * loss.item()
    # identical student and teacher: zero, and the gradient is finite (no -inf - -inf NaN)
    leaf = teacher.clone().requires_grad_(True)
    same = similarity_kl_loss(leaf, leaf, teacher, teacher, weights, exclude_self=True)
    same.backward()
    assert same.item() == pytest.approx(0.0, abs=1e-5) and torch.isfinite(leaf.grad).all()


def test_similarity_kl_matryoshka_dims() -> None:
    sq, sp = random_unit(3, 8, seed=11), random_unit(5, 8, seed=12)
    tq, tp = random_unit(3, 8, seed=13), random_unit(5, 8, seed=14)
    weights = LossWeights(temperature=0.2)
    per_dim = [
        reference_kl(
            truncate(sq, d).numpy(), truncate(sp, d).numpy(), truncate(tq, d).numpy(), truncate(tp, d).numpy(), 0.2
        )
        for d in (8, 4)
    ]
    loss = similarity_kl_loss(sq, sp, tq, tp, weights, dims=[8, 4])
    assert loss.item() == pytest.approx(sum(per_dim) / 2, rel=1e-4)


def test_similarity_kl_matryoshka_full_teacher_similarity() -> None:
    sq, sp = random_unit(3, 8, seed=11), random_unit(5, 8, seed=12)
    tq, tp = random_unit(3, 8, seed=13), random_unit(5, 8, seed=14)
    weights = LossWeights(temperature=0.2, matryoshka_full_teacher_similarity=True)
    # every truncated student space is compared with the teacher's full-width similarities
    per_dim = [
        reference_kl(truncate(sq, d).numpy(), truncate(sp, d).numpy(), tq.numpy(), tp.numpy(), 0.2) for d in (8, 4)
    ]
    loss = similarity_kl_loss(sq, sp, tq, tp, weights, dims=[8, 4])
    assert loss.item() == pytest.approx(sum(per_dim) / 2, rel=1e-4)
    # without Matryoshka dims the option changes nothing
    plain = similarity_kl_loss(sq, sp, tq, tp, LossWeights(temperature=0.2))
    assert similarity_kl_loss(sq, sp, tq, tp, weights).item() == pytest.approx(plain.item(), rel=1e-6)


def test_similarity_kl_gradient_reaches_student_only() -> None:
    sq = random_unit(3, 8, seed=15).requires_grad_()
    sp = random_unit(5, 8, seed=16).requires_grad_()
    tq = random_unit(3, 8, seed=17).requires_grad_()
    tp = random_unit(5, 8, seed=18).requires_grad_()
    loss = similarity_kl_loss(sq, sp, tq, tp, LossWeights())
    loss.backward()
    assert sq.grad is not None and sq.grad.abs().sum() > 0
    assert sp.grad is not None and sp.grad.abs().sum() > 0
    assert tq.grad is None and tp.grad is None


def test_alignment_gradient_reaches_student_only() -> None:
    student = random_unit(3, 8, seed=19).requires_grad_()
    teacher = random_unit(3, 8, seed=20).requires_grad_()
    alignment_loss(student, teacher, LossWeights(), dims=[8, 4]).backward()
    assert student.grad is not None and student.grad.abs().sum() > 0
    assert teacher.grad is None


def test_similarity_kl_gradient_moves_student_towards_teacher() -> None:
    tq, tp = random_unit(4, 16, seed=21), random_unit(8, 16, seed=22)
    sq = random_unit(4, 16, seed=23).requires_grad_()
    sp = random_unit(8, 16, seed=24).requires_grad_()
    weights = LossWeights(temperature=0.1)
    before = similarity_kl_loss(sq, sp, tq, tp, weights)
    before.backward()
    with torch.no_grad():
        after = similarity_kl_loss(sq - 0.05 * sq.grad, sp - 0.05 * sp.grad, tq, tp, weights)
    assert after.item() < before.item()


# ---------------------------------------------------------------- relative similarity


def test_relative_similarity_matches_hand_computed_value() -> None:
    # one query, two passages: the teacher scores passage 0 above passage 1, the student the other way round
    query = unit([[1.0, 0.0]])
    teacher_passages = unit([[1.0, 0.0], [0.0, 1.0]])  # teacher scores 1.0 and 0.0
    student_passages = unit([[0.6, 0.8], [0.8, 0.6]])  # student scores 0.6 and 0.8
    weights = LossWeights(resim=2.0, resim_margin=0.1)
    loss = relative_similarity_loss(query, student_passages, query, teacher_passages, weights)
    # both ordered pairs (0, 1) and (1, 0) cost relu(0.1 - (0.6 - 0.8)) = 0.3; the weight doubles it
    assert loss.item() == pytest.approx(2.0 * 0.3, rel=1e-5)


def test_relative_similarity_is_zero_when_every_order_is_kept_by_the_margin() -> None:
    queries, passages = random_unit(4, 16, seed=20), random_unit(5, 16, seed=21)
    weights = LossWeights(resim=1.0, resim_margin=0.0)
    assert relative_similarity_loss(queries, passages, queries, passages, weights).item() == 0.0
    # with a margin, pairs the teacher separates by less than it still cost something
    with_margin = relative_similarity_loss(queries, passages, queries, passages, replace(weights, resim_margin=0.5))
    assert with_margin.item() > 0.0


def test_relative_similarity_compares_scores_across_queries() -> None:
    # two queries, one passage each: only the cross-query order of the two scores is there to keep
    queries = unit([[1.0, 0.0], [0.0, 1.0]])
    passage = unit([[1.0, 0.2]])
    weights = LossWeights(resim=1.0, resim_margin=0.0)
    swapped = relative_similarity_loss(queries, passage, queries.flip(0), passage, weights)
    expected = abs((queries[0] @ passage[0] - queries[1] @ passage[0]).item())
    assert swapped.item() == pytest.approx(expected, rel=1e-5)


def test_relative_similarity_ignores_teacher_ties() -> None:
    query = unit([[1.0, 0.0]])
    teacher_passages = unit([[1.0, 1.0], [1.0, -1.0]])  # the teacher scores both 0.707
    student_passages = unit([[1.0, 0.0], [0.0, 1.0]])
    weights = LossWeights(resim=1.0, resim_margin=0.1)
    assert relative_similarity_loss(query, student_passages, query, teacher_passages, weights).item() == 0.0


def test_relative_similarity_gradient_restores_the_teachers_order() -> None:
    query = unit([[1.0, 0.0]])
    teacher_passages = unit([[1.0, 0.0], [0.0, 1.0]])
    student_passages = unit([[0.6, 0.8], [0.8, 0.6]]).requires_grad_()
    weights = LossWeights(resim=1.0)
    relative_similarity_loss(query, student_passages, query, teacher_passages, weights).backward()
    stepped = student_passages.detach() - 0.1 * student_passages.grad
    scores = F.normalize(stepped, dim=-1) @ query[0]
    assert scores[0] - scores[1] > 0.6 - 0.8  # passage 0 gained on passage 1


def test_relative_similarity_matryoshka_dims_average_the_truncated_spaces() -> None:
    queries, passages = random_unit(3, 8, seed=22), random_unit(4, 8, seed=23)
    teacher_queries, teacher_passages = random_unit(3, 8, seed=24), random_unit(4, 8, seed=25)
    weights = LossWeights(resim=1.0)
    per_dim = [
        relative_similarity_loss(
            truncate(queries, d),
            truncate(passages, d),
            truncate(teacher_queries, d),
            truncate(teacher_passages, d),
            weights,
        ).item()
        for d in (8, 4)
    ]
    mrl = relative_similarity_loss(queries, passages, teacher_queries, teacher_passages, weights, dims=[8, 4])
    assert mrl.item() == pytest.approx(sum(per_dim) / 2, rel=1e-5)
    assert per_dim[0] != pytest.approx(per_dim[1])  # the two spaces differ, so the average is not trivially right


# ---------------------------------------------------------------- the rest of the similarity structure


def test_structure_kl_is_zero_when_off_and_when_student_equals_teacher() -> None:
    sq, sp = random_unit(4, 12, seed=30), random_unit(6, 12, seed=31)
    tq, tp = random_unit(4, 12, seed=32), random_unit(6, 12, seed=33)
    assert structure_kl_loss(sq, sp, tq, tp, LossWeights()).item() == 0.0  # both weights 0 by default
    both = LossWeights(reverse_kl=1.0, within_kl=1.0)
    assert structure_kl_loss(sq, sp, sq.clone(), sp.clone(), both).item() == pytest.approx(0.0, abs=1e-5)
    assert structure_kl_loss(sq, sp, tq, tp, both).item() > 0.01


def test_reverse_kl_ranks_queries_for_each_passage() -> None:
    sq, sp = random_unit(4, 12, seed=34), random_unit(6, 12, seed=35)
    tq, tp = random_unit(4, 12, seed=36), random_unit(6, 12, seed=37)
    loss = structure_kl_loss(sq, sp, tq, tp, LossWeights(reverse_kl=0.5, temperature=0.1))
    # each of the 6 passages' softmax over the 4 queries: the transposed score matrix
    expected = reference_kl(sp.numpy(), sq.numpy(), tp.numpy(), tq.numpy(), 0.1)
    assert loss.item() == pytest.approx(0.5 * expected, rel=1e-4)
    forward = similarity_kl_loss(sq, sp, tq, tp, LossWeights(kl=0.5, temperature=0.1))
    assert loss.item() != pytest.approx(forward.item())  # not the query-side softmax again


def test_within_kl_averages_the_query_side_and_the_passage_side() -> None:
    sq, sp = random_unit(5, 12, seed=38), random_unit(5, 12, seed=39)
    tq, tp = random_unit(5, 12, seed=40), random_unit(5, 12, seed=41)
    weights = LossWeights(within_kl=2.0, temperature=0.1)
    sides = [
        similarity_kl_loss(s, s, t, t, LossWeights(kl=1.0, temperature=0.1), exclude_self=True).item()
        for s, t in ((sq, tq), (sp, tp))
    ]
    assert structure_kl_loss(sq, sp, tq, tp, weights).item() == pytest.approx(sides[0] + sides[1], rel=1e-5)
    # a student whose queries match the teacher's structure and whose passages do not pays for the passages only
    half = structure_kl_loss(tq.clone(), sp, tq, tp, weights).item()
    assert half == pytest.approx(sides[1], rel=1e-5)


def test_structure_kl_gradient_moves_the_student_towards_the_teachers_structure() -> None:
    tq, tp = random_unit(4, 8, seed=42), random_unit(6, 8, seed=43)
    sq = random_unit(4, 8, seed=44).requires_grad_(True)
    sp = random_unit(6, 8, seed=45).requires_grad_(True)
    weights = LossWeights(reverse_kl=1.0, within_kl=1.0, temperature=0.1)
    before = structure_kl_loss(sq, sp, tq, tp, weights)
    before.backward()
    with torch.no_grad():
        after = structure_kl_loss(sq - 0.05 * sq.grad, sp - 0.05 * sp.grad, tq, tp, weights)
    assert after.item() < before.item()


def test_phase_2_distils_similarities_alone_when_phase_1_has_its_own_target() -> None:
    from distill.config import load_config
    from distill.phases import phase_settings

    mrl = ["--use_projection", "False", "--cosine_weight", "0.5", "--mse_weight", "2"]
    plain = load_config(mrl)
    assert [(w.cosine, w.mse) for w in (phase_settings(plain, p, 1).weights for p in ("phase1", "phase2"))] == [
        (0.5, 2.0),
        (0.5, 2.0),
    ]
    own = load_config([*mrl, "--phase1_teacher_model", "student/source"])
    phase1, phase2 = (phase_settings(own, p, 1).weights for p in ("phase1", "phase2"))
    assert (phase1.cosine, phase1.mse) == (0.5, 2.0)  # phase 1 aligns the student to its own target
    assert (phase2.cosine, phase2.mse, phase2.kl) == (0.0, 0.0, 1.0)  # no shared space with the teacher: KL alone
