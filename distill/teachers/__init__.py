"""Teachers: sources of vectors for texts, one module per kind behind one small interface.

- local.py: a SentenceTransformer loaded here, its forward pass sharded over the processes;
- endpoint.py: an OpenAI-compatible embeddings endpoint (vLLM, text-embeddings-inference, infinity, or a paid
  API), asked by every process for its share of the texts;
- vectors.py: vectors computed before, read from a file (its missing texts, if any, from one of the above);
- ensemble.py: several of them combined (`--teacher_model A,B`), each cached on its own.

Each kind is a `Source`. The content-keyed cache (distill/teacher.py) asks it what changes its vectors
(`identity` and `key_fields`); on a miss, for an `Encoder` of the texts, which the cache runs over each
process's share, block by block, into a resumable cache entry. The phases, evaluation and the planner see only
the cached vectors. `make_source` picks the kind from the flags.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from distill.errors import DistillError
from distill.teachers.base import ENDPOINT_PREFIX, CachedSource, Caches, Encoder, Source

if TYPE_CHECKING:
    import torch

    from distill.config import Config, ModelConfig

__all__ = ["ENDPOINT_PREFIX", "CachedSource", "Caches", "Encoder", "Source", "make_source", "members_of"]


def check_teacher(config: ModelConfig) -> None:
    """A run needs a teacher: a model, an endpoint or a vectors file (checked before anything is read or written)."""
    if config.teacher_model is None and config.teacher_vectors is None:
        raise DistillError(
            "teacher_model: expected a Hub name, a model folder or openai/<model>, got nothing; pass --teacher_model "
            "(or --teacher_vectors with vectors computed before)"
        )


def teacher_names(config: ModelConfig) -> list[str]:
    """The models --teacher_model names: one, or several (comma-separated) to combine."""
    return [name.strip() for name in (config.teacher_model or "").split(",") if name.strip()]


def local_model(config: ModelConfig) -> str | None:
    """The one teacher model loaded here, or None: an endpoint, several teachers, or vectors alone."""
    names = teacher_names(config)
    return names[0] if len(names) == 1 and not names[0].startswith(ENDPOINT_PREFIX) else None


def members_of(source: Source) -> list[CachedSource]:
    """The caches of the teachers a combined teacher is made of (distill/teachers/ensemble.py); none for any
    other. The combination made them on every process, so their keys are known."""
    return list(getattr(source, "member_caches", []))


def make_source(config: Config, device: torch.device, caches: Caches, phase1: bool = False) -> Source:
    """The teacher the flags name; with `phase1`, phase 1's own target (`--phase1_teacher_model`) where there is one.

    `--teacher_vectors PATH` reads vectors from a file, its missing texts encoded by `--teacher_model` when given;
    `--teacher_model openai/<model>` asks an OpenAI-compatible endpoint; any other name is a model loaded here.
    """
    from distill.teachers.local import LocalTeacher, TeacherSpec

    models = config.model
    if phase1 and models.phase1_teacher_model:
        return LocalTeacher(TeacherSpec.from_config(models, device, phase1=True))

    def one(name: str) -> Source:
        named = replace(models, teacher_model=name)
        if name.startswith(ENDPOINT_PREFIX):
            from distill.teachers.endpoint import EndpointTeacher

            return EndpointTeacher.from_config(named, config.performance.teacher_batch_size)
        return LocalTeacher(TeacherSpec.from_config(named, device), name)

    names = teacher_names(models)
    model: Source | None = one(names[0]) if len(names) == 1 else None
    if len(names) > 1:
        from distill.teachers.ensemble import EnsembleTeacher

        weights = (
            [float(w) for w in models.teacher_weights.split(",")] if models.teacher_weights else [1.0] * len(names)
        )
        model = EnsembleTeacher([one(name) for name in names], weights, caches)
    if models.teacher_vectors:
        from distill.teachers.vectors import VectorsTeacher

        return VectorsTeacher(models.teacher_vectors, caches, fill=model)
    assert model is not None, "validated: a teacher_model or teacher_vectors is set"
    return model
