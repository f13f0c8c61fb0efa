"""Evaluation metrics on constructed examples, and the student evaluation against direct encoding."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from accelerate import Accelerator
from scipy.stats import spearmanr
from sentence_transformers import SentenceTransformer

from conftest import sentences
from distill.data.containers import EvalSet, EvalVectors
from distill.metrics import ndcg_per_query, retrieval_metrics, retrieval_ranks, score, sts_spearman
from distill.stages.scoring import EvalInputs, evaluate_student, evaluate_teacher, truncated
from distill.students.head import DistillationModel, least_squares_projection
from distill.tokens import TokenizedTexts


def one_hot(index: int, dim: int, scale: float = 1.0) -> np.ndarray:
    vector = np.zeros(dim)
    vector[index] = scale
    return vector


def corpus_with_scores(scores: list[float]) -> tuple[np.ndarray, np.ndarray]:
    """One query (1, 0) and a corpus whose cosine with it is exactly each score."""
    query = np.array([[1.0, 0.0]])
    corpus = np.array([[s, math.sqrt(1 - s * s)] for s in scores])
    return query, corpus


# ---------------------------------------------------------------- retrieval


def test_perfect_ranking() -> None:
    vectors = np.eye(5)
    metrics = retrieval_metrics(vectors, vectors.copy(), [0, 1, 2, 3, 4])
    assert metrics == {"ndcg@10": pytest.approx(1.0), "mrr@10": pytest.approx(1.0)}


def test_relevant_at_rank_two() -> None:
    query, corpus = corpus_with_scores([0.9, 0.8, 0.1, 0.5])
    metrics = retrieval_metrics(query, corpus, [1])
    assert metrics["ndcg@10"] == pytest.approx(1 / math.log2(3))
    assert metrics["mrr@10"] == pytest.approx(0.5)


def test_relevant_at_rank_five() -> None:
    query, corpus = corpus_with_scores([0.95, 0.9, 0.85, 0.8, 0.75, 0.7])
    metrics = retrieval_metrics(query, corpus, [4])
    assert metrics["ndcg@10"] == pytest.approx(1 / math.log2(6))
    assert metrics["mrr@10"] == pytest.approx(0.2)


def test_relevant_outside_top_ten_scores_zero() -> None:
    scores = [0.99 - 0.05 * i for i in range(15)]  # strictly decreasing
    query, corpus = corpus_with_scores(scores)
    assert retrieval_metrics(query, corpus, [10]) == {"ndcg@10": 0.0, "mrr@10": 0.0}
    at_ten = retrieval_metrics(query, corpus, [9])
    assert at_ten["ndcg@10"] == pytest.approx(1 / math.log2(11))
    assert at_ten["mrr@10"] == pytest.approx(0.1)


def test_metrics_average_over_queries_and_use_cosine() -> None:
    corpus = np.array([one_hot(i, 4) for i in range(4)])
    # query 0 hits its passage; query 1 prefers passage 3 over its own passage 2; lengths do not matter
    queries = np.array([one_hot(0, 4, scale=7.0), [0.0, 0.0, 0.5, 0.9]])
    metrics = retrieval_metrics(queries, corpus * 3.0, [0, 2])
    assert metrics["ndcg@10"] == pytest.approx((1 + 1 / math.log2(3)) / 2)
    assert metrics["mrr@10"] == pytest.approx(0.75)


def test_ranks_per_query_give_the_metrics() -> None:
    corpus = np.array([one_hot(i, 12) for i in range(12)])
    # query 0 finds its passage first, query 1 its passage second, query 2 prefers ten passages to its own
    queries = np.array([one_hot(0, 12), 0.9 * one_hot(3, 12) + 0.5 * one_hot(1, 12), np.r_[np.ones(10), 0.1, 0.0]])
    ranks = retrieval_ranks(queries, corpus, [0, 1, 10])
    assert ranks.tolist() == [0, 1, -1]
    np.testing.assert_allclose(ndcg_per_query(ranks), [1.0, 1 / math.log2(3), 0.0])
    eval_set = EvalSet(queries=["a", "b", "c"], corpus=[str(i) for i in range(12)], relevant=[0, 1, 10])
    metrics = score(EvalVectors(queries, corpus, None), eval_set)
    assert metrics["ranks@10"] == [0, 1, -1]
    assert metrics["ndcg@10"] == pytest.approx(ndcg_per_query(ranks).mean())


def test_equal_scores_rank_in_corpus_order_as_sentence_transformers_does() -> None:
    queries, corpus = np.ones((3, 4)), np.ones((12, 4))  # every passage scores the same for every query
    assert retrieval_ranks(queries, corpus, [0, 3, 11]).tolist() == [0, 3, -1]
    metrics = retrieval_metrics(queries, corpus, [0, 3, 11])
    assert metrics["ndcg@10"] == pytest.approx((1 + 1 / math.log2(5)) / 3)
    assert metrics["mrr@10"] == pytest.approx((1 + 1 / 4) / 3)


def test_per_query_ndcg_averages_to_the_evaluators_ndcg() -> None:
    """The quality benchmark's paired bootstrap takes nDCG per query from the ranks; its mean is the reported one."""
    rng = np.random.default_rng(3)
    queries, corpus = rng.standard_normal((40, 6)), rng.standard_normal((60, 6))
    relevant = rng.integers(0, 60, size=40).tolist()
    eval_set = EvalSet([f"q{i}" for i in range(40)], [f"p{j}" for j in range(60)], relevant)
    metrics = score(EvalVectors(queries, corpus, None), eval_set)
    ranks = np.asarray(metrics["ranks@10"])
    assert (ranks >= 0).any() and (ranks == -1).any()  # both kinds of query count
    assert metrics["ndcg@10"] == pytest.approx(ndcg_per_query(ranks).mean(), abs=1e-12)
    mrr = np.where(ranks >= 0, 1 / (np.maximum(ranks, 0) + 1.0), 0.0).mean()
    assert metrics["mrr@10"] == pytest.approx(mrr, abs=1e-12)


def test_fewer_passages_than_ten() -> None:
    query, corpus = corpus_with_scores([0.2, 0.6, 0.4])
    assert retrieval_metrics(query, corpus, [0])["mrr@10"] == pytest.approx(1 / 3)


# ---------------------------------------------------------------- STS


def test_sts_spearman_equals_scipy() -> None:
    rng = np.random.default_rng(0)
    vectors = rng.standard_normal((8, 5))
    pairs = [(i, j) for i in range(8) for j in range(i + 1, 8)]
    scores = rng.random(len(pairs)).tolist()
    unit = vectors / np.linalg.norm(vectors, axis=1, keepdims=True)
    cosines = [float(unit[i] @ unit[j]) for i, j in pairs]
    expected = spearmanr(cosines, scores).statistic
    assert sts_spearman(vectors, pairs, scores) == pytest.approx(expected, abs=1e-12)


def test_sts_spearman_perfect_and_reversed() -> None:
    angles = np.array([0.0, 0.3, 0.9, 1.4])
    vectors = np.stack([np.cos(angles), np.sin(angles)], axis=1)
    pairs = [(0, 1), (0, 2), (0, 3)]
    assert sts_spearman(vectors, pairs, [0.9, 0.5, 0.1]) == pytest.approx(1.0)
    assert sts_spearman(vectors, pairs, [0.1, 0.5, 0.9]) == pytest.approx(-1.0)


@pytest.mark.filterwarnings("ignore::scipy.stats.ConstantInputWarning")
def test_sts_spearman_of_constant_vectors_is_zero() -> None:
    vectors = np.ones((4, 3))
    assert sts_spearman(vectors, [(0, 1), (1, 2), (2, 3)], [0.1, 0.5, 0.9]) == 0.0


# ---------------------------------------------------------------- score


def test_score_adds_sts_and_teacher_cosine() -> None:
    corpus = np.eye(3)
    eval_set = EvalSet(
        queries=["a", "b", "c"],
        corpus=["x", "y", "z"],
        relevant=[0, 1, 2],
        sts_texts=["s", "t", "u"],
        sts_pairs=[(0, 1), (0, 2), (1, 2)],
        sts_scores=[0.9, 0.1, 0.5],
    )
    angles = np.array([0.0, 0.2, 1.2])
    sts = np.stack([np.cos(angles), np.sin(angles)], axis=1)
    vectors = EvalVectors(corpus.copy(), corpus.copy(), sts)
    teacher = EvalVectors(corpus.copy(), corpus.copy(), None)
    metrics = score(vectors, eval_set, teacher)
    assert metrics["ndcg@10"] == pytest.approx(1.0)
    assert metrics["teacher_cosine"] == pytest.approx(1.0)
    assert metrics["sts_spearman"] == pytest.approx(1.0)
    assert evaluate_teacher(
        EvalInputs(eval_set, None, None, None, vectors)  # type: ignore[arg-type]
    ) == {k: v for k, v in metrics.items() if k != "teacher_cosine"}

    orthogonal = EvalVectors(np.roll(corpus, 1, axis=1), np.roll(corpus, 1, axis=1), None)
    assert score(vectors, eval_set, orthogonal)["teacher_cosine"] == pytest.approx(0.0)
    no_sts = score(EvalVectors(corpus, corpus, None), eval_set)
    assert "sts_spearman" not in no_sts and "teacher_cosine" not in no_sts


def test_truncated_renormalises_every_part() -> None:
    vectors = EvalVectors(np.array([[3.0, 4.0, 5.0]]), np.array([[0.0, 2.0, 1.0]]), None)
    cut = truncated(vectors, 2)
    np.testing.assert_allclose(cut.queries, [[0.6, 0.8]], atol=1e-6)
    np.testing.assert_allclose(cut.corpus, [[0.0, 1.0]], atol=1e-6)
    assert cut.sts is None


# ---------------------------------------------------------------- student evaluation


def student_with_projection(tiny_models: dict[str, Path]) -> tuple[SentenceTransformer, torch.nn.Module]:
    """The tiny 32-d student and a fixed 32 -> 48 projection."""
    student = SentenceTransformer(str(tiny_models["student"]), device="cpu")
    generator = torch.Generator().manual_seed(0)
    projection = least_squares_projection(
        torch.randn(128, 32, generator=generator), torch.randn(128, 48, generator=generator)
    )
    return student, projection


def tokenized_inputs(student: SentenceTransformer, eval_set: EvalSet, teacher: EvalVectors) -> EvalInputs:
    """The evaluation set tokenized for `student` (no STS), with the given teacher vectors."""
    return EvalInputs(
        eval_set,
        TokenizedTexts(student.tokenizer, eval_set.queries, student.max_seq_length),
        TokenizedTexts(student.tokenizer, eval_set.corpus, student.max_seq_length),
        None,
        teacher,
    )


def test_evaluate_student_matches_direct_encoding(
    accelerator: Accelerator, tiny_models: dict[str, Path], capsys: pytest.CaptureFixture
) -> None:
    student, projection = student_with_projection(tiny_models)
    model = DistillationModel(student, projection)
    model.train()
    queries, corpus = sentences(12, seed=1), sentences(20, seed=2)
    relevant = list(range(12))
    eval_set = EvalSet(queries, corpus, relevant)
    rng = np.random.default_rng(0)
    teacher = EvalVectors(rng.standard_normal((12, 48)), rng.standard_normal((20, 48)), None)
    inputs = tokenized_inputs(student, eval_set, teacher)
    metrics = evaluate_student(accelerator, model, inputs, batch_size=5, matryoshka_dims=None)
    assert model.training  # restored after evaluation
    bar = capsys.readouterr().err.replace("\r", "\n")
    assert "student: evaluation texts" in bar and "/20 " in bar  # a bar over the encoded texts, cleared after

    own_q, own_c = student.encode(queries), student.encode(corpus)
    with torch.no_grad():
        proj_q = projection({"sentence_embedding": torch.from_numpy(own_q)})["sentence_embedding"].numpy()
        proj_c = projection({"sentence_embedding": torch.from_numpy(own_c)})["sentence_embedding"].numpy()
    expected = score(EvalVectors(proj_q, proj_c, None), eval_set, teacher)
    for name, value in expected.items():
        assert metrics[name] == pytest.approx(value, abs=1e-4), name
    assert metrics["ndcg@10_student_dim"] == pytest.approx(
        retrieval_metrics(own_q, own_c, relevant)["ndcg@10"], abs=1e-4
    )
    assert "matryoshka_ndcg@10" not in metrics


def test_asymmetric_retrieval_scores_student_queries_against_teacher_corpus(
    accelerator: Accelerator, tiny_models: dict[str, Path]
) -> None:
    student, projection = student_with_projection(tiny_models)
    model = DistillationModel(student, projection)
    queries, corpus = sentences(8, seed=5), sentences(14, seed=6)
    relevant = [7 - i for i in range(8)]  # query i's passage sits at corpus row 7 - i
    eval_set = EvalSet(queries, corpus, relevant)
    with torch.no_grad():
        own_q = torch.from_numpy(student.encode(queries))
        projected_q = projection({"sentence_embedding": own_q})["sentence_embedding"].numpy()  # (8, 48)
    rng = np.random.default_rng(2)
    # Teacher queries are noise: a score that used them (or the student's corpus) would not match below.
    teacher = EvalVectors(rng.standard_normal((8, 48)), rng.standard_normal((14, 48)), None)
    inputs = tokenized_inputs(student, eval_set, teacher)
    for corpus_vectors in (rng.standard_normal((14, 48)), np.roll(projected_q, 1, axis=1).repeat(2, axis=0)[:14]):
        teacher.corpus = corpus_vectors
        metrics = evaluate_student(accelerator, model, inputs, batch_size=3, matryoshka_dims=None)
        expected = retrieval_metrics(projected_q, corpus_vectors, relevant)["ndcg@10"]
        assert metrics["ndcg@10_asymmetric"] == pytest.approx(expected, abs=1e-4)
        symmetric = retrieval_metrics(teacher.queries, corpus_vectors, relevant)["ndcg@10"]
        assert expected != pytest.approx(symmetric)  # the check can tell student queries from teacher ones


def test_evaluate_student_matryoshka(accelerator: Accelerator, tiny_models: dict[str, Path]) -> None:
    student = SentenceTransformer(str(tiny_models["student"]), device="cpu")
    model = DistillationModel(student)
    queries, corpus = sentences(10, seed=3), sentences(15, seed=4)
    eval_set = EvalSet(queries, corpus, list(range(10)))
    rng = np.random.default_rng(1)
    teacher = EvalVectors(rng.standard_normal((10, 48)), rng.standard_normal((15, 48)), None)
    inputs = EvalInputs(
        eval_set,
        TokenizedTexts(student.tokenizer, queries, 64),
        TokenizedTexts(student.tokenizer, corpus, 64),
        None,
        teacher,
    )
    metrics = evaluate_student(accelerator, model, inputs, batch_size=4, matryoshka_dims=[32, 16, 8])
    own_q, own_c = student.encode(queries), student.encode(corpus)
    assert "ndcg@10_student_dim" not in metrics
    assert "ndcg@10_asymmetric" not in metrics  # only in projection mode, where the spaces are the teacher's
    assert set(metrics["matryoshka_ndcg@10"]) == {"32", "16", "8"}
    for dim in (32, 16, 8):
        expected = retrieval_metrics(own_q[:, :dim], own_c[:, :dim], list(range(10)))["ndcg@10"]
        assert metrics["matryoshka_ndcg@10"][str(dim)] == pytest.approx(expected, abs=1e-4)
    # the teacher is compared after truncation to the student's 32 dims
    cut = truncated(teacher, 32)
    expected_cosine = score(EvalVectors(own_q, own_c, None), eval_set, cut)["teacher_cosine"]
    assert metrics["teacher_cosine"] == pytest.approx(expected_cosine, abs=1e-4)
    # with a basis, the teacher is first put in the basis the student was trained in, then truncated
    basis = np.linalg.qr(rng.standard_normal((48, 48)))[0][:, :32]
    inputs.teacher_basis = basis
    metrics = evaluate_student(accelerator, model, inputs, batch_size=4, matryoshka_dims=[32, 16, 8])
    in_basis = truncated(EvalVectors(teacher.queries @ basis, teacher.corpus @ basis, None), 32)
    expected_cosine = score(EvalVectors(own_q, own_c, None), eval_set, in_basis)["teacher_cosine"]
    assert metrics["teacher_cosine"] == pytest.approx(expected_cosine, abs=1e-4)
    assert metrics["teacher_cosine"] != pytest.approx(
        score(EvalVectors(own_q, own_c, None), eval_set, cut)["teacher_cosine"], abs=1e-4
    )  # the basis made a difference the check above can see
