"""A teacher given as vectors computed before: `--teacher_vectors PATH`.

A vector database filled by the teacher, or a dump of an API's answers, already holds what distillation needs.
The file is one of:

- `.parquet`: a text column and a vector column (a list of floats per row);
- `.jsonl`: one object per line with a text and a vector;
- `.npy` (memory-mapped) beside a texts file of the same stem: `.txt` (one text per line) or `.jsonl`;
- a folder holding `embeddings.npy` (or `vectors.npy`) and `texts.txt` (or `texts.jsonl`).

A `.parquet` or `.jsonl` file is streamed once per machine, CHUNK_ROWS rows at a time, into an `.npy` array and
a texts file under `<teacher_cache_dir>/files/` (keyed by the file's path, size and time), which every process
then memory-maps: reading holds one chunk, whatever the file's size. Texts are matched as the run's data cleans
them (whitespace collapsed). Texts of the run the file lacks are an
error that says how many and where, unless `--teacher_model` is also given: it then encodes them (cached under
its own key), and the file supplies the rest. The vectors go into the run's cache like any teacher's.
"""

from __future__ import annotations

import hashlib
import json
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING

import numpy as np
import torch

from distill.data.containers import pick
from distill.data.reading import pick_column
from distill.distributed import writes_for_this_machine
from distill.errors import DistillError
from distill.files import CONTENTS, check, drop_pages, mark_used, staged_folder, text_digests
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
CHUNK_ROWS = 8192  # rows of a .parquet or .jsonl file held at once while it is streamed into an array
LINE_CHUNK_CHARS = 1 << 24  # characters of a texts file read at a time
STREAMED = (".parquet", ".jsonl")


class VectorsTeacher:
    """Vectors from a file, and from `fill` (a model or endpoint) for the texts the file lacks."""

    def __init__(self, path: str, caches: Caches, fill: Source | None = None, workdir: Path | None = None):
        self.file = Path(path).expanduser()
        self.caches = caches
        self.fill = fill
        self.workdir = workdir  # where a .parquet or .jsonl file is streamed into an array (default: a temp folder)
        self.name = str(self.file) if fill is None else f"{self.file} and {fill.name}"
        self.path = str(self.file)  # what a cache manifest records
        self.revision: str | None = None
        self.max_seq_length: int | None = None
        self._files_read: tuple[Path, np.ndarray] | None = None
        self._index: tuple[np.ndarray, np.ndarray] | None = None  # the file's distinct text digests, sorted; rows

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

    def encoder(self, accelerator: Accelerator, texts: Sequence[str], role: Role) -> Encoder:
        """Each text's row of the file, or of the fill's vectors of the texts the file lacks."""
        if self.file.suffix in STREAMED and self._files_read is None:  # streamed once per machine, then read by all
            if accelerator is None or writes_for_this_machine(accelerator):
                streamed_copy(self.file, self.workdir)
            if accelerator is not None:
                accelerator.wait_for_everyone()
        rows, vectors = self.rows(texts), self.vectors()
        missing = np.flatnonzero(rows < 0)
        filled = None
        if len(missing) and self.fill is None:
            raise DistillError(
                f"teacher_vectors: {len(missing):,} {role} texts of this run are not in "
                f"{self.file} (the first: {texts[missing[0]][:60]!r}); add their vectors to the file, or pass "
                "--teacher_model to encode them"
            )
        if len(missing):
            assert self.fill is not None
            filled = self.caches(self.fill).embeddings(pick(texts, missing), role)  # collective, cached
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
            drop_pages(vectors)  # a large file read through its map holds none of it in this process
            norms = np.maximum(np.linalg.norm(out, axis=1, keepdims=True), 1e-12)
            return torch.from_numpy(out / norms)

        return Encoder(lengths=np.zeros(len(texts), dtype=np.int64), encode=encode, batch_size=4096)

    def rows(self, texts: Sequence[str]) -> np.ndarray:
        """Each text's row of the file, -1 where it lacks the text: matched by digest (the file's texts with
        whitespace collapsed, as the run's data is; the first of repeats), so no text of the file is held."""
        if self._index is None:
            texts_file, vectors = self.files()
            digests = file_digests(texts_file)
            checked(self.file, len(digests), vectors)
            unique, first = np.unique(digests, return_index=True)
            self._index = unique, first.astype(np.int64)
        unique, first = self._index
        wanted = text_digests(texts)
        if not len(unique):
            return np.full(len(wanted), -1, dtype=np.int64)
        at = np.minimum(np.searchsorted(unique, wanted), len(unique) - 1)
        return np.where(unique[at] == wanted, first[at], -1)

    def files(self) -> tuple[Path, np.ndarray]:
        """(the file of its texts, its vectors memory-mapped)."""
        if self._files_read is None:
            self._files_read = vector_files(self.file, self.workdir)
        return self._files_read

    def texts(self) -> list[str]:
        """The file's texts, in its order."""
        return list(file_texts(self.files()[0]))

    def vectors(self) -> np.ndarray:
        return self.files()[1]

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
        self._files_read = self._index = None
        if self.fill is not None:
            self.fill.release()


def beside(array: Path) -> list[Path]:
    return [array.with_suffix(".txt"), array.with_suffix(".jsonl")]


def read_vectors(path: Path, workdir: Path | None = None) -> tuple[list[str], np.ndarray]:
    """(texts, (len(texts), dim) float vectors, memory-mapped) from a vectors file or folder; a DistillError says
    what is wrong. A .parquet or .jsonl file is read from its streamed copy under `workdir` (made if missing)."""
    texts_file, vectors = vector_files(path, workdir)
    texts = list(file_texts(texts_file))
    checked(path, len(texts), vectors)
    return texts, vectors


def vector_files(path: Path, workdir: Path | None = None) -> tuple[Path, np.ndarray]:
    """(the file of the texts, the vectors memory-mapped) of a vectors file or folder; a .parquet or .jsonl file's
    from its streamed copy under `workdir` (made if missing)."""
    if path.suffix in STREAMED and path.is_file():
        path = streamed_copy(path, workdir)
    if path.is_dir():
        array = next((path / name for name in ARRAYS if (path / name).is_file()), None)
        texts = next((path / name for name in TEXT_FILES if (path / name).is_file()), None)
        if array is None or texts is None:
            raise DistillError(
                f"teacher_vectors: folder {str(path)!r} needs {' or '.join(ARRAYS)} and {' or '.join(TEXT_FILES)}; "
                "add them, or pass a .parquet or .jsonl file"
            )
        return texts, np.load(array, mmap_mode="r")
    if path.suffix == ".npy":
        texts = next((p for p in beside(path) if p.is_file()), None)
        if texts is None:
            raise DistillError(
                f"teacher_vectors: {str(path)!r} needs its texts beside it, in {path.with_suffix('.txt').name} "
                f"(one per line) or {path.with_suffix('.jsonl').name}; add one"
            )
        return texts, np.load(path, mmap_mode="r")
    raise DistillError(
        f"teacher_vectors: expected a .parquet, .jsonl or .npy file or a folder, got {str(path)!r}; convert it to one"
    )


def file_texts(path: Path) -> Iterator[str]:
    """The texts of a .txt (one a line, as `str.splitlines` cuts them) or .jsonl file, read a chunk at a time."""
    lines = _lines(path)
    if path.suffix == ".txt":
        yield from lines
        return
    column = None
    for line in lines:
        if line.strip():
            row = json.loads(line)
            column = column or _column(row, TEXT_COLUMNS, path, "text")
            yield str(row[column])


def _lines(path: Path) -> Iterator[str]:
    """`path.read_text().splitlines()`, without the whole text in memory: the last line of a chunk waits for the
    next (a chunk can end inside a line)."""
    rest = ""
    with path.open(encoding="utf8") as file:
        while chunk := file.read(LINE_CHUNK_CHARS):
            lines = (rest + chunk).splitlines(keepends=True)
            rest = lines.pop()
            for line in lines:
                yield line.splitlines()[0]
    if rest:
        yield rest.splitlines()[0]


def file_digests(path: Path) -> np.ndarray:
    """The digest of each text of a vectors file's texts file, whitespace collapsed as the run's data is."""
    digests, chunk = [], []
    for text in file_texts(path):
        chunk.append(" ".join(text.split()))
        if len(chunk) == CHUNK_ROWS:
            digests.append(text_digests(chunk))
            chunk = []
    digests.append(text_digests(chunk))
    return np.concatenate(digests)


def streamed_copy(path: Path, workdir: Path | None = None) -> Path:
    """The folder (embeddings.npy, texts.jsonl) that a .parquet or .jsonl vectors file is streamed into, under
    `workdir`, keyed by the file's path, size and modification time; made once, through a staging folder, so a
    stopped copy is never read."""
    stat = path.stat()
    key = hashlib.sha256(json.dumps([str(path.resolve()), stat.st_size, stat.st_mtime_ns]).encode()).hexdigest()
    root = workdir or Path(tempfile.gettempdir()) / "distill-vectors"
    folder = root / f"{path.stem}-{key[:16]}"
    if check(folder) is None:  # whole: every file at its size and checksum
        mark_used(folder / CONTENTS)  # for `python -m distill.cache prune --unused_days`
        return folder
    with staged_folder(folder) as staging:
        (_stream_parquet if path.suffix == ".parquet" else _stream_jsonl)(path, staging)
    return folder


class ArrayWriter:
    """An .npy array of `rows` float32 rows written chunk by chunk, its width taken from the first chunk."""

    def __init__(self, file: IO[bytes], rows: int, source: Path):
        self.file, self.rows, self.source = file, rows, source
        self.dim: int | None = None
        self.written = 0

    def write(self, chunk: np.ndarray) -> None:
        if self.dim is None:
            self.dim = int(chunk.shape[1])
            header = {"descr": "<f4", "fortran_order": False, "shape": (self.rows, self.dim)}
            np.lib.format.write_array_header_2_0(self.file, header)
        if chunk.shape[1] != self.dim:
            raise DistillError(
                f"teacher_vectors: the vectors of {self.source} are not all of one width; give one width"
            )
        self.file.write(np.ascontiguousarray(chunk, dtype="<f4").tobytes())
        self.written += len(chunk)

    def close(self) -> None:
        if self.dim is None or self.written != self.rows:
            raise DistillError(f"teacher_vectors: {self.source} holds no vectors; give one vector per text")


def uneven(path: Path) -> str:
    return f"teacher_vectors: the vectors of {path} are not all of one width; give one width"


def _stream_parquet(path: Path, staging: Path) -> None:
    """A parquet file's text and vector columns, CHUNK_ROWS rows at a time (pyarrow's `iter_batches`)."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    source = pq.ParquetFile(path, memory_map=True)  # arrow's own buffers would hold row groups whole
    names = dict.fromkeys(source.schema_arrow.names)
    text, vector = _column(names, TEXT_COLUMNS, path, "text"), _column(names, VECTOR_COLUMNS, path, "vector")
    with (staging / "embeddings.npy").open("wb") as array_file, (staging / "texts.jsonl").open("w") as texts:
        array = ArrayWriter(array_file, source.metadata.num_rows, path)
        for batch in source.iter_batches(batch_size=CHUNK_ROWS, columns=[text, vector]):
            column = batch.column(vector)
            try:
                widths = pc.list_value_length(column).to_numpy(zero_copy_only=False)
                values = column.flatten().to_numpy(zero_copy_only=False)  # list<float> or fixed_size_list<float>
            except (AttributeError, ValueError, TypeError, NotImplementedError):
                raise DistillError(f"teacher_vectors: column {vector!r} of {path} holds no lists of numbers") from None
            if len(widths) and (widths.min() != widths.max()):
                raise DistillError(uneven(path))
            array.write(values.reshape(len(widths), -1))
            texts.writelines(json.dumps({"text": str(t)}) + "\n" for t in batch.column(text).to_pylist())
        array.close()
    source.close()
    pa.default_memory_pool().release_unused()  # the decoded chunks' memory, back to the OS before the run reads


def _stream_jsonl(path: Path, staging: Path) -> None:
    """A JSON-lines file's texts and vectors, one line parsed at a time into a chunk of CHUNK_ROWS rows."""
    with path.open(encoding="utf8") as lines:
        rows = sum(1 for line in lines if line.strip())
    with (staging / "embeddings.npy").open("wb") as array_file, (staging / "texts.jsonl").open("w") as texts:
        array = ArrayWriter(array_file, rows, path)
        chunk: list[np.ndarray] = []
        for number, row in _json_rows(path):
            text, vector = _column(row, TEXT_COLUMNS, path, "text"), _column(row, VECTOR_COLUMNS, path, "vector")
            try:
                chunk.append(np.asarray(row[vector], dtype=np.float32))
                texts.write(json.dumps({"text": str(row[text])}) + "\n")
                if len(chunk) == CHUNK_ROWS:
                    array.write(np.stack(chunk))
                    chunk = []
            except (ValueError, TypeError):
                raise DistillError(
                    f"teacher_vectors: line {number} of {path} holds no list of numbers of the others' width"
                ) from None
        if chunk:
            array.write(np.stack(chunk))
        array.close()


def _json_rows(path: Path) -> Iterator[tuple[int, dict]]:
    with path.open(encoding="utf8") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                yield number, json.loads(line)
            except json.JSONDecodeError:
                raise DistillError(f"teacher_vectors: line {number} of {path} is not JSON; fix or remove it") from None


def _column(row: dict, names: tuple[str, ...], path: Path, what: str) -> str:
    return pick_column([row], names, f"teacher_vectors {path}", what)


def checked(path: Path, count: int, vectors: np.ndarray) -> None:
    """A DistillError unless `vectors` holds one row a text."""
    if vectors.ndim != 2 or len(vectors) != count:
        raise DistillError(
            f"teacher_vectors: {path} holds {count:,} texts and vectors of shape {tuple(vectors.shape)}; "
            "give one vector per text"
        )
