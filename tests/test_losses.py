"""Distillation losses on hand-computed examples."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from distill.losses import (
    LossWeights,
    alignment_loss,
    false_negatives,
    label_loss,
    similarity_kl_loss,
    truncate,
)
from distill.phases import by_candidate


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


# ---------------------------------------------------------------- the rest of the similarity structure


def test_phase_2_distils_similarities_alone_when_phase_1_has_its_own_target() -> None:
    from distill.config import load_config
    from distill.pipeline import training_phases

    mrl = ["--use_projection", "False", "--cosine_weight", "0.5", "--mse_weight", "2"]
    plain = load_config(mrl)
    assert [(w.cosine, w.mse) for w in (p.weights for p in training_phases(plain, 1))] == [
        (0.5, 2.0),
        (0.5, 2.0),
    ]
    own = load_config([*mrl, "--phase1_teacher_model", "student/source"])
    phase1, phase2 = (p.weights for p in training_phases(own, 1))
    assert (phase1.cosine, phase1.mse) == (0.5, 2.0)  # phase 1 aligns the student to its own target
    assert (phase2.cosine, phase2.mse, phase2.kl) == (0.0, 0.0, 1.0)  # no shared space with the teacher: KL alone


# ---------------------------------------------------------------- the pairs' labels


def test_label_loss_is_the_cross_entropy_of_each_querys_own_passage() -> None:
    """Three queries, their positives and one negative each: -log softmax(20 cos)[own passage], averaged."""
    queries, candidates = random_unit(3, 8, seed=1), random_unit(6, 8, seed=2)
    # a teacher that ranks each query's positive far above everything else leaves nothing out
    teacher_queries, teacher_candidates = torch.eye(3, 8), torch.cat([torch.eye(3, 8), -torch.eye(3, 8)])
    weights = LossWeights(label=0.5, temperature=0.05)
    loss = label_loss(queries, candidates, teacher_queries, teacher_candidates, weights)
    expected = F.cross_entropy(20.0 * queries @ candidates.T, torch.arange(3))
    assert loss.item() == pytest.approx(0.5 * expected.item(), rel=1e-5)


def test_the_teacher_leaves_out_candidates_it_ranks_at_the_positives_level() -> None:
    """A candidate the teacher scores above the positive (or within --mnrl_margin of it) is no negative; an exact
    copy of the positive never is one; the positive itself is always kept."""
    teacher_queries = unit([[1, 0, 0], [0, 1, 0]])
    teacher_candidates = unit([[1, 0.5, 0], [0, 1, 0], [1, 0.1, 0], [0, 1, 0], [1, 0.6, 0]])
    left_out = false_negatives(teacher_queries, teacher_candidates, margin=0.0)
    # query 0's positive (col 0) has cosine 0.894; col 2 (0.995) and col 4 (0.857 < 0.894) are its other candidates
    assert left_out[0].tolist() == [False, False, True, False, False]
    # query 1's positive (col 1, cosine 1) has an exact copy in col 3
    assert left_out[1].tolist() == [False, False, False, True, False]
    assert false_negatives(teacher_queries, teacher_candidates, margin=0.05)[0].tolist() == [
        False,
        False,
        True,
        False,
        True,
    ]


def test_a_left_out_candidate_is_out_of_that_querys_softmax_only() -> None:
    """Candidate 2 copies query 0's positive for the teacher: it leaves query 0's softmax (no gradient through it)
    and stays an in-batch negative of query 1."""
    queries, candidates = random_unit(2, 8, seed=3), random_unit(4, 8, seed=4)
    teacher_queries = unit([[1, 0, 0, 0], [0, 1, 0, 0]])
    teacher_candidates = unit([[1, 0, 0, 0], [0, 1, 0, 0], [1, 0, 0, 0], [0, 0, 1, 0]])
    q, c = queries.clone().requires_grad_(), candidates.clone().requires_grad_()
    loss = label_loss(q, c, teacher_queries, teacher_candidates, LossWeights(label=1.0))
    loss.backward()
    q_ref, c_ref = queries.clone().requires_grad_(), candidates.clone().requires_grad_()
    scores = 20.0 * F.normalize(q_ref, dim=-1) @ F.normalize(c_ref, dim=-1).T
    reference = F.cross_entropy(
        scores.masked_fill(torch.tensor([[0, 0, 1, 0], [0, 0, 0, 0]]).bool(), -math.inf), torch.arange(2)
    )
    reference.backward()
    assert loss.item() == pytest.approx(reference.item(), rel=1e-5)
    assert torch.allclose(c.grad, c_ref.grad, atol=1e-6) and torch.allclose(q.grad, q_ref.grad, atol=1e-6)
    assert c.grad[2].abs().max().item() > 0  # query 1 still pushes it away


def test_label_loss_averages_the_matryoshka_widths() -> None:
    queries, candidates = random_unit(4, 16, seed=5), random_unit(8, 16, seed=6)
    teacher_queries, teacher_candidates = torch.eye(4, 16), torch.cat([torch.eye(4, 16), -torch.eye(4, 16)])
    weights = LossWeights(label=1.0)
    each = [
        label_loss(truncate(queries, d), truncate(candidates, d), teacher_queries, teacher_candidates, weights)
        for d in (16, 8)
    ]
    both = label_loss(queries, candidates, teacher_queries, teacher_candidates, weights, dims=[16, 8])
    assert both.item() == pytest.approx(sum(e.item() for e in each) / 2, rel=1e-6)


def test_gathered_passages_are_laid_out_positives_first_then_each_negative_slot() -> None:
    """Two ranks of two queries with two negatives each: rank-major rows become positives, first negatives, second."""
    per_rank, ways, world = 2, 3, 2
    rows = []
    for rank in range(world):
        rows += [f"r{rank}q{q}pos" for q in range(per_rank)]
        rows += [f"r{rank}q{q}neg{n}" for q in range(per_rank) for n in range(ways - 1)]
    passages = torch.arange(len(rows), dtype=torch.float32).unsqueeze(1)
    order = [rows[int(i)] for i in by_candidate(passages, world, per_rank).squeeze(1).tolist()]
    queries = ["r0q0", "r0q1", "r1q0", "r1q1"]
    assert order == [f"{q}pos" for q in queries] + [f"{q}neg0" for q in queries] + [f"{q}neg1" for q in queries]
