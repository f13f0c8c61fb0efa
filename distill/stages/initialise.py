"""The student stage: the student its kind loads, and the projection or the Matryoshka basis fitted to the teacher.

`build_student` asks the student's kind to load it (distill/students), then fits the projection (projection mode)
or the rotation and the teacher's PCA basis (Matryoshka mode) on a sample of the teacher's vectors.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.utils import send_to_device

from distill.distributed import main_decides, progress_bar
from distill.hub import declared_dimension, resolve_model
from distill.sharding import map_sharded
from distill.students import student_kind
from distill.students.head import (
    DistillationModel,
    add_rotation,
    check_dimensions,
    embedding_dim,
    least_squares_projection,
    matryoshka_dims,
    orthogonal_procrustes,
    orthogonal_projection,
    pca_basis,
)
from distill.students.kinds import LoadContext
from distill.teachers import check_teacher, local_model
from distill.tokens import TokenizedTexts

if TYPE_CHECKING:
    from distill.config.schema import ModeConfig, StudentConfig, TeacherConfig
    from distill.stages.targets import TeacherVectors

PROJECTION_FIT_SAMPLES = 4096
TEACHER, PHASE1_TEACHER = "teacher", "phase-1 teacher"  # whose vectors the projection or basis is fitted on


PCA_FIT_SAMPLES = 32768  # rows of the teacher's vectors its principal axes are computed from (a 3584-d teacher: ~1 min)


@dataclass(frozen=True)
class Fitting:
    """How the projection, the rotation and the basis are fitted: seeded samples, student batches of this size, on
    the vectors of the model `target` names (in errors)."""

    seed: int
    batch_size: int
    target: str = TEACHER


def build_student(
    accelerator: Accelerator,
    settings: StudentConfig,
    mode: ModeConfig,
    context: LoadContext,
    fitting: Fitting,
    teacher_dim: int,
    fit_texts: Sequence[str],
    fit_targets: np.ndarray | None,
) -> tuple[DistillationModel, list[int] | None, np.ndarray | None]:
    """The student stage: the student; a fitted projection in projection mode, MRL dims (and basis) otherwise.

    Returns (model, Matryoshka dims or None, teacher basis or None). The basis (teacher_dim x student_dim,
    orthonormal columns) is what the teacher's vectors are multiplied by before truncation in MRL mode. The
    projection, rotation and basis are fitted on `fit_texts` and the teacher's vectors of them, `fit_targets`.
    """
    kind = student_kind(settings.student_model)
    student = kind.load(settings, context)
    student.to(accelerator.device)
    student_dim = embedding_dim(student)
    check_dimensions(student_dim, teacher_dim, mode.use_projection, fitting.target)
    texts, targets = fit_texts, fit_targets
    assert targets is not None, "a projection or basis needs the teacher's vectors of the fitting texts"
    sample = np.random.default_rng(fitting.seed).permutation(len(texts))[:PROJECTION_FIT_SAMPLES]
    sample.sort()
    tokens = kind.texts(student)(student.tokenizer, [texts[i] for i in sample], student.max_seq_length)
    student_vectors, _ = encode_student(accelerator, DistillationModel(student), tokens, fitting.batch_size)
    sampled_targets = np.asarray(targets[sample], dtype=np.float32)
    if mode.use_projection:
        # an orthonormal map keeps every cosine of the student (docs/QUALITY.md); a student wider than its teacher
        # has none, and gets the least-squares fit, with a bias unless its kind folds the projection in after a
        # Normalize (a static table)
        wide = partial(least_squares_projection, bias=kind.projection_bias)
        fit = orthogonal_projection if student_dim <= teacher_dim else wide
        projection = fit(torch.from_numpy(student_vectors), torch.from_numpy(sampled_targets))  # fitted on the CPU
        return DistillationModel(student, projection.to(accelerator.device)), None, None
    # MRL with a PCA basis: the teacher's coordinates ordered by variance, so its truncations keep the most;
    # the student gets the fixed rotation that best lines its own space up with that basis.
    basis = fit_basis(accelerator, targets, student_dim, fitting.seed)
    rotated = torch.nn.functional.normalize(torch.from_numpy(sampled_targets @ basis), dim=-1)
    add_rotation(student, orthogonal_procrustes(torch.from_numpy(student_vectors), rotated).to(accelerator.device))
    return DistillationModel(student), matryoshka_dims(student_dim, mode.matryoshka_dims), basis


def fit_basis(accelerator: Accelerator, targets: np.ndarray, student_dim: int, seed: int) -> np.ndarray:
    """The first `student_dim` principal axes of a seeded sample of `targets` (dim x student_dim, orthonormal)."""
    rows = np.sort(np.random.default_rng(seed).permutation(len(targets))[:PCA_FIT_SAMPLES])
    return main_decides(accelerator, lambda: pca_basis(targets[rows])[:, :student_dim])


def phase_bases(
    accelerator: Accelerator,
    fitting: Fitting,
    model: DistillationModel,
    basis: np.ndarray | None,
    teacher: TeacherVectors,
) -> dict[str, np.ndarray | None]:
    """The teacher basis each phase (and the evaluation, as phase 2) reads its targets in.

    `basis` is the one `build_student` fitted on phase 1's targets. Where `phase1_teacher_model` gives phase 1
    another target than the teacher (`fitting.target` is not the teacher), the teacher gets its own basis, fitted on
    its phase-2 passages: phase 2 compares similarities only, so the two spaces need not match.
    """
    if fitting.target == TEACHER:
        return {"phase1": basis, "phase2": basis}
    student_dim = embedding_dim(model.student)
    check_dimensions(student_dim, teacher.dim, use_projection=False)
    own = None
    if basis is not None and teacher.passages is not None:
        own = fit_basis(accelerator, teacher.passages, student_dim, fitting.seed)
    return {"phase1": basis, "phase2": own}


def encode_student(
    accelerator: Accelerator,
    model: DistillationModel,
    texts: TokenizedTexts,
    batch_size: int,
    float32: bool = False,
) -> tuple[np.ndarray, np.ndarray]:
    """(student-space, target-space) vectors of `texts`, computed sharded across processes; under the run's mixed
    precision, or in float32 (`float32`), as the exported model's `encode` computes them."""
    model.eval()
    device = accelerator.device
    # `prepare` wraps the instance's forward in the run's autocast (Accelerate's mixed precision); the class's
    # forward is the model without it
    forward = partial(type(model).forward, model) if float32 else model
    precision = nullcontext if float32 else accelerator.autocast

    def encode(indices: list[int]) -> torch.Tensor:
        features = send_to_device(texts.features(indices), device)  # ints (FlatTexts' longest text) stay
        with torch.no_grad(), precision():
            student, target = forward(features)[0]
        return torch.cat([student.float(), target.float()], dim=1)

    hint = f"lower --max_seq_length (the student reads up to {texts.max_length} tokens)"
    bar = progress_bar(accelerator, len(texts.lengths), "student: evaluation texts", unit="text", leave=False)
    with bar:
        both = map_sharded(accelerator, texts.lengths, batch_size, encode, too_long_hint=hint, progress=bar.update)
    assert both is not None  # no sink: the vectors come back
    return both[:, : model.student_dim], both[:, model.student_dim :]


def check_declared_dimensions(teacher: TeacherConfig, student: StudentConfig, mode: ModeConfig) -> None:
    """Matryoshka mode: teacher at least as wide as the student, --matryoshka_dims no wider, from the folders' configs.

    Checked before the teacher encodes (hours, for a large one), not after.
    """
    check_teacher(teacher)
    if mode.use_projection:
        return
    local = local_model(teacher)  # an endpoint's or a file's width is known once it answers
    teacher_dim = declared_dimension(resolve_model(local, teacher.teacher_revision)) if local else None
    student_dim = student_kind(student.student_model).declared_dim(student, teacher)
    if teacher_dim and student_dim:
        check_dimensions(student_dim, teacher_dim, use_projection=False)
    if student_dim:
        matryoshka_dims(student_dim, mode.matryoshka_dims)
