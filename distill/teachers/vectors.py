"""A teacher given as vectors computed before: `--teacher_vectors PATH`.

A vector database filled by the teacher, or a dump of an API's answers, already holds what distillation needs.
The file is one of:

- `.parquet`: a text column and a vector column (a list of floats per row), read through a memory map;
- `.jsonl`: one object per line with a text and a vector;
- `.npy` (memory-mapped) beside a texts file of the same stem: `.txt` (one text per line) or `.jsonl`;
- a folder holding `embeddings.npy` (or `vectors.npy`) and `texts.txt` (or `texts.jsonl`).

Texts are matched as the run's data cleans them (whitespace collapsed). Texts of the run the file lacks are an
error that says how many and where, unless `--teacher_model` is also given: it then encodes them (cached under
its own key), and the file supplies the rest. The vectors go into the run's cache like any teacher's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from distill.errors import DistillError
from distill.records import pick_column
from distill.store import Role
from distill.teachers.sources import Caches, Encoder, Source

if TYPE_CHECKING:
    from accelerate import Accelerator

    from distill.stages.cost import CostTexts, ModelCost, TeacherCosts

TEXT_COLUMNS = ("text", "sentence", "passage", "document", "content", "query", "input")
VECTOR_COLUMNS = ("embedding", "vector", "embeddings", "vectors", "emb")
ARRAYS = ("embeddings.npy", "vectors.npy")
TEXT_FILES = ("texts.txt", "texts.jsonl")
NOT_TIMED = "the teacher's vectors were read from a file, so its speed is not measured"


class VectorsTeacher:
    """Vectors from a file, and from `fill` (a model or endpoint) for the texts the file lacks."""

    def __init__(self, path: str, caches: Caches, fill: Source | None = None):
        self.file = Path(path).expanduser()
        self.caches = caches
        self.fill = fill
        self.name = str(self.file) if fill is None else f"{self.file} and {fill.name}"
        self.path = str(self.file)  # what a cache manifest records
        self.revision: str | None = None
        self.max_seq_length: int | None = None
        self._texts: list[str] | None = None
        self._vectors: np.ndarray | None = None
        self._rows: dict[str, int] | None = None

    @property
    def loaded(self) -> bool:
        return self.fill is not None and self.fill.loaded

    @property
    def load_seconds(self) -> float:
        return self.fill.load_seconds if self.fill is not None else 0.0

    def prompt(self, role: Role) -> str:
        return ""  # the file's vectors are what they are

    def identity(self, accelerator: Accelerator, memo: Path) -> str:
        """The file's path, size and modification time (a changed file is another teacher), and the fill's."""
        if not self.file.exists():
            raise DistillError(f"teacher_vectors: {str(self.file)!r} does not exist; pass an existing file or folder")
        stats = [(str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(self._files())]
        fill = self.fill.identity(accelerator, memo) if self.fill is not None else None
        return json.dumps({"vectors": stats, "fill": fill}, sort_keys=True)

    def key_fields(self, role: Role) -> dict[str, object]:
        return {"fill": self.fill.key_fields(role) if self.fill is not None else None}

    def encoder(self, accelerator: Accelerator, texts: list[str], role: Role) -> Encoder:
        """Each text's row of the file, or of the fill's vectors of the texts the file lacks."""
        rows_of, vectors = self.rows(), self.vectors()
        rows = np.array([rows_of.get(text, -1) for text in texts], dtype=np.int64)
        missing = np.flatnonzero(rows < 0)
        filled = None
        if len(missing) and self.fill is None:
            raise DistillError(
                f"teacher_vectors: {len(missing):,} of the {len(texts):,} {role} texts of this run are not in "
                f"{self.file} (the first: {texts[missing[0]][:60]!r}); add their vectors to the file, or pass "
                "--teacher_model to encode them"
            )
        if len(missing):
            assert self.fill is not None
            filled = self.caches(self.fill).embeddings([texts[i] for i in missing], role)  # collective, cached
            if filled.shape[1] != vectors.shape[1]:
                raise DistillError(
                    f"teacher_vectors: {self.file} holds {vectors.shape[1]}-d vectors, but --teacher_model "
                    f"{self.fill.name} encodes {filled.shape[1]}-d ones; give the model that made the file"
                )
            rows[missing] = -1 - np.arange(len(missing))  # -1 - i: row i of the fill's vectors

        def encode(indices: list[int]) -> torch.Tensor:
            picked = rows[indices]
            out = np.empty((len(indices), vectors.shape[1]), dtype=np.float32)
            from_file = picked >= 0
            out[from_file] = vectors[picked[from_file]]
            if filled is not None and (~from_file).any():
                out[~from_file] = filled[-1 - picked[~from_file]]
            norms = np.maximum(np.linalg.norm(out, axis=1, keepdims=True), 1e-12)
            return torch.from_numpy(out / norms)

        return Encoder(lengths=np.zeros(len(texts), dtype=np.int64), encode=encode, batch_size=4096)

    def rows(self) -> dict[str, int]:
        """Each text of the file (whitespace collapsed, as the run's data is) -> its row; the first of repeats."""
        if self._rows is None:
            self._rows = {}
            for row, text in enumerate(self.texts()):
                self._rows.setdefault(" ".join(str(text).split()), row)
        return self._rows

    def texts(self) -> list[str]:
        if self._texts is None:
            self._texts, self._vectors = read_vectors(self.file)
        return self._texts

    def vectors(self) -> np.ndarray:
        if self._vectors is None:
            self._texts, self._vectors = read_vectors(self.file)
        return self._vectors

    def _files(self) -> list[Path]:
        if self.file.is_dir():
            return [p for p in self.file.iterdir() if p.name in ARRAYS + TEXT_FILES]
        return [p for p in [self.file, *beside(self.file)] if p.exists()]

    def cost(self, accelerator: Accelerator, texts: CostTexts, costs: TeacherCosts) -> ModelCost | None:
        return None

    @property
    def cost_note(self) -> str | None:
        return NOT_TIMED

    def release(self) -> None:
        self._rows = self._texts = self._vectors = None
        if self.fill is not None:
            self.fill.release()


def beside(array: Path) -> list[Path]:
    return [array.with_suffix(".txt"), array.with_suffix(".jsonl")]


def read_vectors(path: Path) -> tuple[list[str], np.ndarray]:
    """(texts, (len(texts), dim) float vectors) from a vectors file or folder; a DistillError says what is wrong."""
    if path.is_dir():
        array = next((path / name for name in ARRAYS if (path / name).is_file()), None)
        texts = next((path / name for name in TEXT_FILES if (path / name).is_file()), None)
        if array is None or texts is None:
            raise DistillError(
                f"teacher_vectors: folder {str(path)!r} needs {' or '.join(ARRAYS)} and {' or '.join(TEXT_FILES)}; "
                "add them, or pass a .parquet or .jsonl file"
            )
        return _checked(path, _read_texts(texts), np.load(array, mmap_mode="r"))
    if path.suffix == ".npy":
        texts = next((p for p in beside(path) if p.is_file()), None)
        if texts is None:
            raise DistillError(
                f"teacher_vectors: {str(path)!r} needs its texts beside it, in {path.with_suffix('.txt').name} "
                f"(one per line) or {path.with_suffix('.jsonl').name}; add one"
            )
        return _checked(path, _read_texts(texts), np.load(path, mmap_mode="r"))
    if path.suffix == ".parquet":
        return _read_parquet(path)
    if path.suffix == ".jsonl":
        return _read_jsonl(path)
    raise DistillError(
        f"teacher_vectors: expected a .parquet, .jsonl or .npy file or a folder, got {str(path)!r}; convert it to one"
    )


def _read_texts(path: Path) -> list[str]:
    if path.suffix == ".txt":
        return path.read_text(encoding="utf8").splitlines()
    rows = [json.loads(line) for line in path.read_text(encoding="utf8").splitlines() if line.strip()]
    column = _column(rows[0] if rows else {}, TEXT_COLUMNS, path, "text")
    return [str(row[column]) for row in rows]


def _read_parquet(path: Path) -> tuple[list[str], np.ndarray]:
    import pyarrow.parquet as pq

    table = pq.read_table(path, memory_map=True)
    names = {name: None for name in table.column_names}
    text, vector = _column(names, TEXT_COLUMNS, path, "text"), _column(names, VECTOR_COLUMNS, path, "vector")
    column = table.column(vector).combine_chunks()
    try:
        values = column.flatten().to_numpy(zero_copy_only=False)  # list<float> or fixed_size_list<float>
    except (AttributeError, ValueError, TypeError):
        raise DistillError(f"teacher_vectors: column {vector!r} of {path} holds no lists of numbers") from None
    rows = len(column)
    if rows == 0 or len(values) % rows:
        raise DistillError(f"teacher_vectors: the vectors of {path} are not all of one width; give one width")
    return _checked(path, [str(t) for t in table.column(text).to_pylist()], values.reshape(rows, -1))


def _read_jsonl(path: Path) -> tuple[list[str], np.ndarray]:
    texts, vectors = [], []
    with path.open(encoding="utf8") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                raise DistillError(f"teacher_vectors: line {number} of {path} is not JSON; fix or remove it") from None
            text, vector = _column(row, TEXT_COLUMNS, path, "text"), _column(row, VECTOR_COLUMNS, path, "vector")
            texts.append(str(row[text]))
            vectors.append(row[vector])
    try:
        array = np.asarray(vectors, dtype=np.float32)
    except (ValueError, TypeError):
        raise DistillError(
            f"teacher_vectors: the vectors of {path} are not all lists of numbers of one width"
        ) from None
    return _checked(path, texts, array)


def _column(row: dict, names: tuple[str, ...], path: Path, what: str) -> str:
    return pick_column([row], names, f"teacher_vectors {path}", what)


def _checked(path: Path, texts: list[str], vectors: np.ndarray) -> tuple[list[str], np.ndarray]:
    if vectors.ndim != 2 or len(vectors) != len(texts):
        raise DistillError(
            f"teacher_vectors: {path} holds {len(texts):,} texts and vectors of shape {tuple(vectors.shape)}; "
            "give one vector per text"
        )
    return texts, vectors
