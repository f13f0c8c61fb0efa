"""What every student shares: the model Accelerate prepares, the projection, the Matryoshka basis and rotation.

`DistillationModel` is the one module Accelerate prepares (DDP wraps student and projection together): it maps
tokenized features to the student's own embedding and to the embedding the loss compares with the teacher
(projected to the teacher's dimension, or the student's own in Matryoshka mode). The projection, the rotation and
the basis are sentence-transformers `Dense` modules, so export reuses them as they are.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from distill.errors import DistillError

if TYPE_CHECKING:
    from sentence_transformers import SentenceTransformer


def embedding_dim(student: SentenceTransformer) -> int:
    getter = getattr(student, "get_embedding_dimension", None) or student.get_sentence_embedding_dimension
    dim = getter()
    if not dim:
        raise DistillError("the student does not report an embedding dimension; use a SentenceTransformer student")
    return int(dim)


class DistillationModel(nn.Module):
    """Student (+ projection), the one module Accelerate prepares.

    forward(*feature_sets) -> [(student_embedding, target_embedding)] per feature set: one DDP forward may
    encode queries and passages of different padded lengths. The target embedding is what the loss
    compares with the teacher: the projection's output in projection mode, the student's own otherwise.
    """

    def __init__(self, student: SentenceTransformer, projection: nn.Module | None = None) -> None:
        super().__init__()
        self.student = student
        self.projection = projection  # a sentence-transformers Dense, so export reuses it as it is
        self.student_dim = embedding_dim(student)

    def forward(self, *feature_sets: dict[str, torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        outputs = []
        for features in feature_sets:
            embedding = self.student(dict(features))["sentence_embedding"]  # (batch, student_dim)
            target = embedding
            if self.projection is not None:
                target = self.projection({"sentence_embedding": embedding})["sentence_embedding"]  # (batch, t_dim)
            outputs.append((embedding, target))
        return outputs


def dense_module() -> type[nn.Module]:
    try:
        from sentence_transformers.sentence_transformer.modules import Dense
    except ImportError:  # sentence-transformers < 6
        from sentence_transformers.models import Dense
    return Dense


def normalize_module() -> nn.Module:
    try:
        from sentence_transformers.sentence_transformer.modules import Normalize
    except ImportError:  # sentence-transformers < 6
        from sentence_transformers.models import Normalize
    return Normalize()


def linear_dense(weight: torch.Tensor, bias: torch.Tensor | None = None) -> nn.Module:
    """A sentence-transformers Dense computing `x @ weight (+ bias)`, no activation; weight is (in_dim, out_dim)."""
    extra = {} if bias is None else {"init_bias": bias.float().contiguous()}
    return dense_module()(
        weight.shape[0],
        weight.shape[1],
        bias=bias is not None,
        activation_function=nn.Identity(),
        init_weight=weight.T.float().contiguous(),
        **extra,
    )


def least_squares_projection(
    student_embeddings: torch.Tensor, teacher_embeddings: torch.Tensor, bias: bool = True
) -> nn.Module:
    """A linear Dense layer (with a bias, unless `bias` is False) fitted to send student vectors to teacher
    vectors, by ridge least squares.

    A projection initialised this way starts from the best linear fit rather than noise, so the first
    steps train the student instead of undoing a random map.
    """
    x = student_embeddings.double()
    y = teacher_embeddings.double()
    if bias:  # (n, s+1): the last column fits the bias
        x = torch.cat([x, torch.ones(len(x), 1, dtype=x.dtype)], dim=1)
    ridge = 1e-3 * torch.eye(x.shape[1], dtype=x.dtype) * (x.pow(2).sum() / len(x))
    solution = torch.linalg.solve(x.T @ x + ridge, x.T @ y)  # (s(+1), t)
    return linear_dense(solution[:-1], solution[-1]) if bias else linear_dense(solution)


def orthogonal_projection(student_embeddings: torch.Tensor, teacher_embeddings: torch.Tensor) -> nn.Module:
    """A bias-free Dense with orthonormal columns (student_dim -> teacher_dim) fitted by orthogonal Procrustes.

    Unlike the least-squares fit it keeps every cosine of the student's own space, so the projected student
    ranks exactly as the student does, while pointing into the teacher's space (for asymmetric search). It is
    scaled so the projected vectors are as long as the teacher's (root mean square): 1 for unit vectors on both
    sides, and for a student without a final Normalize the alignment loss is not spent on its norms.
    """
    if student_embeddings.shape[1] > teacher_embeddings.shape[1]:
        raise DistillError(
            f"an orthogonal projection cannot map {student_embeddings.shape[1]} dimensions into the teacher's "
            f"{teacher_embeddings.shape[1]}; fit a least-squares projection instead"
        )
    rotation = orthogonal_procrustes(student_embeddings, teacher_embeddings)
    scale = _rms_norm(teacher_embeddings) / _rms_norm(student_embeddings).clamp(min=1e-12)
    return linear_dense(rotation * scale.float())


def _rms_norm(vectors: torch.Tensor) -> torch.Tensor:
    return vectors.double().pow(2).sum(dim=1).mean().sqrt()


def pca_basis(vectors: np.ndarray, chunk_size: int = 8192) -> np.ndarray:
    """(dim, dim) orthonormal basis of `vectors`' rows, directions of largest second moment first.

    Uncentred (cosine similarity is about directions from the origin), accumulated over row chunks so a
    memory-mapped cache is never read whole; each column's sign is fixed (largest entry positive) so the
    basis is a deterministic function of the data.
    """
    dim = vectors.shape[1]
    moment = np.zeros((dim, dim), dtype=np.float64)
    for start in range(0, len(vectors), chunk_size):
        rows = np.asarray(vectors[start : start + chunk_size], dtype=np.float64)
        moment += rows.T @ rows
    _, eigenvectors = np.linalg.eigh(moment)  # ascending eigenvalues
    basis = eigenvectors[:, ::-1]
    signs = np.sign(basis[np.abs(basis).argmax(axis=0), np.arange(dim)])
    return (basis * signs).astype(np.float32)


def orthogonal_procrustes(source: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """W with orthonormal rows (source_dim x target_dim, source_dim <= target_dim) minimising |source W - target|.

    A rotation when both dimensions are equal.
    """
    u, _, vh = torch.linalg.svd(source.double().T @ target.double(), full_matrices=False)
    return (u @ vh).float()


def add_rotation(student: SentenceTransformer, rotation: torch.Tensor) -> None:
    """Append a fixed rotation (a bias-free sentence-transformers Dense, frozen) to the student's embedding.

    It goes after pooling and before a final Normalize, so the saved student applies it and loads as it is.
    A rotation changes no cosine: it only decides which coordinates come first when the vector is truncated.
    """
    dense = linear_dense(rotation)
    dense.requires_grad_(False)
    modules = list(student)
    normalize = type(normalize_module())
    at = len(modules) - 1 if modules and isinstance(modules[-1], normalize) else len(modules)
    student._modules = OrderedDict((str(i), m) for i, m in enumerate([*modules[:at], dense, *modules[at:]]))


def check_dimensions(student_dim: int, teacher_dim: int, use_projection: bool, teacher: str = "teacher") -> None:
    if not use_projection and teacher_dim < student_dim:
        raise DistillError(
            f"Matryoshka mode truncates the {teacher}'s {teacher_dim}-d embeddings to the student's {student_dim} "
            f"dimensions, but the {teacher} is narrower; pass --use_projection True, or a student of at most "
            f"{teacher_dim} dimensions"
        )


def matryoshka_dims(student_dim: int, requested: list[int] | None) -> list[int]:
    """The dimensions the MRL loss trains, largest first; defaults to dim, dim/2, dim/4."""
    dims = requested or [student_dim, student_dim // 2, student_dim // 4]
    too_big = [d for d in dims if d > student_dim]
    if too_big:
        raise DistillError(
            f"matryoshka_dims {too_big} exceed the student's {student_dim} dimensions; pass dims up to {student_dim}"
        )
    return sorted({d for d in dims if d > 0} | {student_dim}, reverse=True)
