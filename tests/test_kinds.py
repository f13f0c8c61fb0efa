"""A kind of student and a kind of teacher defined here, in the test alone, run through both phases, evaluation and
export: the seams distill/students/kinds.py and distill/teachers/sources.py are all a new kind needs."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from sentence_transformers import SentenceTransformer

from conftest import tiny_run_flags
from distill.config import load_config
from distill.errors import DistillError
from distill.students import KINDS as STUDENT_KINDS
from distill.students import register_student_kind, student_kind
from distill.students.kinds import ExtraFolder, LoadContext, StudentDescription, StudentKind
from distill.teachers import KINDS as TEACHER_KINDS
from distill.teachers import TeacherContext, register_teacher_kind
from distill.teachers.sources import Encoder, TeacherKind
from distill.tokens import TokenizedTexts
from distill.train import main

TOY_DIM = 24


class HashedTeacher:
    """A teacher whose vector of a text is a seeded random unit vector of its words' hashes, summed."""

    name = path = "toy/hashed"
    revision = None
    max_seq_length = None
    loaded = False
    load_seconds = 0.0
    cost_note = "a hashed teacher has no size"

    def __init__(self, calls: list[int]) -> None:
        self.calls = calls  # texts encoded, per call

    def prompt(self, role: str) -> str:
        return ""

    def identity(self, accelerator: object, memo: Path) -> str:
        return "toy-hashed-1"

    def key_fields(self, role: str) -> dict[str, object]:
        return {"dim": TOY_DIM}

    def encoder(self, accelerator: object, texts: list[str], role: str) -> Encoder:
        def encode(indices: list[int]) -> torch.Tensor:
            self.calls.append(len(indices))
            rows = [hashed_vector(texts[i]) for i in indices]
            return torch.nn.functional.normalize(torch.from_numpy(np.stack(rows)), dim=1)

        return Encoder(lengths=np.array([len(t) for t in texts]), encode=encode)

    def cost(self, accelerator: object, texts: object, costs: object) -> None:
        return None

    def release(self) -> None:
        pass


def hashed_vector(text: str) -> np.ndarray:
    total = np.zeros(TOY_DIM, dtype=np.float32)
    for word in text.lower().split():
        seed = int.from_bytes(hashlib.sha256(word.encode()).digest()[:4], "little")
        total += np.random.default_rng(seed).standard_normal(TOY_DIM).astype(np.float32)
    return total if total.any() else np.ones(TOY_DIM, dtype=np.float32)


class HashedTeacherKind(TeacherKind):
    name = "hashed"
    scope = "a hashed teacher"
    how = "pass --teacher_model toy/hashed"
    runs_here = False

    def __init__(self) -> None:
        self.calls: list[int] = []

    def claims(self, name: str) -> bool:
        return name.startswith("toy/")

    def make(self, name: str, settings: object, context: TeacherContext) -> HashedTeacher:
        return HashedTeacher(self.calls)


class FrozenBodyKind(StudentKind):
    """A SentenceTransformer folder named `toy:<folder>`, trained with every layer but the last frozen."""

    name = "frozen body"
    scope = "a frozen-body student"
    how = "pass --student_model toy:<folder>"

    def __init__(self) -> None:
        self.loaded: list[LoadContext] = []
        self.batched = 0

    def claims(self, name: str) -> bool:
        return name.startswith("toy:")

    def holds(self, model: SentenceTransformer) -> bool:
        return bool(getattr(model, "frozen_body", False))

    def describe(self, settings: object, teacher: object) -> StudentDescription:
        return StudentDescription(base_model=self.folder(settings), token_limit=32, done="with a frozen body")

    def load(self, settings: object, context: LoadContext) -> SentenceTransformer:
        self.loaded.append(context)
        student = SentenceTransformer(self.folder(settings), device="cpu")
        student.max_seq_length = 32
        for parameter in student.parameters():
            parameter.requires_grad_(False)
        layers = student[0].auto_model.encoder.layer
        for parameter in layers[-1].parameters():
            parameter.requires_grad_(True)
        student.frozen_body = True
        return student

    def texts(self, model: SentenceTransformer) -> type[TokenizedTexts]:
        self.batched += 1
        return TokenizedTexts

    def deployable(self, student: SentenceTransformer, head: list) -> SentenceTransformer:
        exported = super().deployable(student, head)
        exported.frozen_body = True
        return exported

    def extra_folders(self, deployable: SentenceTransformer) -> dict[str, ExtraFolder]:
        def save(folder: Path, card: str) -> None:
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "kind.txt").write_text(self.name)

        return {"frozen-body": ExtraFolder("The same student, noted by its kind.", save)}

    @staticmethod
    def folder(settings: object) -> str:
        return str(settings.student_model).removeprefix("toy:")  # type: ignore[attr-defined]


@pytest.fixture
def toy_kinds() -> Iterator[tuple[FrozenBodyKind, HashedTeacherKind]]:
    student, teacher = FrozenBodyKind(), HashedTeacherKind()
    register_student_kind(student)
    register_teacher_kind(teacher)
    try:
        yield student, teacher
    finally:
        STUDENT_KINDS.remove(student)
        TEACHER_KINDS.remove(teacher)


def test_a_kind_defined_outside_the_package_runs_both_phases_evaluation_and_export(
    toy_kinds, tiny_models, tiny_data, tmp_path
) -> None:
    student_kind_, teacher_kind_ = toy_kinds
    out = tmp_path / "toy"
    flags = tiny_run_flags(
        tiny_models, tiny_data, out, teacher_model="toy/hashed", student_model=f"toy:{tiny_models['student']}"
    )
    assert main([*flags, "--save_to_artifacts", "True"]) == 0
    results = json.loads((out / "results.json").read_text())
    assert set(results["phases"]) == {"phase1", "phase2"}
    assert results["phases"]["phase2"]["optimizer_steps"] > 0
    assert results["teacher"]["ndcg@10"] > 0 and results["student_after"]["ndcg@10"] > 0
    assert len(student_kind_.loaded) == 1 and student_kind_.batched >= 3  # fitting, both phases, evaluation
    assert sum(teacher_kind_.calls) > 0  # every vector the run learnt came from the hashed teacher
    folder = Path(results["exported"]["model"])
    exported = SentenceTransformer(str(folder), device="cpu")
    vectors = exported.encode(["a query about the sea", "a passage"])
    assert vectors.shape == (2, TOY_DIM)  # projected into the hashed teacher's space
    assert (out / "artifacts" / "frozen-body" / "kind.txt").read_text() == "frozen body"
    card = (folder / "README.md").read_text()
    assert "from teacher `toy/hashed`" in card and "with a frozen body" in card


def test_a_kind_owns_its_options_and_a_new_kind_is_refused_the_others(toy_kinds, tiny_models) -> None:
    """Options the built-in kinds own apply only to them; the message names the kind that takes each."""
    toy = f"toy:{tiny_models['student']}"
    assert student_kind(toy) is toy_kinds[0]
    with pytest.raises(DistillError, match="student_num_layers: applies only to a transformer student"):
        load_config(["--teacher_model", "toy/hashed", "--student_model", toy, "--student_num_layers", "1"])
    with pytest.raises(DistillError, match="teacher_base_url: applies only to an endpoint teacher"):
        load_config(["--teacher_model", "toy/hashed", "--student_model", toy, "--teacher_base_url", "http://x"])
