"""The teacher interface: what every kind of teacher (a `Source`) gives the content-keyed cache.

distill/teachers/__init__.py picks the kind from the flags; each kind is one module beside this one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

if TYPE_CHECKING:
    import torch
    from accelerate import Accelerator

    from distill.cache import Role
    from distill.efficiency import CostTexts, ModelCost, TeacherCosts

ENDPOINT_PREFIX = "openai/"  # --teacher_model openai/<model>, as LiteLLM and others name a provider's model


@dataclass
class Encoder:
    """How a source encodes one list of texts: a call per batch, which the cache runs over each process's share."""

    lengths: np.ndarray  # a size per text; the longest go first, so a batch size that fits them fits the rest
    encode: Callable[[Any], torch.Tensor]  # a batch's indices (or `prepare`'s result) -> (batch, dim) unit vectors
    prepare: Callable[[list[int]], Any] | None = None  # run in a thread one batch ahead (tokenizing)
    too_long_hint: str = "lower the max sequence length or run on a device with more memory"
    check: Callable[[np.ndarray, np.ndarray], None] | None = None  # (vectors, their text rows): raises on bad ones
    done: Callable[[], None] | None = None  # called once every batch is encoded (a summary line)
    batch_size: int | None = None  # texts per call; None: the cache's (--teacher_batch_size)


class Source(Protocol):
    """A teacher: what changes its vectors, and how it encodes texts. Also what a cache entry's manifest records."""

    @property
    def name(self) -> str:
        """The teacher as results.json, the logs and the model card name it."""
        ...

    @property
    def path(self) -> str:
        """The model folder, Hub name, endpoint model or vectors file."""
        ...

    @property
    def revision(self) -> str | None: ...

    @property
    def max_seq_length(self) -> int | None: ...

    @property
    def loaded(self) -> bool:
        """Whether a model was loaded here to encode."""
        ...

    @property
    def load_seconds(self) -> float: ...

    @property
    def cost_note(self) -> str | None:
        """Where `cost` returns None, or a cost without a size: why, for the trade-off line."""
        ...

    def prompt(self, role: Role) -> str: ...

    def identity(self, accelerator: Accelerator, memo: Path) -> str:
        """What the teacher is: its weights' digest, the endpoint's model, the vectors file's (may be collective)."""
        ...

    def key_fields(self, role: Role) -> dict[str, object]:
        """What else changes its vectors of `role` texts: prompt, length, dtype, dimensions."""
        ...

    def encoder(self, accelerator: Accelerator, texts: list[str], role: Role) -> Encoder: ...

    def cost(self, accelerator: Accelerator, texts: CostTexts, costs: TeacherCosts) -> ModelCost | None:
        """Its size and speed on this machine (kept in `costs`), or None where no comparable figure exists."""
        ...

    def release(self) -> None:
        """Free what encoding held (a model's weights) before the student trains."""
        ...


class Caches(Protocol):
    """The cache a source that draws on others (a vectors file's fill, an ensemble's members) reads them through."""

    def __call__(self, source: Source) -> CachedSource: ...


class CachedSource(Protocol):
    """A source behind the content-keyed cache (distill.teacher.TeacherCache)."""

    source: Source
    seconds: float

    def embeddings(self, texts: list[str], role: Role) -> np.ndarray: ...

    def key(self, texts: list[str], role: Role) -> str: ...

    def cost(self, texts: CostTexts, key: str) -> ModelCost | None: ...
