"""The data stage's output kept on disk: each machine reads, cleans, deduplicates and holds out the data once, into
Arrow files that every process memory-maps.

Without it every process holds the corpus as Python strings (about 400 bytes a text) and reads it again on every
run. Here the machine's first process reads the data (the stage's reader, `machine_first`) and writes its
texts under `<teacher_cache_dir>/data/<key>/`, with each list's fingerprint and per-text digests (what the token and
teacher caches key by), so no process hashes the corpus again. Every process then reads the texts back as
`TextColumn`s over the mapped files: read-only sequences that a list's readers accept (an item is a `str`, a slice
a `list[str]`), whose pages the machine's processes share.

The key hashes the data options, the seed, the phases read and each source's stamp: a local source's files by
absolute path, size and modification time (so `data.jsonl` and `./data.jsonl` are one entry), a Hub dataset (phase
data or NanoBEIR) by the commit the Hub names for it, which the main process asks for. An edited file, a new commit
on the Hub, another seed or another cap is another entry. Where the Hub cannot name the commit (offline, or
unreachable), every process reads NanoBEIR itself, from datasets' own cache, and the phase data are kept still;
phase data from such a Hub dataset are read by every process.

pyarrow's IPC files are what `datasets` keeps its cache in; they are written here directly because a
`datasets.Dataset`'s column reads come back as Python lists of the whole column.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, overload

import numpy as np
import pyarrow as pa

from distill.config.schema import DataConfig
from distill.data.containers import DistillData, EvalGroup, EvalSet, Pairs
from distill.data.reading import collected, lenient, sources_read, warn
from distill.distributed import machine_first, main_decides
from distill.errors import DistillError
from distill.files import DIGEST_BYTES, check, mark_used, read_json, staged_folder, text_digests, texts_fingerprint
from distill.hub import dataset_revision

PREPARED_FORMAT = 1

WRITE_ROWS = 65_536  # texts a record batch of the files holds

READ_ROWS = 8_192  # texts turned into Python strings at a time when a column is iterated

MINED_LATER = {"mine_hard_negatives"}  # data options `load_data` does not read (the teacher stage mines)


class TextColumn(Sequence[str]):
    """Texts in a memory-mapped Arrow column, read as a list is; `fingerprint` and `digests` are those of
    `distill.tokens.texts_fingerprint` and `distill.store.text_digests`, computed when the column was written."""

    def __init__(self, array: pa.ChunkedArray, fingerprint: str, digests: np.ndarray) -> None:
        self.array, self.fingerprint, self.digests = array, fingerprint, digests
        self.starts = np.cumsum([0] + [len(chunk) for chunk in array.chunks])  # each chunk's first row

    def __len__(self) -> int:
        return len(self.array)

    @overload
    def __getitem__(self, index: int) -> str: ...
    @overload
    def __getitem__(self, index: slice) -> list[str]: ...
    def __getitem__(self, index: int | slice) -> str | list[str]:
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step != 1:
                return self.pick(np.arange(start, stop, step))
            return self.array.slice(start, max(stop - start, 0)).to_pylist()
        position = index + len(self) if index < 0 else index
        if not 0 <= position < len(self):
            raise IndexError(f"text {index} of {len(self)}")
        return self.array[position].as_py()

    def __iter__(self) -> Iterator[str]:
        for start in range(0, len(self), READ_ROWS):
            yield from self.array.slice(start, READ_ROWS).to_pylist()

    def pick(self, rows: Sequence[int] | np.ndarray) -> list[str]:
        """The texts at `rows`, in their order: one gather a chunk (a chunked array's own `take` would first join
        its chunks into one copy of the whole column)."""
        rows, starts = np.asarray(rows, dtype=np.int64), self.starts
        chunk_of = np.searchsorted(starts, rows, side="right") - 1
        texts: list[str] = [""] * len(rows)
        for chunk in np.unique(chunk_of):
            at = np.flatnonzero(chunk_of == chunk)
            taken = self.array.chunk(int(chunk)).take(pa.array(rows[at] - starts[chunk])).to_pylist()
            for i, text in zip(at.tolist(), taken, strict=True):
                texts[i] = text
        return texts

    def view(self, start: int, stop: int, fingerprint: str) -> TextColumn:
        """Texts `start` to `stop`, sharing this column's memory; `fingerprint` is theirs."""
        return TextColumn(self.array.slice(start, stop - start), fingerprint, self.digests[start:stop])


class Negatives(Sequence[list[str]]):
    """Each pair's hard negatives, `width` a pair, over one column: `negatives[i]` is pair i's list."""

    def __init__(self, flat: TextColumn, width: int) -> None:
        self.flat, self.width = flat, width

    def __len__(self) -> int:
        return len(self.flat) // self.width

    @overload
    def __getitem__(self, index: int) -> list[str]: ...
    @overload
    def __getitem__(self, index: slice) -> list[list[str]]: ...
    def __getitem__(self, index: int | slice) -> list[str] | list[list[str]]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        position = index + len(self) if index < 0 else index
        if not 0 <= position < len(self):
            raise IndexError(f"pair {index} of {len(self)}")
        return self.flat[position * self.width : (position + 1) * self.width]


def source_stamps(
    config: DataConfig, need_phase1: bool, need_phase2: bool, commits: dict[str, str | None]
) -> dict[str, str]:
    """Each source read -> a digest of its stamp (its files' sizes and times, or its Hub commit): what a resumed run
    compares with its checkpoint's, source by source (a resume may skip a phase, and so read fewer sources). A Hub
    dataset with no commit has none."""
    stamps = {source.name: source.stamp(commits) for source in sources_read(config, need_phase1, need_phase2)}
    return {
        source: hashlib.sha256(json.dumps(stamp, default=str).encode()).hexdigest()[:16]
        for source, stamp in stamps.items()
        if stamp is not None
    }


def data_key(
    config: DataConfig,
    seed: int,
    need_phase1: bool,
    need_phase2: bool,
    commits: dict[str, str | None],
    evaluation: bool = True,
) -> str | None:
    """The entry of this data: its options (each local source by its absolute path), the seed, the phases read,
    and each source's stamp (None where a source is a Hub dataset with no commit in `commits`). Without
    `evaluation`, the entry holds the phases alone (a NanoBEIR evaluation set read beside them)."""
    if not evaluation:
        config = dataclasses.replace(config, eval_data="none")
    stamps = {source.name: source.stamp(commits) for source in sources_read(config, need_phase1, need_phase2)}
    if None in stamps.values():
        return None
    sources = {name: lenient(getattr(config, name)).name for name in ("phase1_data", "phase2_data", "eval_data")}
    options = {k: v for k, v in dataclasses.asdict(config).items() if k not in MINED_LATER} | sources
    fields = {"format": PREPARED_FORMAT, "config": options, "seed": seed}
    fields |= {"phases": [need_phase1, need_phase2], "sources": stamps}
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()[:32]


def hub_commits(config: DataConfig, need_phase1: bool, need_phase2: bool) -> dict[str, str | None]:
    """The commit of each Hub dataset the run reads (None where the Hub cannot name it).

    Asked by the main process and sent to the others: one request a dataset, and one answer on every process and
    machine. A process with no key reads alone while one with a key waits for its machine's first, so they must
    agree; and every machine must read the same rows.
    """
    hub = sorted({source.hub_id for source in sources_read(config, need_phase1, need_phase2) if source.hub_id})
    return main_decides(None, lambda: {name: dataset_revision(name) for name in hub})


def kept_data(entry: Path, read_data: Callable[[], DistillData]) -> DistillData:
    """The data of `entry`, read (`read_data`) and written there first by the machine's first process if it is not
    there yet."""
    with machine_first():  # the machine's first process reads the data; the others map what it wrote
        problem = check(entry)
        if problem is not None and entry.exists():
            warn(f"kept data {entry} is {problem}; reading the data again")
        read = None if problem is None else read_and_keep(entry, read_data)
    if isinstance(read, DistillError):
        raise read  # after the block: the machine's other processes meet it reading the same data, none waits alone
    return load(entry, replay=True) if read is None else read


def read_and_keep(entry: Path, read_data: Callable[[], DistillData]) -> DistillData | DistillError:
    """The data read and written into `entry`, then read back from there; the data as read where the disk refuses
    it; the error, where the data is bad."""
    try:
        with collected() as said:
            data = read_data()
    except DistillError as error:
        return error
    try:
        save(data, said, entry)
    except OSError as error:  # a read-only or full disk: this run reads the data in each process
        warn(f"cannot keep the data under {entry.parent} ({error.strerror or error}); each process reads it itself")
        return data
    del data
    return load(entry, replay=False)


def save(data: DistillData, said: list[str], entry: Path) -> None:
    """The data's texts as Arrow files with their fingerprints and digests, the rest as JSON, into `entry` through
    a staging folder renamed into place."""
    with staged_folder(entry) as staging:
        write_entry(data, said, staging)


def write_entry(data: DistillData, said: list[str], staging: Path) -> None:
    """The files of an entry, into `staging`."""
    pairs = data.phase2
    candidates = list(pairs.passages) + [text for negatives in pairs.negatives for text in negatives]
    fingerprints = {
        "phase1": write_column(staging / "phase1", data.phase1_texts),
        "queries": write_column(staging / "queries", pairs.queries),
        "passages": write_column(staging / "passages", candidates),
        "positives": texts_fingerprint(pairs.passages),
    }
    fields = {
        "format": PREPARED_FORMAT,
        "pairs": len(pairs),
        "width": len(pairs.negatives[0]) if pairs.negatives else 0,
        "fingerprints": fingerprints,
        "capped": data.capped,
        "said": said,
        "evaluation": None if data.evaluation is None else dataclasses.asdict(data.evaluation),
    }
    (staging / "fields.json").write_text(json.dumps(fields, default=plain))


def plain(value: Any) -> Any:
    """An evaluation set's range as [start, stop] and set as a sorted list, for JSON."""
    return [value.start, value.stop] if isinstance(value, range) else sorted(value)


def write_column(path: Path, texts: Sequence[str]) -> str:
    """`texts` as `path`.arrow and their digests as `path`.digests.npy; their fingerprint."""
    schema = pa.schema([("text", pa.large_string())])  # 64-bit offsets: no 2 GiB limit on a batch's text
    with pa.OSFile(str(path.with_suffix(".arrow")), "wb") as sink, pa.ipc.new_file(sink, schema) as writer:
        for start in range(0, len(texts), WRITE_ROWS):
            batch = pa.array(texts[start : start + WRITE_ROWS], pa.large_string())
            writer.write_batch(pa.record_batch([batch], schema))
    digests = text_digests(texts).view(np.uint8).reshape(len(texts), DIGEST_BYTES)
    np.save(path.with_suffix(".digests.npy"), digests)
    return texts_fingerprint(texts)


def read_column(path: Path, fingerprint: str) -> TextColumn:
    """The column `write_column` wrote at `path`, memory-mapped."""
    # the map stays open while the table's buffers point into it, as datasets keeps its cache files
    array = pa.ipc.open_file(pa.memory_map(str(path.with_suffix(".arrow")))).read_all().column("text")
    digests = np.load(path.with_suffix(".digests.npy"), mmap_mode="r")
    return TextColumn(array, fingerprint, digests.view(f"V{DIGEST_BYTES}").reshape(-1))


def load(entry: Path, replay: bool) -> DistillData:
    """The data `save` wrote into `entry`, its texts memory-mapped; with `replay`, what reading it said, said again."""
    mark_used(entry / "fields.json")
    fields = read_json(entry / "fields.json")
    if replay:
        for line in fields["said"]:
            warn(line)
    prints = fields["fingerprints"]
    count, width = fields["pairs"], fields["width"]
    passages = read_column(entry / "passages", prints["passages"])
    pairs = Pairs(
        read_column(entry / "queries", prints["queries"]),
        passages.view(0, count, prints["positives"]),
        Negatives(passages.view(count, len(passages), ""), width) if width else [],
        candidates=passages,
    )
    return DistillData(
        read_column(entry / "phase1", prints["phase1"]),
        pairs,
        eval_set(fields["evaluation"]),
        fields["capped"],
    )


def eval_set(fields: dict[str, Any] | None) -> EvalSet | None:
    """An `EvalSet` from its JSON form (ranges as [start, stop], sets and tuples as lists)."""
    if fields is None:
        return None
    groups = [
        EvalGroup(g["name"], range(*g["queries"]), range(*g["corpus"]), [set(r) for r in g["relevant"]])
        for g in fields.pop("groups")
    ]
    return EvalSet(**{**fields, "sts_pairs": [tuple(p) for p in fields["sts_pairs"]]}, groups=groups)
