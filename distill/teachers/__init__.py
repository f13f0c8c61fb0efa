"""Teachers: sources of vectors for texts, one module per kind behind one small interface.

- local.py: a SentenceTransformer loaded here, its forward pass sharded over the processes;
- endpoint.py: an OpenAI-compatible embeddings endpoint (vLLM, text-embeddings-inference, infinity, or a paid
  API), asked by every process for its share of the texts;
- vectors.py: vectors computed before, read from a file (its missing texts, if any, from one of the above);
- reranker.py and rerank_endpoint.py: a cross-encoder, loaded here or served, scoring phase 2's (query, passage)
  pairs rather than embedding texts (`make_reranker`);
- ensemble.py: several of them combined (`--teacher_model A,B`), each cached on its own;
- base.py: the interface (`TeacherKind`, `Source`) and the registry.

A named kind (local, endpoint, or one added with `register_teacher_kind`) makes a `Source` from a
--teacher_model name; `make_source` combines them: several names into an ensemble, a vectors file in front. The
content-keyed cache (distill/stages/targets.py) asks a source what changes its vectors (`identity` and
`key_fields`); on a miss, for an `Encoder` of the texts, which the cache runs over each process's share, block by
block, into a resumable cache entry. The phases, evaluation and the planner see only the cached vectors.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from distill.errors import DistillError
from distill.teachers.endpoint import ENDPOINT
from distill.teachers.local import LOCAL
from distill.teachers.sources import (
    KINDS,
    CachedSource,
    Caches,
    Encoder,
    Source,
    TeacherContext,
    TeacherKind,
    register_teacher_kind,
    teacher_kind,
)

if TYPE_CHECKING:
    from distill.config.schema import RerankerConfig, TeacherConfig

__all__ = [
    "KINDS",
    "CachedSource",
    "Caches",
    "Encoder",
    "Source",
    "TeacherContext",
    "TeacherKind",
    "make_reranker",
    "make_source",
    "members_of",
    "register_teacher_kind",
    "teacher_kind",
]

# the local model claims every name, so it is asked last: registered first
register_teacher_kind(LOCAL)
register_teacher_kind(ENDPOINT)


def check_teacher(config: TeacherConfig) -> None:
    """A run needs a teacher: a model, an endpoint or a vectors file (checked before anything is read or written)."""
    if config.teacher_model is None and config.teacher_vectors is None:
        raise DistillError(
            "teacher_model: expected a Hub name, a model folder or openai/<model>, got nothing; pass --teacher_model "
            "(or --teacher_vectors with vectors computed before)"
        )


def teacher_names(config: TeacherConfig | str | None) -> list[str]:
    """The models --teacher_model names: one, or several (comma-separated) to combine."""
    names = config if isinstance(config, str) or config is None else config.teacher_model
    return [name.strip() for name in (names or "").split(",") if name.strip()]


def runs_here(name: str) -> bool:
    """Whether --teacher_model `name` is one model that runs on this machine."""
    names = teacher_names(name)
    return len(names) == 1 and teacher_kind(names[0]).runs_here


def local_model(config: TeacherConfig) -> str | None:
    """The one teacher model loaded here, or None: an endpoint, several teachers, or vectors alone."""
    names = teacher_names(config)
    return names[0] if len(names) == 1 and teacher_kind(names[0]).runs_here else None


def where(config: TeacherConfig) -> str:
    """What stands behind a teacher that runs elsewhere ("" for models run here): an endpoint, a vectors file."""
    if local_model(config) is not None:
        return ""
    if config.teacher_model is not None:
        return ", ".join(filter(None, (teacher_kind(n).where(n, config) for n in teacher_names(config))))
    return f"vectors from {config.teacher_vectors}"


def members_of(source: Source) -> list[CachedSource]:
    """The caches of the teachers a combined teacher is made of (distill/teachers/ensemble.py); none for any
    other. The combination made them on every process, so their keys are known."""
    return list(getattr(source, "member_caches", []))


def phase1_source(config: TeacherConfig, context: TeacherContext) -> Source:
    """Phase 1's own target (`--phase1_teacher_model`): a model loaded here, with its own prompts."""
    from distill.teachers.local import LocalTeacher, TeacherSpec

    return LocalTeacher(TeacherSpec.from_config(config, context, phase1=True))


def make_source(config: TeacherConfig, context: TeacherContext, caches: Caches, phase1: bool = False) -> Source:
    """The teacher the flags name; with `phase1`, phase 1's own target (`--phase1_teacher_model`) where there is one.

    Each name of --teacher_model is made by its kind; several are combined; `--teacher_vectors PATH` reads vectors
    from a file, its missing texts encoded by the named teacher when there is one.
    """
    if phase1 and config.phase1_teacher_model:
        return phase1_source(config, context)
    names = teacher_names(config)
    model: Source | None = None
    if len(names) == 1:
        model = teacher_kind(names[0]).make(names[0], config, context)
    elif names:
        from distill.teachers.ensemble import EnsembleTeacher

        weights = (
            [float(w) for w in config.teacher_weights.split(",")] if config.teacher_weights else [1.0] * len(names)
        )
        model = EnsembleTeacher([teacher_kind(n).make(n, config, context) for n in names], weights, caches)
    if config.teacher_vectors:
        from distill.teachers.vectors import VectorsTeacher

        files = context.cache_dir / "files" if context.cache_dir is not None else None  # its streamed copy
        return VectorsTeacher(config.teacher_vectors, caches, fill=model, workdir=files)
    assert model is not None, "validated: a teacher_model or teacher_vectors is set"
    return model


def make_reranker(settings: RerankerConfig, context: TeacherContext) -> Source:
    """Phase 2's reranker (--reranker_model): served where --reranker_base_url is given, else loaded here."""
    assert settings.reranker_model is not None, "only called with a reranker"
    if settings.reranker_base_url:
        from distill.teachers.rerank_endpoint import RerankEndpoint

        return RerankEndpoint(
            settings.reranker_model, settings.reranker_base_url, settings.reranker_api_key_env, context.batch_size
        )
    from distill.teachers.reranker import CrossEncoderTeacher

    return CrossEncoderTeacher(settings.reranker_model, context)
