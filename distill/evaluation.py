"""Evaluation: retrieval nDCG@10 / MRR@10 on held-out queries, STS Spearman, and agreement with the teacher.

Every process encodes its share of the evaluation texts and the vectors are gathered, so all ranks
compute the same metrics and none waits alone in a collective. The teacher is scored from its cached
vectors, in the same way, so its row costs no model at all.

The metrics are sentence-transformers' own: nDCG@10 and MRR@10 come from `InformationRetrievalEvaluator`'s metric
computation, handed the hits ranked over the gathered vectors (the evaluator itself would encode on one process),
and STS is the Spearman correlation of cosines that its `EmbeddingSimilarityEvaluator` reports. A test checks both
against those evaluators run on an exported model.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from accelerate import Accelerator
from scipy.stats import spearmanr
from sentence_transformers.sentence_transformer.evaluation import InformationRetrievalEvaluator

from distill.batching import TokenizedTexts
from distill.checkpoint import TrainingState
from distill.config import Config, to_flat_dict
from distill.data import DistillData, EvalSet, EvalVectors
from distill.export import export_models
from distill.losses import truncate
from distill.student import DistillationModel, encode_student
from distill.students import texts_for

if TYPE_CHECKING:
    from sentence_transformers import SentenceTransformer

TOP_K = 10


@dataclass
class EvalInputs:
    """The evaluation set tokenized once for the student, and the teacher's cached vectors of it."""

    eval_set: EvalSet
    queries: TokenizedTexts
    corpus: TokenizedTexts
    sts: TokenizedTexts | None
    teacher: EvalVectors
    # MRL with a basis: (teacher_dim, student_dim), the teacher's vectors as the student was trained to match them
    teacher_basis: np.ndarray | None = None


def _unit(vectors: np.ndarray) -> np.ndarray:
    return vectors / np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)


def top_hits(queries: np.ndarray, corpus: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per query, the cosines and corpus rows of its 10 best passages, best first, equal scores in corpus order.

    That order is the one sentence-transformers' `InformationRetrievalEvaluator` ranks by (score, then corpus id).
    Returns `(scores, rows)`, each of shape (queries, min(10, corpus)).
    """
    scores = torch.from_numpy(_unit(queries) @ _unit(corpus).T)  # (queries, corpus)
    ordered = torch.sort(scores, dim=1, descending=True, stable=True)  # stable: a tie keeps the lower row first
    k = min(TOP_K, scores.shape[1])
    return ordered.values[:, :k].numpy(), ordered.indices[:, :k].numpy()


Relevant = list[int] | list[set[int]]  # per query: its one relevant corpus row, or the set of them


def ranks_of(rows: np.ndarray, relevant: Relevant) -> np.ndarray:
    """Per query, the 0-based position of its (first) relevant passage in its `top_hits` rows; -1 outside them."""
    if relevant and isinstance(relevant[0], set):
        hits = np.array([[row in judged for row in query_rows] for query_rows, judged in zip(rows.tolist(), relevant)])
    else:
        hits = rows == np.asarray(relevant)[:, None]  # (queries, k): at most one True per row
    hits = hits.reshape(rows.shape)
    return np.where(hits.any(axis=1), hits.argmax(axis=1), -1)


def retrieval_ranks(queries: np.ndarray, corpus: np.ndarray, relevant: list[int]) -> np.ndarray:
    """Per query, the 0-based rank of its one relevant passage among the top 10 by cosine; -1 outside them."""
    return ranks_of(top_hits(queries, corpus)[1], relevant)


def ndcg_per_query(ranks: np.ndarray) -> np.ndarray:
    """nDCG@10 of each query from its rank (one relevant passage: 1 / log2(rank + 2), 0 outside the top 10).

    Its mean is the evaluator's nDCG@10 (`hits_metrics`); the quality benchmark's paired bootstrap needs it per query.
    """
    ranks = np.asarray(ranks)
    return np.where(ranks >= 0, 1.0 / np.log2(np.maximum(ranks, 0) + 2.0), 0.0)


def hits_metrics(scores: np.ndarray, rows: np.ndarray, relevant: Relevant, corpus_size: int) -> dict[str, float]:
    """nDCG@10 and MRR@10 of ranked hits (`top_hits`), by sentence-transformers' `InformationRetrievalEvaluator`.

    The evaluator encodes with its model on one process; distill encodes sharded over every process and gathers,
    so it hands the evaluator's own metric computation (`compute_metrics`) the hits ranked from those vectors.
    """
    width = len(str(max(corpus_size - 1, 0)))
    corpus_id = [f"{row:0{width}d}" for row in range(corpus_size)]  # zero-padded: id order is row order, for ties
    judged: list[set[int]] = [r if isinstance(r, set) else {r} for r in relevant]
    evaluator = InformationRetrievalEvaluator(
        queries={str(i): "" for i in range(len(relevant))},  # the texts are not needed: the hits are given
        corpus=dict.fromkeys(corpus_id, ""),
        relevant_docs={str(i): {corpus_id[r] for r in rows_of} for i, rows_of in enumerate(judged)},
        mrr_at_k=[TOP_K],
        ndcg_at_k=[TOP_K],
        accuracy_at_k=[TOP_K],
        precision_recall_at_k=[TOP_K],
        map_at_k=[TOP_K],
        write_csv=False,
    )
    hits = [
        [{"corpus_id": corpus_id[row], "score": value} for row, value in zip(query_rows, query_scores)]
        for query_rows, query_scores in zip(rows.tolist(), scores.tolist())
    ]
    metrics = evaluator.compute_metrics(hits)
    return {"ndcg@10": float(metrics["ndcg@k"][TOP_K]), "mrr@10": float(metrics["mrr@k"][TOP_K])}


def retrieval_metrics(queries: np.ndarray, corpus: np.ndarray, relevant: Relevant) -> dict[str, float]:
    """nDCG@10 and MRR@10 with one relevant passage per query (or a set of them), by cosine similarity."""
    return hits_metrics(*top_hits(queries, corpus), relevant, len(corpus))


def set_retrieval(queries: np.ndarray, corpus: np.ndarray, eval_set: EvalSet) -> dict[str, object]:
    """nDCG@10, MRR@10 and each query's rank (`ranks@10`) on the evaluation set.

    A benchmark of several datasets (`eval_set.groups`, NanoBEIR) ranks each query against its own dataset's corpus
    and averages the datasets' scores, as sentence-transformers' `NanoBEIREvaluator` does; `datasets_ndcg@10` then
    holds each dataset's nDCG@10.
    """
    if not eval_set.groups:
        scores, rows = top_hits(queries, corpus)
        return {
            **hits_metrics(scores, rows, eval_set.relevant, len(corpus)),
            "ranks@10": ranks_of(rows, eval_set.relevant).tolist(),
        }
    by_group: dict[str, dict[str, float]] = {}
    ranks: list[int] = []
    for group in eval_set.groups:
        group_corpus = corpus[group.corpus.start : group.corpus.stop]
        scores, rows = top_hits(queries[group.queries.start : group.queries.stop], group_corpus)
        by_group[group.name] = hits_metrics(scores, rows, group.relevant, len(group_corpus))
        ranks += ranks_of(rows, group.relevant).tolist()
    return {
        "ndcg@10": float(np.mean([m["ndcg@10"] for m in by_group.values()])),
        "mrr@10": float(np.mean([m["mrr@10"] for m in by_group.values()])),
        "ranks@10": ranks,
        "datasets_ndcg@10": {name: m["ndcg@10"] for name, m in by_group.items()},
    }


def sts_spearman(vectors: np.ndarray, pairs: list[tuple[int, int]], scores: list[float]) -> float:
    unit = _unit(vectors)
    left, right = np.asarray(pairs).T
    cosine = (unit[left] * unit[right]).sum(axis=1)
    rho = float(spearmanr(cosine, scores).statistic)
    return rho if np.isfinite(rho) else 0.0  # constant vectors (a degenerate model) carry no ranking


def score(vectors: EvalVectors, eval_set: EvalSet, teacher: EvalVectors | None = None) -> dict[str, object]:
    """All metrics of one set of vectors; `teacher` (same space) adds the mean cosine to the teacher.

    `ranks@10` keeps each query's rank (`retrieval_ranks`), so two models scored on the same set can be
    compared query by query (the quality benchmark's paired bootstrap); it is not a scalar, so trackers skip it.
    """
    metrics = set_retrieval(vectors.queries, vectors.corpus, eval_set)
    if vectors.sts is not None and eval_set.sts_pairs:
        metrics["sts_spearman"] = sts_spearman(vectors.sts, eval_set.sts_pairs, eval_set.sts_scores)
    if teacher is not None:
        stacked = np.concatenate([vectors.queries, vectors.corpus])
        reference = np.concatenate([teacher.queries, teacher.corpus])
        metrics["teacher_cosine"] = float((_unit(stacked) * _unit(reference)).sum(axis=1).mean())
    return metrics


def evaluate_student(
    accelerator: Accelerator,
    model: DistillationModel,
    inputs: EvalInputs,
    batch_size: int,
    matryoshka_dims: list[int] | None,
) -> dict[str, object]:
    """Metrics of what the exported model's `encode` returns, plus the student's own space where it differs."""
    was_training = model.training
    encoded = {
        name: encode_student(accelerator, model, texts, batch_size)
        for name, texts in (("queries", inputs.queries), ("corpus", inputs.corpus), ("sts", inputs.sts))
        if texts is not None
    }
    model.train(was_training)
    target = EvalVectors(encoded["queries"][1], encoded["corpus"][1], encoded["sts"][1] if "sts" in encoded else None)
    teacher = inputs.teacher
    if matryoshka_dims:  # MRL: compare with the teacher (in the training basis) truncated to the student's dimension
        if inputs.teacher_basis is not None:
            teacher = rotated(teacher, inputs.teacher_basis)
        teacher = truncated(teacher, target.queries.shape[1])
    metrics: dict[str, object] = score(target, inputs.eval_set, teacher)
    if model.projection is not None:
        own = EvalVectors(encoded["queries"][0], encoded["corpus"][0], None)
        metrics["ndcg@10_student_dim"] = set_retrieval(own.queries, own.corpus, inputs.eval_set)["ndcg@10"]
        # Asymmetric retrieval: the exported student's (projected) queries against an index the teacher built.
        metrics["ndcg@10_asymmetric"] = set_retrieval(target.queries, teacher.corpus, inputs.eval_set)["ndcg@10"]
    if matryoshka_dims:
        metrics["matryoshka_ndcg@10"] = {
            str(d): set_retrieval(_truncate_np(target.queries, d), _truncate_np(target.corpus, d), inputs.eval_set)[
                "ndcg@10"
            ]
            for d in matryoshka_dims
        }
    return metrics


def _truncate_np(vectors: np.ndarray, dim: int) -> np.ndarray:
    return truncate(torch.from_numpy(np.ascontiguousarray(vectors, dtype=np.float32)), dim).numpy()


def rotated(vectors: EvalVectors, basis: np.ndarray) -> EvalVectors:
    return EvalVectors(
        vectors.queries @ basis,
        vectors.corpus @ basis,
        vectors.sts @ basis if vectors.sts is not None else None,
    )


def truncated(vectors: EvalVectors, dim: int) -> EvalVectors:
    return EvalVectors(
        _truncate_np(vectors.queries, dim),
        _truncate_np(vectors.corpus, dim),
        _truncate_np(vectors.sts, dim) if vectors.sts is not None else None,
    )


def evaluate_teacher(inputs: EvalInputs) -> dict[str, object]:
    return score(inputs.teacher, inputs.eval_set)


def eval_inputs(
    student: SentenceTransformer,
    data: DistillData,
    teacher: EvalVectors | None,
    basis: np.ndarray | None = None,
) -> EvalInputs | None:
    """The evaluation set tokenized for the student, with the teacher's vectors of it; None without one."""
    if data.evaluation is None or teacher is None:
        return None
    e, tok, length, texts = data.evaluation, student.tokenizer, student.max_seq_length, texts_for(student)
    return EvalInputs(
        e,
        texts(tok, e.queries, length),
        texts(tok, e.corpus, length),
        texts(tok, e.sts_texts, length) if e.sts_texts else None,
        teacher,
        basis,
    )


class PhaseEvaluation:
    """A phase's evaluations, on every process: every --eval_steps optimizer steps (`periodic`, logged) and at its
    end (`final`); with --keep_best, the best of them is exported to <output_dir>/best/<phase>.

    The end-of-phase model is the one the last periodic evaluation scored when the phase ends on an evaluation
    step, so that evaluation is not made twice.
    """

    def __init__(
        self,
        accelerator: Accelerator,
        config: Config,
        evaluation: EvalInputs,
        dims: list[int] | None,
        phase: str,
        state: TrainingState,
        output_dir: Path,
    ) -> None:
        self.accelerator, self.config, self.evaluation, self.dims = accelerator, config, evaluation, dims
        self.phase, self.state, self.output_dir = phase, state, output_dir
        self.history = state.results.evaluations.setdefault(phase, [])
        self.best = max((h["ndcg@10"] for h in self.history), default=float("-inf"))
        self.last: tuple[int, dict] | None = None  # (optimizer step, metrics) of the last periodic evaluation
        self.keep_best = config.checkpoint.keep_best and config.checkpoint.eval_steps > 0

    def periodic(self, model: DistillationModel, step: int) -> None:
        metrics = self._evaluate(model)
        scalars = {k: v for k, v in metrics.items() if isinstance(v, float)}
        self.history.append({"step": step, **scalars})
        self.accelerator.log({f"{self.phase}/eval/{k}": v for k, v in scalars.items()}, step=self.state.global_step())
        self.last = (step, metrics)
        self._keep_if_best(model, metrics, f"best of {self.phase} at optimizer step {step}: {scalars}")

    def final(self, model: DistillationModel, step: int) -> dict:
        """The metrics of the model the phase ends with, at its last optimizer step `step`."""
        if self.last is not None and self.last[0] == step:
            return self.last[1]  # scored (and compared) by the periodic evaluation of that step
        metrics = self._evaluate(model)
        scalars = {k: v for k, v in metrics.items() if isinstance(v, float)}
        self._keep_if_best(model, metrics, f"best of {self.phase}: its end, optimizer step {step}: {scalars}")
        return metrics

    def _evaluate(self, model: DistillationModel) -> dict:
        batch_size = 2 * self.config.training.batch_size
        return evaluate_student(self.accelerator, model, self.evaluation, batch_size, self.dims)

    def _keep_if_best(self, model: DistillationModel, metrics: dict, description: str) -> None:
        if self.keep_best and metrics["ndcg@10"] > self.best:
            self.best = metrics["ndcg@10"]
            export_models(
                self.accelerator, model, self.output_dir / "best" / self.phase, to_flat_dict(self.config), description
            )
