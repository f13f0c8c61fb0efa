"""Students: what the phases train and sentence-transformers loads.

- a transformer, pruned to some of its layers (distill/student.py, which also holds what every student shares:
  the projection, the Matryoshka basis, the model Accelerate prepares);
- a static table of token vectors, averaged (static.py), for CPUs, phones and browsers.

The phases never ask which kind they train: a kind brings its own loading and its own batches of token ids
(`texts_for`), and the exporter asks it for any folder of its own (a model2vec folder).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING

from distill.batching import FlatTexts, TokenizedTexts
from distill.students.static import StaticTexts, is_static

if TYPE_CHECKING:
    from sentence_transformers import SentenceTransformer

__all__ = ["is_static", "is_static_model", "texts_for"]


def is_static_model(student: SentenceTransformer) -> bool:
    """Whether `student` is a static table (its first module a `StaticEmbedding`)."""
    return type(next(iter(student), None)).__name__ == "StaticEmbedding"


def texts_for(student: SentenceTransformer) -> Callable[..., TokenizedTexts]:
    """How this student's texts are tokenized and batched: padded ids for a transformer, its batch's texts end to end
    for one switched to unpadded attention (distill/students/attention.py), flat ids and offsets for a table."""
    if is_static_model(student):
        return StaticTexts
    offset = getattr(student, "position_offset", None)
    return TokenizedTexts if offset is None else partial(FlatTexts, position_offset=offset)
