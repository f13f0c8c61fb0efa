"""Where the data lives, and its rows.

A source is `embedded` (the demo's corpus), `auto` or `none` (evaluation only), a local file or folder (`FOLDER:SUBSET`
for a folder with subsets), a Hub dataset (`NAME` or `NAME:SUBSET`), or NanoBEIR (`nanobeir`, or `nanobeir:COPY` for
another Hub copy or a local folder in its format). `parse_source` is the one place a source string is taken apart:
its `Source` says which, where it lives, how the model card names it and what tells its content apart without
reading it (its stamp, which the kept data's key and a resume compare).

Rows come from a Hub dataset (streamed), a local .jsonl/.json/.csv/.parquet/.txt file or a dataset folder, or the
embedded corpus; the columns are picked from their names (texts, queries, passages, hard negatives); NanoBEIR is
read as sentence-transformers reads it. `warn` says the data's one-line warnings, which a run reading kept data
says again (`collected`).
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from importlib import metadata
from itertools import chain, islice
from pathlib import Path
from typing import TYPE_CHECKING, Any

from accelerate.logging import get_logger
from tqdm.auto import tqdm

from distill.config.schema import DataConfig
from distill.data.containers import EvalGroup, EvalSet
from distill.errors import DistillError, first_line
from distill.files import BAR_BYTES, bytes_bar, folder_bytes

if TYPE_CHECKING:
    from datasets import Dataset


logger = get_logger(__name__)


EMBEDDED = "embedded"


NANOBEIR = "nanobeir"


NANOBEIR_HUB = "sentence-transformers/NanoBEIR-en"  # sentence-transformers' NanoBEIREvaluator's default


LOCAL_FORMATS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet", ".txt": "text"}


NAMED = ("auto", "none", EMBEDDED)  # sources that are a word, not a place


@dataclass(frozen=True)
class Source:
    """A parsed source. `path` is the local file or folder, or for a Hub dataset its name as a path (what datasets'
    `load_dataset` takes); `subset` the part after `:`; `nanobeir` whether it is read in NanoBEIR's format."""

    given: str
    path: Path | None = None
    subset: str | None = None
    nanobeir: bool = False

    @property
    def hub_id(self) -> str | None:
        """The Hub dataset it reads (NanoBEIR's copy included), else None."""
        if self.path is None or self.path.exists():
            return None
        if self.nanobeir and self.given.split(":", 1)[-1].startswith((".", "/", "~")):
            return None  # a local NanoBEIR folder that is gone: reading it says what NanoBEIR needs
        return str(self.path)

    @property
    def name(self) -> str:
        """The source with a local path made absolute (so `data.jsonl` and `./data.jsonl` are one source)."""
        if self.path is None or not self.path.exists():
            return self.given
        subset = f":{self.subset}" if self.subset else ""
        return (f"{NANOBEIR}:" if self.nanobeir else "") + str(self.path.resolve()) + subset

    def label(self, phase: str) -> str:
        """How the model card names it: its Hub id, its file name, or what the embedded data is."""
        if self.given == EMBEDDED:
            from distill.embedded import DESCRIPTIONS  # the demo's data, named only when it was used

            return DESCRIPTIONS[phase]
        return self.hub_id or Path(self.given).name

    def stamp(self, commits: dict[str, str | None]) -> list | None:
        """What tells its content apart without reading it: each file's path, size and modification time; the
        embedded corpus's own module files; a Hub dataset's commit from `commits` (None where it has none, or where
        a local NanoBEIR folder is missing)."""
        hub = self.hub_id
        if hub is not None:
            commit = commits.get(hub)
            return None if commit is None else [self.name, commit]
        label = self.name
        if self.given in ("auto", "none"):
            files = []
        elif self.given == EMBEDDED:  # the code that builds the embedded corpus, and the gensim wheel it reads
            files = sorted(Path(__file__).parents[1].joinpath("embedded").glob("*.py"))
            with contextlib.suppress(metadata.PackageNotFoundError):  # without it, reading says what to install
                label = f"{EMBEDDED} {metadata.version('gensim')}"
        elif self.path is None or not self.path.exists():
            return None
        else:
            path = self.path
            files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
            label = str(path.resolve()) if self.nanobeir else self.name  # a NanoBEIR folder: the folder alone
        stats = [(str(p.resolve()), p.stat()) for p in files]
        return [label, [(name, stat.st_size, stat.st_mtime_ns) for name, stat in stats]]


def parse_source(given: str) -> Source:
    """`given` parsed. A local file of an unsupported format, or a path that looks local (a known extension, or
    starting with `.`, `/` or `~`) and does not exist, is an error here: no model is needed to find out, so the
    command line asks this before it starts any process."""
    if given in NAMED:
        return Source(given)
    head, _, rest = given.partition(":")
    if head == NANOBEIR:
        copy = rest or NANOBEIR_HUB
        return Source(given, Path(copy).expanduser(), None, nanobeir=True)
    path, subset = Path(given).expanduser(), None
    if not path.exists() and ":" in given:  # NAME:SUBSET, a Hub dataset or a local folder with subsets
        name, subset = given.rsplit(":", 1)
        path = Path(name).expanduser()
    if path.is_file() and path.suffix.lower() not in LOCAL_FORMATS:
        raise DistillError(
            f"data file {given!r} has an unsupported extension {path.suffix!r}; use one of {', '.join(LOCAL_FORMATS)}"
        )
    looks_local = path.suffix.lower() in LOCAL_FORMATS or given.startswith((".", "/", "~"))
    if looks_local and not path.exists():
        raise DistillError(
            f"data file {given!r} does not exist; pass an existing .jsonl/.json/.csv/.parquet/.txt file "
            "or dataset folder, a Hub dataset name, or 'embedded'"
        )
    return Source(given, path, subset)


def lenient(given: str) -> Source:
    """`given` parsed, or where it names a local file that is not there, the source as a word: a phase this run
    skips may name a bad path, and one it reads says so when it is read."""
    try:
        return parse_source(given)
    except DistillError:
        return Source(given)


def check_sources(config: DataConfig, need_phase1: bool, need_phase2: bool) -> None:
    """The data paths a run reads exist and have a known format (what `load_data` would find first)."""
    needed = [(need_phase1, config.phase1_data), (need_phase2 or config.eval_data == "auto", config.phase2_data)]
    for needed_here, source in needed:
        if needed_here:
            parse_source(source)


def sources_read(config: DataConfig, need_phase1: bool, need_phase2: bool) -> list[Source]:
    """The sources `load_data` reads for these phases, each once (by its absolute name), in that order."""
    read = [config.eval_data] + ([config.phase1_data] if need_phase1 else [])
    if need_phase2 or config.eval_data == "auto":  # "auto": the held-out pairs, or the embedded evaluation set
        read.append(config.phase2_data)
    sources = {source.name: source for source in map(lenient, read)}
    return [sources[name] for name in sorted(sources)]


TEXT_COLUMNS = ("text", "sentence", "sentences", "passage", "content", "document", "anchor")

QUERY_COLUMNS = ("query", "question", "anchor", "queries")

PASSAGE_COLUMNS = ("passage", "positive", "answer", "document", "pos", "context", "text")

CHUNK_ROWS = 10_000  # rows read (and converted to Python) at a time from a dataset

PINNED: ContextVar[dict[str, str] | None] = ContextVar("pinned", default=None)  # Hub dataset -> the commit to read


# hard negatives: one text per column (negative, negative_1, neg_2, ...) or one list column (negatives, neg)
NEGATIVE_COLUMN = re.compile(r"(hard_)?(negative|negatives|neg)(_?(\d+))?$")

COLLECTORS: list[list[str]] = []  # what `warn` said inside each open `collected()` block


@contextmanager
def collected() -> Iterator[list[str]]:
    """The lines `warn` says inside the block, so that a run reading the data back can say them again."""
    said: list[str] = []
    COLLECTORS.append(said)
    try:
        yield said
    finally:
        COLLECTORS.remove(said)


def warn(message: str) -> None:
    """A warning from the main process; also where no Accelerate state exists (a Python caller of `load_data`),
    for which accelerate's logger has no rank to ask."""
    from accelerate.state import PartialState

    for said in COLLECTORS:
        said.append(message)
    if PartialState._shared_state:
        logger.warning(message, main_process_only=True)
    else:
        logging.getLogger(__name__).warning(message)


@contextmanager
def pinned(commits: dict[str, str | None]) -> Iterator[None]:
    """Inside the block a Hub dataset named in `commits` is read at its commit, not at what its branch holds by
    then (distill/data/kept.py keys the data by that commit; every machine reads the same rows)."""
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
    head, rest = head_and_rest(source)
    return list(islice(chain(head, rest), max_rows))


def head_and_rest(source: str) -> tuple[list[dict[str, Any]], Iterator[dict[str, Any]]]:
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
    parsed = parse_source(source)
    path, subset = parsed.path or Path(source), {"name": parsed.subset} if parsed.subset else {}
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


def negative_reader(
    head: list[dict[str, Any]], source: str, exclude: tuple[str, ...] = ()
) -> tuple[Callable[[dict[str, Any]], list[Any]], int]:
    """How to read a row's hard negatives, and how many each pair keeps (0: none).

    Either one list column (`negatives`, `neg`, ...: every pair keeps the count that at least 90% of the
    rows of the first chunk have, longer lists are cut, pairs with fewer are dropped with a count) or text
    columns `negative`, `negative_1`, `negative_2`, ... in the order of their numbers. Other columns
    (`negative_score`, ...) are not negatives.
    """
    named = [c for c in head[0] if c not in exclude and NEGATIVE_COLUMN.match(c)]
    lists = [c for c in named if any(isinstance(r.get(c), list) for r in head)]
    if len(lists) > 1:
        raise DistillError(
            f"data {source!r} has several hard-negative list columns ({', '.join(lists)}); keep one of them"
        )
    if lists:
        column = lists[0]
        lengths = sorted(len(r[column]) if isinstance(r.get(column), list) else 0 for r in head)
        count = lengths[len(lengths) // 10]  # what at least 90% of the rows have
        if count == 0 and lengths[-1] > 0:
            warn(
                f"phase-2 data {source!r}: over a tenth of the rows have no {column!r}, so no hard negatives are "
                "used; drop those rows to train with them",
            )
        return (lambda r: r.get(column) if isinstance(r.get(column), list) else []), count
    texts = sorted(named, key=lambda c: int(NEGATIVE_COLUMN.match(c).group(4) or 0))  # type: ignore[union-attr]
    return (lambda r: [r.get(c) for c in texts]), len(texts)


def embedded_eval_set(seed: int, max_queries: int) -> EvalSet:
    """The demo's evaluation: inverse-cloze retrieval over the held-out Wikipedia articles, plus Lee STS."""
    from distill import embedded  # the demo, loaded only when named

    queries, corpus, relevant, (sts_texts, sts_pairs, sts_scores) = embedded.eval_set(seed, max_queries)
    return EvalSet(queries, corpus, relevant, sts_texts, sts_pairs, sts_scores)


def nanobeir_eval_set(eval_data: str, names: str | None) -> EvalSet:
    """NanoBEIR (`nanobeir`, or `nanobeir:DATASET` for another language's copy or a local folder) as the run's
    evaluation set: the datasets `names` lists (comma-separated; default all 13), each a group ranked on its own.

    The data is read as sentence-transformers' `NanoBEIREvaluator` reads it: subsets corpus, queries and qrels,
    one split per dataset named Nano<Dataset>.
    """
    from sentence_transformers.sentence_transformer.evaluation.nano_beir import DATASET_NAME_TO_HUMAN_READABLE

    dataset_id = str(parse_source(eval_data).path)
    chosen = (
        [n.strip().lower() for n in names.split(",") if n.strip()] if names else list(DATASET_NAME_TO_HUMAN_READABLE)
    )
    unknown = [n for n in chosen if n not in DATASET_NAME_TO_HUMAN_READABLE]
    if unknown:
        raise DistillError(
            f"nanobeir_datasets: unknown {', '.join(unknown)}; choose from {', '.join(DATASET_NAME_TO_HUMAN_READABLE)}"
        )
    evaluation = EvalSet([], [], [])
    for name in chosen:
        split = f"Nano{DATASET_NAME_TO_HUMAN_READABLE[name]}"
        corpus = {r["_id"]: r["text"] for r in _nanobeir_rows(dataset_id, "corpus", split) if r["text"]}
        queries = {r["_id"]: r["text"] for r in _nanobeir_rows(dataset_id, "queries", split) if r["text"]}
        judged: dict[str, set[str]] = {}
        for r in _nanobeir_rows(dataset_id, "qrels", split):
            ids = r["corpus-id"] if isinstance(r["corpus-id"], list) else [r["corpus-id"]]
            judged.setdefault(r["query-id"], set()).update(i for i in ids if i in corpus)
        rows = {doc: row for row, doc in enumerate(corpus)}
        asked = [q for q in queries if judged.get(q)]  # a query with no judged passage in the corpus scores nothing
        first_query, first_passage = len(evaluation.queries), len(evaluation.corpus)
        evaluation.queries += [queries[q] for q in asked]
        evaluation.corpus += list(corpus.values())
        evaluation.groups.append(
            EvalGroup(
                split,
                range(first_query, len(evaluation.queries)),
                range(first_passage, len(evaluation.corpus)),
                [{rows[doc] for doc in judged[q]} for q in asked],
            )
        )
    return evaluation


def _nanobeir_rows(dataset_id: str, subset: str, split: str) -> Any:
    from datasets import load_dataset

    try:
        return load_dataset(dataset_id, subset, split=split, revision=revision(dataset_id))
    except Exception as e:  # offline, no such dataset or split: one line that says what NanoBEIR needs
        raise DistillError(
            f"eval_data nanobeir: cannot read {dataset_id!r} (subset {subset!r}, split {split!r}: {first_line(e)}); "
            "NanoBEIR needs the Hub, or a local copy in the same format: --eval_data nanobeir:FOLDER"
        ) from None
