"""Export the trained student as folders that `SentenceTransformer(path)` loads and uses as they are.

- `<artifacts_dir>/model`: what users deploy. In projection mode it ends with the trained Dense projection
  and a Normalize, so `encode` returns teacher-space vectors that can query an index the teacher built. In
  Matryoshka mode it is the student, given a final Normalize if it has none: unit vectors in both modes.
- `<artifacts_dir>/student`: projection mode only, the student at its own dimension.

Each folder is written by sentence-transformers' own `save` into a temporary folder, with a model card
(training settings and the evaluation table), then renamed into place: a crash never leaves half a model.
Only the main process writes; everyone waits for it.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from accelerate import Accelerator

from distill.distributed import on_main_process
from distill.errors import DistillError
from distill.student import DistillationModel, matryoshka_dims, normalize_module

if TYPE_CHECKING:
    from sentence_transformers import SentenceTransformer


def deployable_model(model: DistillationModel) -> SentenceTransformer:
    """The SentenceTransformer users get: the student, then projection + Normalize in projection mode.

    In Matryoshka mode a student that does not end with a Normalize gets one: the losses compare re-normalised
    vectors, so its own norms were never trained, and a dot product on them would rank by noise.
    """
    from sentence_transformers import SentenceTransformer

    student = model.student
    normalize = normalize_module()
    head = [] if model.projection is None else [model.projection]
    if not head and isinstance(student[-1], type(normalize)):
        return student
    modules = [*student, *head, normalize]
    exported = SentenceTransformer(modules=modules, device=str(student.device))
    exported.max_seq_length = student.max_seq_length
    return exported


def export_models(
    accelerator: Accelerator, model: DistillationModel, artifacts_dir: str | os.PathLike, settings: dict, table: str
) -> dict[str, str]:
    """Write the exported model folder(s), each with its model card (`settings`, the evaluation `table`).

    Returns {name: path}. Collective: every process must call it.
    """
    root = Path(artifacts_dir).expanduser()
    student_dims = {"student": model.student_dim}  # no "output": no projection in the folder
    model_dims = student_dims if model.projection is None else {**student_dims, "output": model.projection.out_features}
    trained = matryoshka_dims(model.student_dim, settings.get("matryoshka_dims")) if model.projection is None else None
    card = model_card(settings, table, model_dims, matryoshka=trained)
    targets = {"model": (root / "model", deployable_model(model), card)}
    if model.projection is not None:
        note = (
            f"This folder is the student at its own {model.student_dim} dimensions, without the projection "
            "(the folder `model` beside it has it): it scores as the `ndcg@10_student_dim` row."
        )
        targets["student"] = (root / "student", model.student, model_card(settings, table, student_dims, note))

    def write() -> None:
        for path, sentence_transformer, folder_card in targets.values():
            save_atomic(sentence_transformer, path, folder_card)

    on_main_process(accelerator, write)
    return {name: str(path) for name, (path, _, _) in targets.items()}


def save_atomic(sentence_transformer: SentenceTransformer, target: Path, card: str) -> None:
    """sentence-transformers' save into `<target>.tmp`, card added, then swapped in for any previous export.

    The folder is saved without prompts: the student was distilled on unprompted texts, so the prompts it
    came with would make `encode_query`/`encode_document` feed it inputs it was not trained on.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.parent / f".{target.name}.tmp-{os.getpid()}"
    previous = target.parent / f".{target.name}.old-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    try:
        with no_prompts(sentence_transformer):
            sentence_transformer.save(str(staging), create_model_card=False)
        (staging / "README.md").write_text(card)
        if target.exists():
            os.replace(target, previous)
        os.replace(staging, target)
    except BaseException as e:
        shutil.rmtree(staging, ignore_errors=True)  # whatever failed, no half-written folder stays behind
        if previous.exists() and not target.exists():
            os.replace(previous, target)  # put the last good export back
        if isinstance(e, OSError):
            raise DistillError(
                f"cannot write the exported model to {target} ({e.strerror or e}); make {target.parent} writable "
                "or pass --artifacts_dir elsewhere"
            ) from None
        raise
    shutil.rmtree(previous, ignore_errors=True)


@contextmanager
def no_prompts(sentence_transformer: SentenceTransformer) -> Iterator[None]:
    """Blank the model's prompts and default prompt while it is saved; put them back afterwards."""
    prompts, default = sentence_transformer.prompts, sentence_transformer.default_prompt_name
    sentence_transformer.prompts = dict.fromkeys(prompts, "")
    sentence_transformer.default_prompt_name = None
    try:
        yield
    finally:
        sentence_transformer.prompts, sentence_transformer.default_prompt_name = prompts, default


def model_card(
    settings: dict, table: str, dims: dict[str, int], note: str = "", matryoshka: list[int] | None = None
) -> str:
    """A sentence-transformers model card: how the student was distilled (`note`: what the folder holds), its scores.

    `dims`: {"student": its dimension}, plus {"output": the projection's} when the folder ends with the projection.
    `matryoshka`: the dimensions a Matryoshka-mode model was trained to be truncated to (largest first).
    """
    front = "\n".join(
        [
            "---",
            "library_name: sentence-transformers",
            "pipeline_tag: sentence-similarity",
            "tags:",
            "- sentence-transformers",
            "- feature-extraction",
            "- distillation",
            "---",
            "",
        ]
    )
    width = dims.get("output", dims.get("student"))
    usage = (
        "```python\nfrom sentence_transformers import SentenceTransformer\n\n"
        "model = SentenceTransformer('path/to/this/folder')\n"
        f"embeddings = model.encode(['a query', 'a passage'])  # (2, {width})\n"
        "scores = model.similarity(embeddings, embeddings)  # cosine\n```\n\n"
        "No prompts: the student was distilled on texts as they are, so queries and documents are encoded alike "
        "(`encode_query` and `encode_document` add nothing; the teacher's prompts are not needed).\n"
    )
    if "output" in dims:
        usage += (
            f"\nThe vectors lie in the teacher's {dims['output']}-d space: they can query an index of the teacher's "
            "own passage vectors (scored as `ndcg@10_asymmetric` under Evaluation).\n"
        )
    if matryoshka:
        shorter = matryoshka[1] if len(matryoshka) > 1 else matryoshka[0]
        usage += (
            f"\nMatryoshka: trained to be truncated to {', '.join(map(str, matryoshka))} dimensions (the first "
            f"coordinates carry the most): `SentenceTransformer('path/to/this/folder', truncate_dim={shorter})`. "
            "Truncated vectors are not unit length: compare them with `model.similarity` (cosine), or encode with "
            "`normalize_embeddings=True` before a dot product.\n"
        )
    return (
        f"{front}# Distilled student\n\n"
        f"Distilled with `distill` from teacher `{settings.get('teacher_model')}` into "
        f"`{settings.get('student_model')}`"
        + (f" cut to {layers} evenly spaced layers" if (layers := settings.get("student_num_layers")) else "")
        + f" ({dims.get('student')}-d"
        + (f", projected to the teacher's {dims['output']}-d" if "output" in dims else "")
        + (", Matryoshka" if matryoshka else "")
        + ")."
        + (f" {note}" if note else "")
        + "\n\n## Usage\n\n"
        + usage
        + "\n## Evaluation\n\n"
        + table
        + "\n\n## Training settings\n\n```json\n"
        + json.dumps(settings, indent=2, default=str)
        + "\n```\n"
    )
