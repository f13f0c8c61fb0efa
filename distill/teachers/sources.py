"""The teacher interface: what every kind of teacher answers (`TeacherKind`), and what the `Source` it makes gives
the content-keyed cache.

Each kind is one module beside this one; distill/teachers/__init__.py registers the built-in ones and combines
them (several teachers, a vectors file); `register_teacher_kind` adds another from any code.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from distill.registry import Registry

if TYPE_CHECKING:
    import torch
    from accelerate import Accelerator

    from distill.config.schema import TeacherConfig
    from distill.hub import ModelShape
    from distill.stages.cost import CostTexts, ModelCost, TeacherCosts
    from distill.store import Role


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

    def encoder(self, accelerator: Accelerator, texts: Sequence[str], role: Role) -> Encoder: ...

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
    """A source behind the content-keyed cache (distill.stages.targets.TeacherCache)."""

    source: Source
    seconds: float

    def embeddings(self, texts: Sequence[str], role: Role) -> np.ndarray: ...

    def key(self, texts: Sequence[str], role: Role) -> str: ...

    def cost(self, texts: CostTexts, key: str) -> ModelCost | None: ...


@dataclass(frozen=True)
class TeacherContext:
    """What a teacher takes from the rest of the run."""

    device: torch.device | str
    student_tokens: int | None = None  # the student's token limit, which the teacher reads too unless told otherwise
    trust_remote_code: bool = False
    batch_size: int | None = None  # texts per forward pass or request (--teacher_batch_size)
    cache_dir: Path | None = None  # the teacher cache's folder: a kind may keep what it prepares there


class TeacherKind:
    """One kind of teacher, named by --teacher_model. A kind answers:

    - `claims(name)`: whether a name is of this kind (the first registered kind that claims it wins);
    - `options`: the flags only this kind takes;
    - `runs_here`: whether its model runs on this machine (its config and tokenizer are here to read);
    - `make`: the `Source` the cache encodes with; `where`: what stands behind it, when it runs elsewhere;
    - `figures`: its config's folder and shape for the planner (None: it costs nothing here).
    """

    name = ""
    scope = ""  # as an option's rule says it: "an endpoint teacher"
    how = ""  # how a user chooses this kind: "pass --teacher_model openai/<model>"
    options: tuple[str, ...] = ()
    runs_here = True

    def claims(self, name: str) -> bool:
        raise NotImplementedError

    def make(self, name: str, settings: TeacherConfig, context: TeacherContext) -> Source:
        raise NotImplementedError

    def where(self, name: str, settings: TeacherConfig) -> str:
        return ""

    def figures(self, name: str, settings: TeacherConfig, trust_remote_code: bool) -> tuple[Path, ModelShape] | None:
        return None


REGISTRY: Registry[TeacherKind] = Registry("teacher")
KINDS = REGISTRY.kinds  # newest first
register_teacher_kind = REGISTRY.register  # a kind registered later is asked first
teacher_kind = REGISTRY.claiming  # the kind of teacher a --teacher_model name is
