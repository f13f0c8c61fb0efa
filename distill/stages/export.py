"""Export the trained student as folders that `SentenceTransformer(path)` loads and uses as they are.

- `<artifacts_dir>/model`: what users deploy. In projection mode it ends with the trained Dense projection
  and a Normalize, so `encode` returns teacher-space vectors that can query an index the teacher built. In
  Matryoshka mode it is the student, given a final Normalize if it has none: unit vectors in both modes.
- `<artifacts_dir>/model/onnx/`: its ONNX forms, float32 and int8, where the run built them (stages/forms.py).
- `<artifacts_dir>/student`: projection mode only, the student at its own dimension.
- a kind's own folders beside them: a static table's `<artifacts_dir>/model2vec`, as model2vec saves it.

Each folder is written by sentence-transformers' own `save` into a temporary folder, with its model card
(`distill/card.py`), then renamed into place: a crash never leaves half a model. Only the main process writes;
everyone waits for it. `--push_to_hub` then uploads the model folder with sentence-transformers' `push_to_hub`.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from accelerate import Accelerator
from accelerate.logging import get_logger

from distill.card import model_card
from distill.distributed import on_main_process
from distill.errors import DistillError, first_line
from distill.files import sync_folder, sync_tree, unique_suffix
from distill.students import kind_of
from distill.students.head import DistillationModel, matryoshka_dims

if TYPE_CHECKING:
    from sentence_transformers import SentenceTransformer

    from distill.students.kinds import StudentDescription

logger = get_logger(__name__)


def deployable_model(model: DistillationModel) -> SentenceTransformer:
    """The SentenceTransformer users get, as the student's kind builds it: the student, then projection and
    Normalize in projection mode.

    In Matryoshka mode a student that does not end with a Normalize gets one: the losses compare re-normalised
    vectors, so its own norms were never trained, and a dot product on them would rank by noise.
    """
    head = [] if model.projection is None else [model.projection]
    return kind_of(model.student).deployable(model.student, head)


def export_models(
    accelerator: Accelerator,
    model: DistillationModel,
    artifacts_dir: str | os.PathLike,
    settings: dict,
    table: str,
    figures: dict | None = None,
    student: StudentDescription | None = None,
    forms: Path | None = None,
) -> dict[str, str]:
    """Write the exported model folder(s), each with its model card (`settings`, the evaluation and cost `table`,
    `figures`: the run's results for the card's header; `forms`: a folder whose `onnx/` goes into the model's).

    Returns {name: path}. Collective: every process must call it.
    """
    root = Path(artifacts_dir).expanduser()
    student_dims = {"student": model.student_dim}  # no "output": no projection in the folder
    model_dims = student_dims if model.projection is None else {**student_dims, "output": model.projection.out_features}
    trained = matryoshka_dims(model.student_dim, settings.get("matryoshka_dims")) if model.projection is None else None
    targets = {"model": (root / "model", deployable_model(model), model_dims, "")}
    if model.projection is not None:
        note = (
            f"This folder is the student at its own {model.student_dim} dimensions, without the projection "
            "(the folder `model` beside it has it): it scores as the `ndcg@10_student_dim` row."
        )
        targets["student"] = (root / "student", model.student, student_dims, note)

    written = {name: str(path) for name, (path, *_) in targets.items()}
    deployable = targets["model"][1]
    extras = kind_of(deployable).extra_folders(deployable)  # a kind's own folders: a table's model2vec one
    written.update({name: str(root / name) for name in extras})

    def write() -> None:
        for name, (path, sentence_transformer, dims, note) in targets.items():
            card = model_card(sentence_transformer, settings, table, dims, note, trained, figures, student)
            save_atomic(sentence_transformer, path, card, forms if name == "model" else None)
        for name, extra in extras.items():
            card = model_card(deployable, settings, table, model_dims, extra.note, trained, figures, student)
            save_atomic_with(partial(extra.save, card=card), root / name)

    on_main_process(accelerator, write)
    return written


def save_atomic_with(save: Callable[[Path], object], target: Path) -> None:
    """`save(staging)` into `<target>.tmp`, then swapped in for any previous folder: a crash never leaves half a
    model, and a failed write puts the last good export back."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.parent / f".{target.name}.tmp-{unique_suffix()}"
    previous = target.parent / f".{target.name}.old-{unique_suffix()}"
    try:
        save(staging)
        sync_tree(staging)  # on the disk before the rename: a crash after it finds every byte
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
    sync_folder(target.parent)
    shutil.rmtree(previous, ignore_errors=True)


def save_atomic(sentence_transformer: SentenceTransformer, target: Path, card: str, forms: Path | None = None) -> None:
    """sentence-transformers' save, card added, the `onnx/` folder of `forms` copied in where given, swapped in
    atomically (`save_atomic_with`).

    The folder is saved without prompts: the student was distilled on unprompted texts, so the prompts it
    came with would make `encode_query`/`encode_document` feed it inputs it was not trained on.
    """

    def save(staging: Path) -> None:
        with no_prompts(sentence_transformer):
            sentence_transformer.save(str(staging), create_model_card=False)
        (staging / "README.md").write_text(card)
        if forms is not None and (forms / "onnx").is_dir():
            shutil.copytree(forms / "onnx", staging / "onnx")

    save_atomic_with(save, target)


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


def push_to_hub(sentence_transformer: SentenceTransformer, folder: str, repo_id: str, private: bool) -> dict[str, str]:
    """Upload the exported `folder` (card included) to `repo_id` with sentence-transformers' `push_to_hub`.

    The token is the Hub login's (`hf auth login`, or HF_TOKEN). A failure (offline, no token, no rights) is one
    warning line with the command that retries the upload; the folder is written already and stays as it is.
    Returns {"repo": ..., "url": the commit} or {"repo": ..., "error": why}: results.json's `hub` entry.
    """
    try:
        url = sentence_transformer.push_to_hub(
            repo_id, private=private, local_model_path=folder, exist_ok=True, commit_message="Upload a distilled model"
        )
    except Exception as e:  # the Hub's and the network's errors are many; none of them may cost the run
        why = first_line(e, limit=None, named=True)
        retry = f"hf upload {repo_id} {folder} ." + (" --private" if private else "")
        logger.warning(f"push to the Hub failed ({why}); the model stays in {folder}; retry with: {retry}")
        return {"repo": repo_id, "error": why}
    logger.info(f"pushed the model to https://huggingface.co/{repo_id}")
    return {"repo": repo_id, "url": str(url)}
