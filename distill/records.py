"""Rows from where the data lives: a Hub dataset (streamed), a local .jsonl/.json/.csv/.parquet/.txt file or a
dataset folder, or the embedded corpus; the columns picked from their names (distill/stages/data.py cleans them).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from itertools import chain, islice
from pathlib import Path
from typing import TYPE_CHECKING, Any

from accelerate.logging import get_logger
from tqdm.auto import tqdm

from distill.config.schema import DataConfig
from distill.errors import DistillError, first_line
from distill.files import BAR_BYTES, bytes_bar, folder_bytes

if TYPE_CHECKING:
    from datasets import Dataset


logger = get_logger(__name__)

EMBEDDED = "embedded"


LOCAL_FORMATS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet", ".txt": "text"}


TEXT_COLUMNS = ("text", "sentence", "sentences", "passage", "content", "document", "anchor")


QUERY_COLUMNS = ("query", "question", "anchor", "queries")


PASSAGE_COLUMNS = ("passage", "positive", "answer", "document", "pos", "context", "text")


CHUNK_ROWS = 10_000  # rows read (and converted to Python) at a time from a dataset


PINNED: ContextVar[dict[str, str] | None] = ContextVar("pinned", default=None)  # Hub dataset -> the commit to read


@contextmanager
def pinned(commits: dict[str, str | None]) -> Iterator[None]:
    """Inside the block a Hub dataset named in `commits` is read at its commit, not at what its branch holds by
    then (distill/prepared.py keys the data by that commit; every machine reads the same rows)."""
    token = PINNED.set({name: commit for name, commit in commits.items() if commit is not None})
    try:
        yield
    finally:
        PINNED.reset(token)


def revision(dataset: str) -> str | None:
    """The commit `pinned` names for a Hub dataset, else None (its default branch)."""
    return (PINNED.get() or {}).get(dataset)


def read_records(source: str, max_rows: int | None = None) -> list[dict[str, Any]]:
    """Rows of a local file or folder, or of a Hub dataset's train split, as dicts (the first `max_rows`)."""
    head, rest = _head_and_rest(source)
    return list(islice(chain(head, rest), max_rows))


def _head_and_rest(source: str) -> tuple[list[dict[str, Any]], Iterator[dict[str, Any]]]:
    """The first chunk of rows (to pick columns from; never empty) and an iterator over the rest."""
    rows = iter_records(source)
    head = list(islice(rows, CHUNK_ROWS))
    if not head:
        raise DistillError(f"data {source!r} has no rows; give a file or dataset with at least one row")
    return head, rows


def iter_records(source: str) -> Iterator[dict[str, Any]]:
    """Rows of a local .jsonl/.json/.csv/.parquet/.txt file, a local dataset folder, or a Hub dataset.

    A Hub dataset is `NAME` or `NAME:SUBSET` (its `train` split). Files, folders of data files and Hub datasets
    are streamed (datasets' streaming mode): a capped phase reads only the rows it keeps, and a corpus larger
    than memory or disk is never converted, downloaded or held whole. A folder written by `save_to_disk` is
    memory-mapped and read in chunks.
    """
    path, subset = resolve_source(source)
    if path.is_dir() and not subset and any((path / f).is_file() for f in ("state.json", "dataset_dict.json")):
        dataset = _load_from_disk(path, source)
        return (row for start in range(0, len(dataset), CHUNK_ROWS) for row in _chunk(dataset, start))
    if path.is_file():
        fmt = LOCAL_FORMATS[path.suffix.lower()]
        if fmt == "text":
            return ({"text": line} for line in _text_lines(path, source))
        return _stream(fmt, source, path.stat().st_size, data_files=str(path))
    if path.is_dir():  # a folder of data files (parquet shards, ...), or of subsets named in its README
        return _stream(str(path), source, folder_bytes(path), **subset)
    return _stream(str(path), source, None, **subset)


def resolve_source(source: str) -> tuple[Path, dict[str, str]]:
    """(path, subset) of a data source: a local file or folder, else a Hub dataset name (`NAME` or `NAME:SUBSET`).

    A local file of an unsupported format, or a path that looks local (a known extension, or starting with
    `.`, `/` or `~`) and does not exist, is an error here: no model is needed to find out, so the command line
    asks this before it starts any process.
    """
    path, subset = Path(source).expanduser(), {}
    if not path.exists() and ":" in source:  # NAME:SUBSET, a Hub dataset or a local folder with subsets
        name, subset_name = source.rsplit(":", 1)
        path, subset = Path(name).expanduser(), {"name": subset_name}
    if path.is_file() and path.suffix.lower() not in LOCAL_FORMATS:
        raise DistillError(
            f"data file {source!r} has an unsupported extension {path.suffix!r}; use one of {', '.join(LOCAL_FORMATS)}"
        )
    looks_local = path.suffix.lower() in LOCAL_FORMATS or source.startswith((".", "/", "~"))
    if looks_local and not path.exists():
        raise DistillError(
            f"data file {source!r} does not exist; pass an existing .jsonl/.json/.csv/.parquet/.txt file "
            "or dataset folder, a Hub dataset name, or 'embedded'"
        )
    return path, subset


def check_sources(config: DataConfig, need_phase1: bool, need_phase2: bool) -> None:
    """The data paths a run reads exist and have a known format (what `load_data` would find first)."""
    needed = [(need_phase1, config.phase1_data), (need_phase2 or config.eval_data == "auto", config.phase2_data)]
    for needed_here, source in needed:
        if needed_here and source != EMBEDDED:
            resolve_source(source)


def _chunk(dataset: Dataset, start: int) -> list[dict[str, Any]]:
    return dataset.select(range(start, min(start + CHUNK_ROWS, len(dataset)))).to_list()


def _text_lines(path: Path, source: str) -> Iterator[str]:
    """The lines of a UTF-8 text file, read one at a time (`str.splitlines` of each, so the same lines as the
    whole file's `splitlines`): memory holds the texts kept, not the file, and a capped phase stops reading early.
    """
    with open(path, "rb") as f, bytes_bar(path.stat().st_size, f"reading {path.name}") as bar:
        offset = shown = 0
        for raw in f:
            try:
                line = raw.decode("utf8")
            except UnicodeDecodeError as e:
                raise DistillError(
                    f"data file {source!r} is not UTF-8 text ({e.reason} at byte {offset + e.start}); convert it "
                    f"to UTF-8, e.g. iconv -f latin1 -t utf-8 {source} > utf8.txt"
                ) from None
            offset += len(raw)
            if offset - shown >= 1 << 20:  # the bar moves by the MiB, not by the line
                bar.update(offset - shown)
                shown = offset
            yield from line.splitlines()
        bar.update(offset - shown)  # read to the end


def _load_from_disk(path: Path, source: str) -> Dataset:
    """A dataset written by `save_to_disk` (its train split, if it holds several)."""
    import datasets

    try:
        loaded = datasets.load_from_disk(str(path))
    except (OSError, ValueError, KeyError) as e:
        raise DistillError(
            f"data {source!r} could not be loaded ({first_line(e)}); pass a folder written by save_to_disk, "
            "or a folder of .jsonl/.json/.csv/.parquet files"
        ) from None
    return loaded["train"] if isinstance(loaded, datasets.DatasetDict) else loaded


def _stream(path: str, source: str, size: int | None, **kwargs: Any) -> Iterator[dict[str, Any]]:
    """The train split's rows in datasets' streaming mode, counted by a bar for a Hub dataset (`size` None) or
    local data over BAR_BYTES."""
    import datasets

    datasets.disable_progress_bars()  # the bar below counts the rows instead
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # a parse error is this function's one line
    try:
        if size is None:  # a Hub dataset
            kwargs["revision"] = revision(path)
        rows = iter(datasets.load_dataset(path, split="train", streaming=True, **kwargs))
    except Exception as e:  # datasets raises many kinds; each becomes one line that says what to do
        raise _load_error(e, source) from None
    quiet = size is not None and size < BAR_BYTES
    label = source if size is None else Path(source).name
    with tqdm(desc=f"reading {label}", unit=" rows", disable=quiet, dynamic_ncols=True) as bar:
        while True:
            try:
                row = next(rows)
            except StopIteration:
                return
            except Exception as e:  # as above: pyarrow's, json's and datasets' own errors
                raise DistillError(
                    f"data {source!r} could not be read ({first_line(e)}); check that it is well-formed "
                    "(a .jsonl holds one complete JSON object per line) and UTF-8"
                ) from None
            bar.update()
            yield row


def _load_error(error: Exception, source: str) -> DistillError:
    subsets = re.search(r"available configs: \[([^\]]*)\]", str(error))
    if "Config name is missing" in str(error) and subsets:
        first = subsets.group(1).split(",")[0].strip().strip("'\"")
        return DistillError(
            f"data {source!r} has several subsets ({subsets.group(1)}); name one as NAME:SUBSET, e.g. {source}:{first}"
        )
    return DistillError(
        f"data {source!r} could not be loaded ({first_line(error)}); pass a local "
        ".jsonl/.json/.csv/.parquet/.txt file or dataset folder, a Hub dataset (NAME or NAME:SUBSET, with "
        "a train split), or 'embedded' when the Hub is not reachable"
    )


def pick_column(
    records: list[dict[str, Any]], candidates: tuple[str, ...], source: str, role: str, allow_single: bool = False
) -> str:
    """The first candidate column present; for texts, also the only string column if there is exactly one."""
    columns = list(records[0])
    for name in candidates:
        if name in columns:
            return name
    if allow_single:
        strings = [c for c in columns if isinstance(records[0][c], str)]
        if len(strings) == 1:
            return strings[0]
    raise DistillError(
        f"data {source!r} has no {role} column: expected one of {', '.join(candidates)}, "
        f"found {', '.join(columns) or 'none'}; rename the column"
    )


def first_item(value: Any) -> Any:
    """A passage column may hold a list of positives (the `pos` lists of BGE-style data): the first is used."""
    if isinstance(value, list):
        return value[0] if value else None
    return value
