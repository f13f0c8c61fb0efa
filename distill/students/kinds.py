"""The student interface: what each kind of student answers, and the registry that finds the kind of a name.

A kind is one module beside this one (transformer.py, static.py) holding one `StudentKind`; distill/students/__init__.py
registers the built-in ones, and `register_student_kind` adds another from any code. The run, the config checks,
the planner, the cost stage, export and the model card ask the kind. None of them test a name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from distill.registry import Registry

if TYPE_CHECKING:
    import torch
    from sentence_transformers import SentenceTransformer

    from distill.config.constraints import Scope
    from distill.config.schema import StudentConfig, TeacherConfig
    from distill.hub import ModelShape
    from distill.stages.cost import CostTexts, ModelCost
    from distill.tokens import TokenizedTexts


@dataclass(frozen=True)
class StudentDescription:
    """What a student is before any weight is loaded: what the checks, the teacher, the planner and the card read."""

    base_model: str  # the model the card names as the student's base
    token_limit: int | None  # the tokens it reads of a text (the teacher reads as many); None: unknown, or all
    done: str = ""  # what the run does to the model, as the card says it: "cut to 3 evenly spaced layers"


@dataclass(frozen=True)
class StudentFigures:
    """The planner's view of a student: configs and tokenizer only."""

    folder: Path  # whose tokenizer counts the student's tokens
    shape: ModelShape
    reads_every_token: bool = False
    table_source: Path | None = None  # a table distilled here: the model each vocabulary token runs through


@dataclass(frozen=True)
class LoadContext:
    """What loading a student may use besides its own settings."""

    device: torch.device
    mixed_precision: str
    teacher: TeacherConfig
    cache_dir: Path  # where a kind keeps what it builds for the next run (a distilled table)
    teacher_dtype: str  # the teacher's compute dtype on this device, for a kind that runs the teacher's model
    share: tuple[int, int] = (0, 1)  # this process's index among the machine's processes, and their count
    wait: Callable[[], object] = lambda: None  # the machine's processes' barrier
    gradient_checkpointing: bool = False


@dataclass(frozen=True)
class ExtraFolder:
    """A folder a kind exports beside the SentenceTransformer one: a note for its card, and its writer."""

    note: str
    save: Callable[..., object]  # save(staging folder, card=the card's text)


class StudentKind:
    """One kind of student. A kind answers:

    - `claims(name)`: whether a --student_model name is of this kind (the first registered kind that claims it wins);
    - `options`: the flags only this kind takes; `refuses(settings)`: those it turns down for this name;
    - `describe`, `declared_dim` and `figures`: what it is without loading weights, for the run and the planner;
    - `load`: the SentenceTransformer the phases train, and `holds(model)`: whether a loaded model is of this kind;
    - `texts`: how its texts are tokenized and batched; `deployable`, `extra_folders`: what export writes;
      `runtime_cost`: a figure of its own for the cost stage; `onnx_transformer`: what its ONNX forms export.
    """

    name = ""  # as the logs say it
    scope = ""  # as an option's rule says it: "a transformer student"
    how = ""  # how a user chooses this kind: "pass a transformer's name to --student_model"
    options: tuple[str, ...] = ()
    projection_bias = True  # a fitted projection (a student wider than its teacher) has a bias

    def claims(self, name: str) -> bool:
        raise NotImplementedError

    def holds(self, model: SentenceTransformer) -> bool:
        raise NotImplementedError

    def refuses(self, settings: StudentConfig) -> dict[str, Scope]:
        """Options of this kind that this name turns down, each with where it applies instead."""
        return {}

    def describe(self, settings: StudentConfig, teacher: TeacherConfig) -> StudentDescription:
        raise NotImplementedError

    def declared_dim(self, settings: StudentConfig, teacher: TeacherConfig) -> int | None:
        """Its output width where known before loading (a config's, a table's); None: read once loaded."""
        return None

    def figures(self, settings: StudentConfig, teacher: TeacherConfig) -> StudentFigures:
        raise NotImplementedError

    def load(self, settings: StudentConfig, context: LoadContext) -> SentenceTransformer:
        raise NotImplementedError

    def texts(self, model: SentenceTransformer) -> Callable[..., TokenizedTexts]:
        from distill.tokens import TokenizedTexts

        return TokenizedTexts

    def deployable(self, student: SentenceTransformer, head: list[Any]) -> SentenceTransformer:
        """The model users get: the student, then `head` (a projection) and a final Normalize where it has none."""
        from sentence_transformers import SentenceTransformer

        from distill.students.head import normalize_module

        normalize = normalize_module()
        if not head and isinstance(student[-1], type(normalize)):
            return student
        exported = SentenceTransformer(modules=[*student, *head, normalize], device=str(student.device))
        exported.max_seq_length = student.max_seq_length
        return exported

    def extra_folders(self, deployable: SentenceTransformer) -> dict[str, ExtraFolder]:
        return {}

    def runtime_cost(self, student: SentenceTransformer, texts: CostTexts) -> ModelCost | None:
        return None

    def onnx_transformer(self, deployable: SentenceTransformer) -> Any | None:
        """The module an ONNX form of the deployable exports (token ids in, token vectors out), or None: this kind
        has no ONNX form."""
        return None


REGISTRY: Registry[StudentKind] = Registry("student")
KINDS = REGISTRY.kinds  # newest first
register_student_kind = REGISTRY.register  # a kind registered later is asked first
student_kind = REGISTRY.claiming  # the kind of student a --student_model name is


def kind_of(model: SentenceTransformer) -> StudentKind:
    """The kind of a loaded student."""
    for kind in KINDS:
        if kind.holds(model):
            return kind
    raise ValueError(f"no student kind holds a {type(model).__name__}")
