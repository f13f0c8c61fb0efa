"""The run's text lists as the planner reads them: read as the run reads them, a seeded sample of each tokenized by
the teacher's and the student's tokenizers, prompts included."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from distill.config.schema import Config
from distill.errors import DistillError
from distill.hub import declared_max_seq_length, tokenizer_of
from distill.plan.figures import Models, TextList
from distill.plan.host import DataReading
from distill.store import Role

if TYPE_CHECKING:
    from distill.config.schema import TeacherConfig
    from distill.teachers import Source


SAMPLE = 2000  # texts per list tokenized for the length statistics


def length_stats(tokenizer: Any, texts: Sequence[str], prompt: str, max_length: int | None) -> tuple[float, float, int]:
    """(mean, mean square, max) of the texts' lengths in tokens, as the model reads them."""
    if not texts:
        return 0.0, 0.0, 0
    encoded = tokenizer(
        [prompt + t for t in texts],
        truncation=max_length is not None,
        max_length=max_length,
        add_special_tokens=True,
        verbose=False,  # untruncated (an endpoint's texts) longer than the tokenizer's own limit is no error here
    )
    lengths = [len(ids) for ids in encoded["input_ids"]]
    return sum(lengths) / len(lengths), sum(n * n for n in lengths) / len(lengths), max(lengths)


def tokenize_seconds(tokenizer: Any, texts: Sequence[str], passes: int = 2) -> float:
    """Seconds per text the run's tokenizing takes on this machine: the texts in chunks as the run cuts them, through
    the run's own call (no truncation), the best of `passes` (the first pays the tokenizer's warm-up)."""
    from distill.tokens import TOKENIZE_CHUNK, ids_of

    encode, best = ids_of(tokenizer), float("inf")
    for _ in range(passes):
        started = time.perf_counter()
        for start in range(0, len(texts), TOKENIZE_CHUNK):
            encode(texts[start : start + TOKENIZE_CHUNK])
        best = min(best, time.perf_counter() - started)
    return best / max(len(texts), 1)


def sample(texts: Sequence[str], seed: int) -> list[str]:
    import numpy as np

    if len(texts) <= SAMPLE:
        return list(texts)
    chosen = np.random.default_rng(seed).choice(len(texts), SAMPLE, replace=False)
    return [texts[i] for i in sorted(chosen)]


def text_lists(
    config: Config, need_phase1: bool, need_phase2: bool
) -> tuple[dict[str, tuple[str, Role, Sequence[str]]], DataReading]:
    """{name: (phase, role, texts)} for every list the teacher encodes, read as the run reads them; and what reading
    them cost here (seconds, resident bytes before and after)."""
    from distill.data import load_data
    from distill.data.containers import passage_texts
    from distill.plan.devices import peak_bytes, resident_bytes

    before, started = resident_bytes(), time.perf_counter()
    data = load_data(config.data, config.training.seed, need_phase1, need_phase2)
    seconds, after = time.perf_counter() - started, peak_bytes()
    lists: dict[str, tuple[str, Role, Sequence[str]]] = {}
    if need_phase1 and data.phase1_texts:
        lists["phase1 texts"] = ("phase1", "document", data.phase1_texts)
    if need_phase2 and len(data.phase2):
        lists["phase2 queries"] = ("phase2", "query", data.phase2.queries)
        lists["phase2 passages"] = ("phase2", "document", passage_texts(data.phase2)[0])
    if data.evaluation is not None:
        lists["evaluation queries"] = ("evaluation", "query", data.evaluation.queries)
        lists["evaluation corpus"] = ("evaluation", "document", data.evaluation.corpus)
        if data.evaluation.sts_texts:
            lists["evaluation sts"] = ("evaluation", "document", data.evaluation.sts_texts)
    count = sum(len(texts) for _, _, texts in lists.values())
    text_bytes = sum(len(text.encode("utf8")) for _, _, texts in lists.values() for text in texts)
    return lists, DataReading(seconds, before, after, count, text_bytes)


@dataclass(frozen=True)
class RemoteTeacher:
    """An endpoint's or a vectors file's prompts, as the planner reads texts: the flags' own, no length limit."""

    settings: TeacherConfig
    max_seq_length: int | None = None

    def prompt(self, role: Role) -> str:
        given = self.settings.teacher_query_prompt if role == "query" else self.settings.teacher_document_prompt
        return given or ""


def own_token_limit(folder: Path, spec: Source | RemoteTeacher) -> int | None:
    """The token limit a local teacher's folder declares, which it reads up to when the run gives none; None for
    an endpoint or a file (whole texts), or a folder that declares none."""
    return None if isinstance(spec, RemoteTeacher) else declared_max_seq_length(folder)


def measure_texts(
    config: Config, lists: dict[str, tuple[str, Role, Sequence[str]]], models: Models
) -> tuple[list[TextList], str]:
    """Every text list of the run (`text_lists`) with its lengths in both tokenizers; which tokenizer counted
    the teacher's. Phase 1's own target, if any, counts phase 1's texts with its tokenizer and prompts."""
    teacher_folder, student_folder, phase1_folder = models.teacher_folder, models.student_folder, models.phase1_folder
    from distill.pipeline import teacher_context
    from distill.teachers import phase1_source, teacher_kind, teacher_names

    settings, training = config.teacher, config.training
    context = teacher_context(config, "cpu")
    spec: Source | RemoteTeacher = RemoteTeacher(settings)  # an endpoint's or a file's: the prompts given
    here = [name for name in teacher_names(settings) if teacher_kind(name).runs_here]
    if here:  # prompts and length limit as the run's (first) teacher run here reads them
        spec = teacher_kind(here[0]).make(here[0], settings, context)
    student_tokenizer = tokenizer_of(student_folder)
    if student_tokenizer is None:
        raise DistillError(f"the planner needs the student's tokenizer; {student_folder} has none")
    own = tokenizer_of(teacher_folder)
    teacher_tokenizer = own or student_tokenizer
    # a teacher given no limit reads up to its own (an endpoint: the whole text)
    teacher_encoder = (teacher_tokenizer, spec, spec.max_seq_length or own_token_limit(teacher_folder, spec))
    phase1_encoder = teacher_encoder
    if phase1_folder is not None:
        phase1_spec = phase1_source(settings, context)
        phase1_limit = phase1_spec.max_seq_length or own_token_limit(phase1_folder, phase1_spec)
        phase1_encoder = (tokenizer_of(phase1_folder) or student_tokenizer, phase1_spec, phase1_limit)
    reads_all = models.student_figures.reads_every_token
    student_length = None if reads_all else config.student.max_seq_length or spec.max_seq_length
    measured = []
    for name, (phase, role, texts) in lists.items():
        chosen = sample(texts, training.seed)
        tokenizer, encoder, limit = phase1_encoder if phase == "phase1" else teacher_encoder
        t_mean, t_square, t_max = length_stats(tokenizer, chosen, encoder.prompt(role), limit)
        s_mean, s_square, s_max = length_stats(student_tokenizer, chosen, "", student_length)
        per_text = tokenize_seconds(student_tokenizer, chosen)
        measured.append(TextList(name, phase, len(texts), t_mean, t_square, s_mean, s_square, s_max, t_max, per_text))
    return (
        measured,
        "the student's tokenizer (the teacher runs elsewhere)"
        if isinstance(spec, RemoteTeacher)
        else ("the first teacher's tokenizer" if len(models.teachers) > 1 else "the teacher's tokenizer")
        if own is not None
        else "the student's tokenizer (the teacher's folder has none)",
    )


def scale_counts(measured: list[TextList], phase1_texts: int | None, phase2_pairs: int | None) -> list[TextList]:
    """The lists with their counts set to what the real run will read; lengths stay the sample's."""
    scaled = []
    for t in measured:
        count = t.count
        if t.phase == "phase1" and phase1_texts:
            count = phase1_texts
        elif t.phase == "phase2" and phase2_pairs:
            queries = next(q.count for q in measured if q.name == "phase2 queries")
            count = phase2_pairs * t.count // max(queries, 1)  # passages: the positive and any negatives per pair
        scaled.append(replace(t, count=count))
    return scaled


def token_counts(measured: list[TextList]) -> dict[str, dict[str, float]]:
    """Each phase's tokens, as the teacher and as the student read them."""
    phases = list(dict.fromkeys(t.phase for t in measured))
    return {
        phase: {
            "teacher": sum(t.total_teacher_tokens for t in measured if t.phase == phase),
            "student": sum(t.total_student_tokens for t in measured if t.phase == phase),
        }
        for phase in phases
    }
