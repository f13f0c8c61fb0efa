"""The metrics, as pure functions of vectors: retrieval nDCG@10 and MRR@10 on held-out queries, STS Spearman.

They are sentence-transformers' own: nDCG@10 and MRR@10 come from `InformationRetrievalEvaluator`'s metric
computation, handed the hits ranked over the gathered vectors (the evaluator itself would encode on one process),
and STS is the Spearman correlation of cosines that its `EmbeddingSimilarityEvaluator` reports. A test checks both
against those evaluators run on an exported model.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch
from scipy.stats import spearmanr
from sentence_transformers.sentence_transformer.evaluation import InformationRetrievalEvaluator

from distill.data.containers import EvalSet, EvalVectors

if TYPE_CHECKING:
    pass


TOP_K = 10


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


def retrieval_ndcg(queries: np.ndarray, corpus: np.ndarray, eval_set: EvalSet) -> float:
    """`set_retrieval`'s nDCG@10 alone."""
    return float(set_retrieval(queries, corpus, eval_set)["ndcg@10"])  # type: ignore[arg-type]


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


RESCORE = 4  # a quantized index: its TOP_K x RESCORE best by the stored codes are rescored with the float query


def ranked(scores: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`top_hits` on a score matrix already computed: each query's TOP_K best rows, best first, ties in row order."""
    ordered = torch.sort(torch.from_numpy(np.ascontiguousarray(scores, dtype=np.float32)), dim=1, descending=True)
    k = min(TOP_K, scores.shape[1])
    return ordered.values[:, :k].numpy(), ordered.indices[:, :k].numpy()


def rescored(queries: np.ndarray, stored: np.ndarray, search: np.ndarray) -> np.ndarray:
    """sentence-transformers' rescoring: each query's TOP_K x RESCORE best by `search` (what the index ranks by),
    scored again as the float query against the `stored` codes; every other row below them all."""
    shortlist = np.argsort(-search, axis=1, kind="stable")[:, : TOP_K * RESCORE]
    scores = np.full(search.shape, -np.inf, dtype=np.float32)
    for row, candidates in enumerate(shortlist):
        scores[row, candidates] = queries[row] @ stored[candidates].T
    return scores


def int8_scores(queries: np.ndarray, corpus: np.ndarray) -> np.ndarray:
    """An int8 index: both sides quantized with the corpus's per-dimension ranges (sentence-transformers'
    `quantize_embeddings`) and searched by their integer dot product, the shortlist rescored."""
    from sentence_transformers.util import quantize_embeddings

    # the int8 codes' dot products (at most 127^2 x dim) are exact in float32 below 1,040 dims, and BLAS runs them
    corpus8 = quantize_embeddings(corpus, "int8", calibration_embeddings=corpus).astype(np.float32)
    queries8 = quantize_embeddings(queries, "int8", calibration_embeddings=corpus).astype(np.float32)
    return rescored(queries, corpus8, queries8 @ corpus8.T)


def binary_scores(queries: np.ndarray, corpus: np.ndarray) -> np.ndarray:
    """A binary index: the corpus's signs packed to bits, searched by Hamming distance to the query's signs, the
    shortlist rescored against the +-1 bits (sentence-transformers' binary search recipe)."""
    from sentence_transformers.util import quantize_embeddings

    signs = np.unpackbits(quantize_embeddings(corpus, "ubinary"), axis=1)[:, : corpus.shape[1]].astype(np.float32)
    query_signs = (queries > 0).astype(np.float32)  # bit counts are exact in float32
    hamming = query_signs @ (1 - signs.T) + (1 - query_signs) @ signs.T  # (queries, corpus)
    return rescored(queries, 2 * signs - 1, -hamming)


INDEX_PRECISIONS = {"int8": (int8_scores, 1.0), "binary": (binary_scores, 1 / 8)}  # scores, bytes per dimension


def index_precision(queries: np.ndarray, corpus: np.ndarray, eval_set: EvalSet) -> dict[str, dict[str, float]]:
    """nDCG@10 and bytes per text with the corpus stored as float32, int8 and binary (with rescoring), as a vector
    database would hold the student's vectors; each dataset of a benchmark ranked in its own corpus."""
    spans: list[tuple[range, range, Relevant]] = [(g.queries, g.corpus, g.relevant) for g in eval_set.groups or []]
    spans = spans or [(range(len(queries)), range(len(corpus)), eval_set.relevant)]
    dim = corpus.shape[1]
    figures = {"float32": {"bytes_per_text": 4.0 * dim, "ndcg@10": retrieval_ndcg(queries, corpus, eval_set)}}
    for name, (score, per_dim) in INDEX_PRECISIONS.items():
        values = []
        for q, c, relevant in spans:
            group_corpus = corpus[c.start : c.stop]
            values.append(
                hits_metrics(*ranked(score(queries[q.start : q.stop], group_corpus)), relevant, len(c))["ndcg@10"]
            )
        figures[name] = {"bytes_per_text": per_dim * dim, "ndcg@10": float(np.mean(values))}
    return figures
