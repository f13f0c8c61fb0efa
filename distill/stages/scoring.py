"""The evaluation stage: the student and the teacher scored on the held-out set (distill/metrics.py), during and
after each phase, and each phase's best model kept (`--keep_best`).

Every process encodes its share of the evaluation texts and the vectors are gathered, so all ranks
compute the same metrics and none waits alone in a collective. The teacher is scored from its cached
vectors, in the same way, so its row costs no model at all.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from accelerate import Accelerator

from distill.checkpoint import TrainingState
from distill.data.containers import DistillData, EvalSet, EvalVectors
from distill.losses import truncate
from distill.metrics import index_precision, score, set_retrieval
from distill.stages.export import export_models
from distill.stages.initialise import encode_student
from distill.students import kind_of
from distill.students.head import DistillationModel
from distill.students.kinds import StudentDescription
from distill.tokens import TokenizedTexts, cached_tokens

if TYPE_CHECKING:
    from sentence_transformers import SentenceTransformer


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


def evaluate_student(
    accelerator: Accelerator,
    model: DistillationModel,
    inputs: EvalInputs,
    batch_size: int,
    matryoshka_dims: list[int] | None,
) -> dict[str, object]:
    """Metrics of what the exported model's `encode` returns (in float32, whatever the run's mixed precision), plus
    the student's own space where it differs."""
    was_training = model.training
    encoded = {
        name: encode_student(accelerator, model, texts, batch_size, float32=True)
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
    # what a vector database holding these vectors at a lower precision ranks (its bytes per text: the cost table)
    index = index_precision(target.queries, target.corpus, inputs.eval_set)
    metrics["index_ndcg@10"] = {name: figures["ndcg@10"] for name, figures in index.items() if name != "float32"}
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
    token_cache: Path | None = None,
) -> EvalInputs | None:
    """The evaluation set tokenized for the student (once per machine, into `token_cache`), with the teacher's
    vectors of it; None without one."""
    if data.evaluation is None or teacher is None:
        return None
    e, make = data.evaluation, kind_of(student).texts(student)
    texts = partial(cached_tokens, make, student.tokenizer, folder=token_cache, max_length=student.max_seq_length)
    sts = texts(e.sts_texts) if e.sts_texts else None
    return EvalInputs(e, texts(e.queries), texts(e.corpus), sts, teacher, basis)


@dataclass(frozen=True)
class KeepBest:
    """--keep_best: where each phase's best model goes (`<folder>/<phase>`), and what its card says."""

    folder: Path
    settings: dict  # the run's flags, as the card lists them
    student: StudentDescription


class PhaseEvaluation:
    """A phase's evaluations, on every process: every --eval_steps optimizer steps (`periodic`, logged) and at its
    end (`final`); with --keep_best, the best of them is exported to <output_dir>/best/<phase>.

    The end-of-phase model is the one the last periodic evaluation scored when the phase ends on an evaluation
    step, so that evaluation is not made twice.
    """

    def __init__(
        self,
        accelerator: Accelerator,
        evaluation: EvalInputs,
        dims: list[int] | None,
        phase: str,
        state: TrainingState,
        batch_size: int,
        keep: KeepBest | None = None,
    ) -> None:
        self.accelerator, self.evaluation, self.dims = accelerator, evaluation, dims
        self.phase, self.state, self.batch_size, self.keep = phase, state, batch_size, keep
        self.history = state.results.evaluations.setdefault(phase, [])
        self.best = max((h["ndcg@10"] for h in self.history), default=float("-inf"))
        self.last: tuple[int, dict] | None = None  # (optimizer step, metrics) of the last periodic evaluation

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
        return evaluate_student(self.accelerator, model, self.evaluation, self.batch_size, self.dims)

    def _keep_if_best(self, model: DistillationModel, metrics: dict, description: str) -> None:
        keep = self.keep
        if keep is not None and metrics["ndcg@10"] > self.best:
            self.best = metrics["ndcg@10"]
            folder = keep.folder / self.phase
            export_models(self.accelerator, model, folder, keep.settings, description, student=keep.student)
