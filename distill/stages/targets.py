"""The teacher stage: every text's teacher vector, computed once, sharded across processes, cached under a content key.

The teacher is a source of vectors (distill/teachers: a model loaded here, an endpoint, a vectors file).

A cache entry is a folder `<teacher_cache_dir>/<key>/` holding `embeddings.npy` (float16, memory-mapped
on read) and `manifest.json`. The key hashes everything that changes the vectors: what the teacher is
(its weights' digest or Hub commit, the endpoint's model, the vectors file), what its source says changes them
(prompt, max length, compute dtype, dimensions), and the texts.
Entries are written to a staging folder and renamed, so a crash never leaves half an entry; an entry
whose manifest or sizes do not match is reported and rebuilt. A run whose entries all exist loads no
teacher at all. Encoding goes in blocks of texts, longest first, and the staging folder records after
each block how far it got: a run killed while encoding (preemption, a node failure) is continued by the
next run with the same inputs instead of started over. The on-disk side (entries, staging folders, locks, and
`python -m distill.cache list|prune`) is distill/store.py and distill/cache.py.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.logging import get_logger

from distill.allocator import release_freed_memory
from distill.config.schema import TeacherConfig
from distill.data.containers import DistillData, EvalSet, EvalVectors, passage_texts, pick
from distill.distributed import (
    agreed,
    any_process,
    everyone,
    job_id,
    main_decides,
    progress_bar,
    smallest,
    writes_for_this_machine,
)
from distill.errors import DistillError
from distill.files import mark_used, text_digests, texts_fingerprint
from distill.sharding import map_sharded
from distill.stages.cost import CostTexts, ModelCost, TeacherCosts, device_label
from distill.stages.negatives import mined_negatives
from distill.store import (
    CACHE_FORMAT,
    KEY,
    CacheWriter,
    Role,
    read_entry,
    read_index,
    read_json_or_empty,
    wait_while_held,
)
from distill.teachers import CachedSource, Encoder, Source, TeacherContext, make_source, members_of

logger = get_logger(__name__)


BLOCK_ROWS_PER_PROCESS = 16384  # texts each process encodes between two progress marks: what a kill can cost


REUSE_CHUNK = 65536  # rows copied at once from an earlier entry into a new one


def digest(fields: dict[str, object]) -> str:
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:32]


@dataclass
class FoundRows:
    """Where earlier entries of one model and role hold the texts asked for: `entry[i]` indexes `vectors` (-1: none
    holds text i), `row[i]` is its row there; `unindexed` entries of the teacher keep no per-text index."""

    vectors: list[np.ndarray]
    entry: np.ndarray
    row: np.ndarray
    unindexed: int = 0

    def sources(self, held: np.ndarray) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """(an entry's vectors, the texts to take from it) for each entry that holds some of the `held` texts."""
        for number, vectors in enumerate(self.vectors):
            texts = np.flatnonzero(held & (self.entry == number))
            if len(texts):
                yield vectors, texts


def find_rows(cache_dir: Path, model: str, digests: np.ndarray, teacher: str = "", role: str = "") -> FoundRows:
    """The rows of `digests`' texts in the entries under `cache_dir` whose manifest names `model`, newest first;
    and how many entries of `teacher` and `role` keep no per-text index.

    Each entry's index is sorted once and searched (numpy's `searchsorted`), so finding n texts among m costs
    O((n + m) log m) and holds the m digests, not a dictionary of texts.
    """
    found = FoundRows([], np.full(len(digests), -1, dtype=np.int32), np.full(len(digests), -1, dtype=np.int64))
    if not cache_dir.is_dir():
        return found
    entries = []
    for path in cache_dir.iterdir():
        if not KEY.fullmatch(path.name) or not (path / "manifest.json").is_file():
            continue
        manifest = read_json_or_empty(path / "manifest.json")
        if manifest.get("model") == model:
            entries.append((path.stat().st_mtime, path, manifest))
        elif "model" not in manifest and (manifest.get("teacher"), manifest.get("role")) == (teacher, role):
            found.unindexed += 1
    for _, path, manifest in sorted(entries, key=lambda item: item[0], reverse=True):
        todo = np.flatnonzero(found.entry < 0)
        if not len(todo):
            break  # every text found: the older entries are not read
        vectors, index = read_entry(path, path.name, manifest.get("count", -1)), read_index(path, manifest["count"])
        if vectors is None or index is None:
            continue
        order = np.argsort(index, kind="stable")
        ranked = index[order]
        at = np.minimum(np.searchsorted(ranked, digests[todo]), len(ranked) - 1)
        hit = ranked[at] == digests[todo]
        found.entry[todo[hit]] = len(found.vectors)
        found.row[todo[hit]] = order[at[hit]]
        found.vectors.append(vectors)
    return found


def copy_rows(writer: CacheWriter, vectors: np.ndarray, rows: np.ndarray, texts: np.ndarray) -> None:
    """Row `rows[i]` of `vectors` into `writer` as text `texts[i]`'s, REUSE_CHUNK at a time."""
    for start in range(0, len(texts), REUSE_CHUNK):
        chunk, picked = texts[start : start + REUSE_CHUNK], rows[start : start + REUSE_CHUNK]
        order = np.argsort(picked, kind="stable")  # a memory map reads sorted rows fastest
        writer.write(chunk[order], np.asarray(vectors[picked[order]]))


class TeacherCache:
    """Content-keyed teacher embeddings from one source; the source encodes only on a cache miss."""

    def __init__(self, accelerator: Accelerator, source: Source, cache_dir: str | os.PathLike, batch_size: int):
        self.accelerator = accelerator
        self.source = source
        self.cache_dir = Path(cache_dir).expanduser()
        self.batch_size = batch_size
        self.seconds = 0.0  # wall time spent loading the teacher and encoding
        self._identity: str | None = None
        self._said_unindexed = False

    def key(self, texts: Sequence[str], role: Role) -> str:
        """The entry of these texts: everything that changes the vectors, and the texts."""
        return digest({**self._fields(role), "texts": texts_fingerprint(texts)})

    def model_key(self, role: Role) -> str:
        """What every entry of this teacher and role shares: everything that changes the vectors but the texts."""
        return digest(self._fields(role))

    def _fields(self, role: Role) -> dict[str, object]:
        if self._identity is None:
            memo = self.cache_dir.parent / f"{self.cache_dir.name}-fingerprints.json"  # beside the entries
            self._identity = self.source.identity(self.accelerator, memo)
        return {"format": CACHE_FORMAT, "model": self._identity, **self.source.key_fields(role)}

    def embeddings(self, texts: Sequence[str], role: Role, reuse: bool = True) -> np.ndarray:
        """(len(texts), teacher_dim) float16, memory-mapped read-only; computed on a miss.

        On a miss, the rows other entries of this teacher and role hold are reused (`reuse`), and only the texts
        none holds are encoded (`reuse_rows`).
        """
        key = self.key(texts, role)
        entry = self.cache_dir / key
        cached = read_entry(entry, key, len(texts))
        # A hit only where every machine has the entry: a rank that skipped encoding while the others encode
        # would leave them waiting in a collective forever. A machine that has it writes it again.
        here = cached is not None
        if everyone(self.accelerator, here):
            if writes_for_this_machine(self.accelerator):
                mark_used(entry / "manifest.json")  # its last use, for `python -m distill.cache prune --unused_days`
            logger.info(f"teacher cache: {len(texts):,} {role} texts found in {entry}")
            return cached
        cached = None  # the memory map is dropped before the writer replaces the entry
        if reuse:
            assembled = self._reuse_rows(texts, role, key)
            if assembled is not None:
                return assembled
        logger.info(f"teacher cache: {len(texts):,} {role} texts not cached; encoding them into {entry}")
        if entry.exists() and not here:
            logger.warning(
                f"teacher cache entry {entry} is incomplete or corrupt; rebuilding it", main_process_only=True
            )
        self.accelerator.wait_for_everyone()  # every rank has decided before the writer replaces anything
        started = time.perf_counter()
        # Only one process per machine writes; the others gather the same chunks and drop them, so no rank
        # ever holds all the vectors in memory.
        writer, waited = self._writer(entry, key, texts, role)
        written = self._written_meanwhile(writer, entry, key, len(texts)) if waited else None
        if written is not None:
            return written
        try:
            self._encode_sharded(texts, role, writer)
        except BaseException:
            if writer is not None:
                writer.close()  # the staging folder stays for the next run to continue from
            raise
        self.seconds += time.perf_counter() - started
        return self._committed(writer, entry, key, len(texts))

    def _writer(
        self, entry: Path, key: str, texts: Sequence[str], role: Role, digests: np.ndarray | None = None
    ) -> tuple[CacheWriter | None, bool]:
        """The writer of `entry` on this machine's writing process (None on the others), with each text's digest
        (`digests`, where the caller has them already), and whether it waited: where another run holds the entry's
        lock, every process waits until it lets go (`wait_while_held`)."""
        writer = None
        if writes_for_this_machine(self.accelerator):
            digests = text_digests(texts) if digests is None else digests
            writer = CacheWriter(entry, key, len(texts), role, self.source, digests, self.model_key(role), job_id())
            news = writer.unlocked_news()
            if news:
                logger.warning(news)
        waited = wait_while_held(writer, lambda waits: any_process(self.accelerator, (waits,))[0], logger.warning)
        return writer, waited

    def _written_meanwhile(self, writer: CacheWriter | None, entry: Path, key: str, count: int) -> np.ndarray | None:
        """The entry, where another run put it in place while this one waited for its lock (on every machine);
        the writer is let go then. None where this run encodes it."""
        cached = read_entry(entry, key, count)
        if not everyone(self.accelerator, cached is not None):
            return None
        if writer is not None:
            writer.close()
        logger.info(f"teacher cache: {count:,} texts written by another run, found in {entry}")
        return cached

    def _committed(self, writer: CacheWriter | None, entry: Path, key: str, count: int) -> np.ndarray:
        """The entry, committed by its writer and read back by every process."""
        problem = writer.commit() if writer else None  # an error is raised after the barrier: nobody waits alone
        self.accelerator.wait_for_everyone()
        if problem:
            raise DistillError(problem)
        cached = read_entry(entry, key, count)
        if cached is None:
            raise DistillError(
                f"teacher cache entry {entry} could not be read back after writing; check that "
                f"{self.cache_dir} is writable and not full (or pass --teacher_cache_dir elsewhere)"
            )
        return cached

    def _reuse_rows(self, texts: Sequence[str], role: Role, key: str) -> np.ndarray | None:
        """The entry of `texts` put together from the rows other entries of this teacher and role hold, the texts
        none holds encoded first (as an entry of their own); None where no entry holds any of them.

        A text counts as held only where every machine holds it, so every process encodes the same texts. The
        entry is copied together on each machine by its writing process, REUSE_CHUNK rows at a time.
        """
        digests = text_digests(texts)
        found = find_rows(self.cache_dir, self.model_key(role), digests, self.source.path, role)
        self._say_unindexed(found.unindexed)
        held = agreed(self.accelerator, found.entry >= 0)
        if not held.any():
            return None
        missing = np.flatnonzero(~held)
        entry = self.cache_dir / key
        logger.info(
            f"teacher cache: {int(held.sum()):,} of {len(texts):,} {role} texts found in earlier entries; "
            f"encoding the other {len(missing):,}, then writing {entry}"
        )
        new_texts = pick(texts, missing)
        encoded = self.embeddings(new_texts, role, reuse=False) if new_texts else None
        self.accelerator.wait_for_everyone()  # every rank has decided before the writer replaces anything
        started = time.perf_counter()
        writer, waited = self._writer(entry, key, texts, role, digests)
        written = self._written_meanwhile(writer, entry, key, len(texts)) if waited else None
        if written is not None:
            return written
        if writer is not None:
            for source, taken in found.sources(held):
                copy_rows(writer, source, found.row[taken], taken)
            if encoded is not None:
                copy_rows(writer, encoded, np.arange(len(missing)), missing)
        self.seconds += time.perf_counter() - started
        assembled = self._committed(writer, entry, key, len(texts))
        if writer is not None and new_texts:  # its rows are in the new entry now: no second copy on disk
            shutil.rmtree(self.cache_dir / self.key(new_texts, role), ignore_errors=True)
        return assembled

    def _say_unindexed(self, count: int) -> None:
        if count and not self._said_unindexed:
            self._said_unindexed = True
            logger.warning(
                f"teacher cache: {count} entries of this teacher keep no per-text index (written by an earlier "
                "distill); their rows are read only by a run with the same texts, and other runs encode them again",
                main_process_only=True,
            )

    def _encode_sharded(self, texts: Sequence[str], role: Role, writer: CacheWriter | None) -> None:
        """Each process encodes its share of the texts, block by block, longest first, into `writer`.

        A batch that runs the GPU out of memory is encoded in halves, and so is every later one of its block
        (`map_sharded`): too large a --teacher_batch_size costs one failed batch per block. The texts, longest
        first, are cut into blocks of BLOCK_ROWS_PER_PROCESS per process; after each block the writers mark how
        many texts of that order are done. A restart begins after the texts every machine's writer has marked,
        whatever the number of processes now.
        """
        encoder = self.source.encoder(self.accelerator, texts, role)
        order = np.argsort(-encoder.lengths, kind="stable")  # longest first: a batch size that fits it fits the rest
        block = BLOCK_ROWS_PER_PROCESS * self.accelerator.num_processes
        done = self._texts_done(writer, len(texts), role)
        progress = progress_bar(self.accelerator, len(texts), f"teacher: {role} texts", done=done, unit="text")
        for start in range(done, len(texts), block):
            rows = np.sort(order[start : start + block])  # in text order; map_sharded shards and sorts them
            self._encode_block(encoder, rows, writer, progress.update)
            if writer is not None:
                writer.mark(min(start + block, len(texts)))
            if any_process(self.accelerator, (writer is not None and writer.problem is not None,))[0]:
                break  # a full disk is known at the first write: the commit says so now, not after every block
        progress.close()
        if encoder.done is not None:
            encoder.done()

    def _encode_block(
        self, encoder: Encoder, rows: np.ndarray, writer: CacheWriter | None, progress: Callable[[int], None]
    ) -> None:
        """The texts at `rows`, sharded over the processes, into `writer` (prepared ahead, in a thread, if it can)."""

        def at_rows(indices: list[int]) -> list[int]:
            return [int(rows[i]) for i in indices]

        def encode(batch: object) -> torch.Tensor:
            return encoder.encode(batch if encoder.prepare is not None else at_rows(batch))  # type: ignore[arg-type]

        def prepare(indices: list[int]) -> object:
            assert encoder.prepare is not None
            return encoder.prepare(at_rows(indices))

        def sink(indices: np.ndarray, vectors: np.ndarray) -> None:
            # every rank gets every gathered chunk, so every rank raises here at the same chunk: none waits
            if encoder.check is not None:
                encoder.check(vectors, rows[indices])
            if writer is not None:
                writer.write(rows[indices], vectors)

        map_sharded(
            self.accelerator,
            encoder.lengths[rows],
            encoder.batch_size or self.batch_size,
            encode,
            sink=sink,
            prepare=prepare if encoder.prepare is not None else None,
            too_long_hint=encoder.too_long_hint,
            progress=progress,
        )

    def _texts_done(self, writer: CacheWriter | None, count: int, role: Role) -> int:
        """The texts every machine's writer has marked done in an interrupted encoding (non-writers pass `count`)."""
        done = smallest(self.accelerator, writer.resume() if writer else count)
        if done:
            logger.warning(
                f"teacher cache: continuing an interrupted encoding at {done} of {count} {role} texts",
                main_process_only=True,
            )
        return done

    @property
    def loaded(self) -> bool:
        return self.source.loaded

    @property
    def load_seconds(self) -> float:
        return self.source.load_seconds

    def cost(self, texts: CostTexts, key: str) -> ModelCost | None:
        """The teacher's size and speed on this device, kept beside the cache (None where none compares).

        `key` is `self.key(texts.passages, "document")`, made by every process beforehand (it can be collective).
        """
        costs = TeacherCosts(self.cache_dir, key, device_label(self.accelerator.device), texts)
        return self.source.cost(self.accelerator, texts, costs)

    def release(self) -> None:
        """Free the teacher's memory before the student trains."""
        self.source.release()


@dataclass(frozen=True)
class CacheSettings:
    """Where the teacher stage keeps its vectors and how it encodes them."""

    folder: str  # --teacher_cache_dir
    batch_size: int  # texts per forward pass per process
    mine_hard_negatives: int = 0  # negatives mined per query from the cached vectors, where the data has none


@dataclass
class TeacherVectors:
    """Cached teacher embeddings (memory-mapped) of everything the run uses."""

    phase1: np.ndarray | None
    queries: np.ndarray | None
    passages: np.ndarray | None  # positives, then every query's negatives
    passage_rows: np.ndarray | None  # (queries, 1 + negatives): row of each query's positive, then its negatives
    evaluation: EvalVectors | None
    seconds: dict[str, float]  # teacher time spent per phase (0 on a warm cache), loading included
    loaded: bool  # whether any teacher model was loaded at all
    load_seconds: float  # the part of `seconds` spent loading the teacher (0 when not loaded)
    cost: ModelCost | None = None  # its size and speed on the main process's device (distill/stages/cost.py)
    cost_note: str | None = None  # why `cost` is missing or has no size (an API, a vectors file)
    members: dict[str, EvalVectors] = field(default_factory=dict)  # a combined teacher's members, by name
    scores: np.ndarray | None = None  # the reranker's, of each query's passage_rows (distill/stages/candidates.py)
    reranker: dict[str, object] | None = None  # what results.json says of the reranker
    mined: bool = False  # passage_rows' negatives were mined from the teacher's vectors, not the data's

    def fit_sample(self, data: DistillData) -> tuple[Sequence[str], np.ndarray | None]:
        """Texts and teacher vectors a projection or basis is fitted on: phase 1's, else phase 2's passages."""
        if data.phase1_texts and self.phase1 is not None:
            return data.phase1_texts, self.phase1
        return data.phase2.passages, self.passages

    @property
    def dim(self) -> int:
        """The teacher's dimension (phase 1's vectors come from another model under `phase1_teacher_model`)."""
        for vectors in (self.queries, self.evaluation.corpus if self.evaluation else None, self.phase1):
            if vectors is not None:
                return int(vectors.shape[1])
        raise DistillError("nothing to distill: both phases are skipped and there is no evaluation set")

    @property
    def fit_dim(self) -> int:
        """The dimension of the vectors `fit_sample` returns."""
        return int(self.phase1.shape[1]) if self.phase1 is not None else self.dim


def embed_with_teacher(
    accelerator: Accelerator,
    settings: TeacherConfig,
    context: TeacherContext,
    cache: CacheSettings,
    data: DistillData,
    cost_texts: CostTexts | None = None,
) -> TeacherVectors:
    """The teacher stage: every text the run needs, through the teacher cache; the teacher is freed afterwards.

    With `cost_texts`, the teacher's size and speed are measured too (distill/stages/cost.py): while it is loaded, or
    from the figures kept beside the cache for this device, or, with neither, by loading it once on the main
    process.
    """
    caches = partial(TeacherCache, accelerator, cache_dir=cache.folder, batch_size=cache.batch_size)
    teacher = caches(make_source(settings, context, caches))
    phase1_cache = teacher  # phase 1's texts go through phase 1's own target where phase1_teacher_model names one
    if data.phase1_texts and settings.phase1_teacher_model:
        phase1_cache = caches(make_source(settings, context, caches, phase1=True))
    phase1 = phase1_cache.embeddings(data.phase1_texts, "document") if data.phase1_texts else None
    seconds = {"phase1": phase1_cache.seconds}
    own = phase1_cache is not teacher  # loaded and freed before the teacher
    phase1_loaded, phase1_load_seconds = (phase1_cache.loaded, phase1_cache.load_seconds) if own else (False, 0.0)
    if own:
        phase1_cache.release()
    queries = passages = rows = None
    started = teacher.seconds  # the teacher's time before phase 2: phase 1's, unless phase 1 has its own target
    if len(data.phase2):
        texts, rows = passage_texts(data.phase2)
        queries = teacher.embeddings(data.phase2.queries, "query")
        passages = teacher.embeddings(texts, "document")
    seconds["phase2"] = teacher.seconds - started
    evaluation, members = None, {}
    if data.evaluation is not None:
        evaluation = eval_vectors(teacher, data.evaluation)
        for member in members_of(teacher.source):  # a combined teacher's members, scored apart too (cached)
            members[member.source.name] = eval_vectors(member, data.evaluation)
            member.source.release()
    seconds["evaluation"] = teacher.seconds - started - seconds["phase2"]
    loaded = teacher.loaded or phase1_loaded
    cost = None
    if cost_texts is not None:
        key = teacher.key(cost_texts.passages, "document")  # collective the first time: on every process
        cost = main_decides(accelerator, lambda: teacher.cost(cost_texts, key))
    teacher.release()
    release_freed_memory()  # the teacher's freed weights and activations go back to the OS
    mined = rows is not None and cache.mine_hard_negatives > 0 and rows.shape[1] == 1  # the data brings none
    if mined:
        # after the teacher is gone: on a GPU the search needs the device memory the teacher held
        found = mined_negatives(accelerator, cache.mine_hard_negatives, texts, queries, passages)
        rows = np.concatenate([rows, found], axis=1)
    load_seconds = teacher.load_seconds + phase1_load_seconds
    note = teacher.source.cost_note
    return TeacherVectors(
        phase1, queries, passages, rows, evaluation, seconds, loaded, load_seconds, cost, note, members, mined=mined
    )


def eval_vectors(cache: CachedSource, evaluation: EvalSet) -> EvalVectors:
    """A teacher's unit vectors of the evaluation set's queries, corpus and STS texts, through its cache."""

    def embed(texts: Sequence[str], role: Role) -> np.ndarray:
        return np.asarray(cache.embeddings(texts, role), dtype=np.float32)

    sts = embed(evaluation.sts_texts, "document") if evaluation.sts_texts else None
    return EvalVectors(embed(evaluation.queries, "query"), embed(evaluation.corpus, "document"), sts)
