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
`python -m distill.cache list|prune`) is distill/cache.py.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.logging import get_logger

from distill.allocator import release_freed_memory
from distill.batching import map_sharded
from distill.cache import CACHE_FORMAT, CacheWriter, Role, read_entry, touch
from distill.config import Config
from distill.data import DistillData, EvalSet, EvalVectors, passage_texts
from distill.distributed import everyone, main_decides, progress_bar, smallest, writes_for_this_machine
from distill.efficiency import CostTexts, ModelCost, TeacherCosts, device_label
from distill.errors import DistillError
from distill.teachers import CachedSource, Encoder, Source, make_source, members_of

logger = get_logger(__name__)

BLOCK_ROWS_PER_PROCESS = 16384  # texts each process encodes between two progress marks: what a kill can cost


def texts_fingerprint(texts: list[str]) -> str:
    digest = hashlib.sha256()
    for text in texts:
        encoded = text.encode("utf8")
        digest.update(len(encoded).to_bytes(8, "little"))  # length prefix: ["ab","c"] != ["a","bc"]
        digest.update(encoded)
    return digest.hexdigest()


class TeacherCache:
    """Content-keyed teacher embeddings from one source; the source encodes only on a cache miss."""

    def __init__(self, accelerator: Accelerator, source: Source, cache_dir: str | os.PathLike, batch_size: int):
        self.accelerator = accelerator
        self.source = source
        self.cache_dir = Path(cache_dir).expanduser()
        self.batch_size = batch_size
        self.seconds = 0.0  # wall time spent loading the teacher and encoding
        self._identity: str | None = None

    def key(self, texts: list[str], role: Role) -> str:
        if self._identity is None:
            memo = self.cache_dir.parent / f"{self.cache_dir.name}-fingerprints.json"  # beside the entries
            self._identity = self.source.identity(self.accelerator, memo)
        fields = {
            "format": CACHE_FORMAT,
            "model": self._identity,
            **self.source.key_fields(role),
            "texts": texts_fingerprint(texts),
        }
        return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:32]

    def embeddings(self, texts: list[str], role: Role) -> np.ndarray:
        """(len(texts), teacher_dim) float16, memory-mapped read-only; computed on a miss."""
        key = self.key(texts, role)
        entry = self.cache_dir / key
        cached = read_entry(entry, key, len(texts))
        # A hit only where every machine has the entry: a rank that skipped encoding while the others encode
        # would leave them waiting in a collective forever. A machine that has it writes it again.
        here = cached is not None
        if everyone(self.accelerator, here):
            if writes_for_this_machine(self.accelerator):
                touch(entry)  # its last use, for `python -m distill.cache prune --unused_days`
            logger.info(f"teacher cache: {len(texts):,} {role} texts found in {entry}")
            return cached
        logger.info(f"teacher cache: {len(texts):,} {role} texts not cached; encoding them into {entry}")
        cached = None  # the memory map is dropped before the writer replaces the entry
        if entry.exists() and not here:
            logger.warning(
                f"teacher cache entry {entry} is incomplete or corrupt; rebuilding it", main_process_only=True
            )
        self.accelerator.wait_for_everyone()  # every rank has decided before the writer replaces anything
        started = time.perf_counter()
        # Only one process per machine writes; the others gather the same chunks and drop them, so no rank
        # ever holds all the vectors in memory.
        machine = writes_for_this_machine(self.accelerator)
        writer = CacheWriter(entry, key, len(texts), role, self.source) if machine else None
        try:
            self._encode_sharded(texts, role, writer)
        except BaseException:
            if writer is not None:
                writer.close()  # the staging folder stays for the next run to continue from
            raise
        self.seconds += time.perf_counter() - started
        problem = writer.commit() if writer else None  # an error is raised after the barrier: nobody waits alone
        self.accelerator.wait_for_everyone()
        if problem:
            raise DistillError(problem)
        cached = read_entry(entry, key, len(texts))
        if cached is None:
            raise DistillError(
                f"teacher cache entry {entry} could not be read back after writing; check that "
                f"{self.cache_dir} is writable and not full (or pass --teacher_cache_dir elsewhere)"
            )
        return cached

    def _encode_sharded(self, texts: list[str], role: Role, writer: CacheWriter | None) -> None:
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


MINING_PASSAGE_CHUNK = 16384  # passages scored at once against 1,024 queries: a few (1024 x 16384) float blocks
MINING_MARGIN = 0.05  # of the positive's score: what scores closer is likelier an unlabelled positive


def mine_hard_negatives(
    queries: np.ndarray,
    passages: np.ndarray,
    count: int,
    margin: float = MINING_MARGIN,
    chunk_size: int = 1024,
    passage_ids: np.ndarray | None = None,
    device: torch.device | str = "cpu",
) -> np.ndarray:
    """For query i (whose positive is passage i), the `count` passages the teacher ranks highest among the rest.

    Passages scoring above the positive's own score less `margin` x its magnitude are skipped: they are more
    likely unlabelled positives than negatives (sentence-transformers' `relative_margin`, sign-safe as there).
    A query left with fewer than `count` passages below that line gets the highest-scoring skipped ones to make
    up its count (a warning says for how many queries), never its positive. `passage_ids` (equal for identical
    texts) keeps a text several pairs share from being mined for a query whose positive it is, or twice for one
    query. Exhaustive, O(n^2 d) on the cached vectors, on `device` (`mine_rows` says how memory stays bounded).
    Returns (len(queries), count) passage indices.
    """
    mined, relaxed = mine_rows(queries, passages, count, margin, chunk_size, passage_ids, device)
    warn_relaxed(int(relaxed.sum()), len(queries), count, margin)
    return mined


def mine_rows(
    queries: np.ndarray,
    passages: np.ndarray,
    count: int,
    margin: float = MINING_MARGIN,
    chunk_size: int = 1024,
    passage_ids: np.ndarray | None = None,
    device: torch.device | str = "cpu",
    rows: np.ndarray | None = None,
    passage_chunk: int = MINING_PASSAGE_CHUNK,
) -> tuple[np.ndarray, np.ndarray]:
    """`mine_hard_negatives` for the queries `rows` (default all): (len(rows), count) passage indices, and for each
    of those queries whether it took passages within the margin.

    A chunk of `chunk_size` queries meets `passage_chunk` passages at a time and keeps a running top-`count`, so
    the memory beyond the (memory-mapped) vectors is those two chunks, whatever the number of pairs: no process
    holds every passage widened to float32.
    """
    ids = np.arange(len(passages)) if passage_ids is None else np.asarray(passage_ids, dtype=np.int64)
    distinct, first_rows = np.unique(ids, return_index=True)
    if len(distinct) <= count:
        raise DistillError(
            f"mine_hard_negatives {count} needs more than {count} passages of distinct text, the data has "
            f"{len(distinct)}; lower --mine_hard_negatives or give more pairs"
        )
    rows = np.arange(len(queries)) if rows is None else np.asarray(rows, dtype=np.int64)
    ids_of = torch.from_numpy(ids).to(device)
    repeated = torch.ones(len(passages), dtype=torch.bool, device=device)  # every row but the first of each text
    repeated[torch.from_numpy(first_rows).to(device)] = False
    # every score lies within +-bound: moved down by `offset`, a passage within the margin ranks below all others
    bound = largest_norm(queries, passage_chunk) * largest_norm(passages, passage_chunk)
    mined = np.zeros((len(rows), count), dtype=np.int64)
    relaxed = np.zeros(len(rows), dtype=bool)
    for start in range(0, len(rows), chunk_size):
        own = rows[start : start + chunk_size]
        best, best_index = best_passages(queries, passages, own, count, margin, 2 * bound + 1, passage_chunk, device,
                                         (repeated, ids_of))  # fmt: skip
        relaxed[start : start + len(own)] = (best < -bound - 0.5).any(dim=1).cpu().numpy()  # below every score
        mined[start : start + len(own)] = best_index.cpu().numpy()
    return mined, relaxed


def best_passages(
    queries: np.ndarray,
    passages: np.ndarray,
    own: np.ndarray,
    count: int,
    margin: float,
    offset: float,
    passage_chunk: int,
    device: torch.device | str,
    masks: tuple[torch.Tensor, torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """The queries `own`'s top-`count` (ranking, passage index), a chunk of passages at a time."""
    repeated, ids_of = masks
    q = widened(queries, own, device)  # (chunk, dim)
    positive = (q * widened(passages, own, device)).sum(dim=1)
    threshold = positive - positive.abs() * margin  # (chunk,); (1 - margin) x positive would rise when it is < 0
    own_ids = ids_of[torch.from_numpy(own).to(device)]
    best = torch.empty((len(own), 0), device=device)
    best_index = torch.empty((len(own), 0), dtype=torch.long, device=device)
    for first in range(0, len(passages), passage_chunk):
        index = torch.arange(first, min(first + passage_chunk, len(passages)), device=device)
        scores = q @ widened(passages, np.arange(first, first + len(index)), device).T  # (chunk, passage chunk)
        # below the threshold first, then (only for a query short of those) the skipped ones, each by score
        ranking = torch.where(scores > threshold[:, None], scores - offset, scores)
        ranking.masked_fill_(repeated[index][None, :] | (ids_of[index][None, :] == own_ids[:, None]), -torch.inf)
        top = torch.topk(ranking, min(count, len(index)), dim=1)
        values, indices = torch.cat([best, top.values], 1), torch.cat([best_index, index[top.indices]], 1)
        best, keep = torch.topk(values, min(count, values.shape[1]), dim=1)
        best_index = indices.gather(1, keep)
    return best, best_index


def widened(vectors: np.ndarray, rows: np.ndarray, device: torch.device | str) -> torch.Tensor:
    """These rows of the (float16, memory-mapped) vectors as float32 on `device`; a run of rows is read as a slice."""
    run = len(rows) > 0 and rows[-1] - rows[0] + 1 == len(rows)
    block = vectors[rows[0] : rows[-1] + 1] if run else vectors[rows]
    return torch.from_numpy(np.asarray(block, dtype=np.float32)).to(device)


def largest_norm(vectors: np.ndarray, chunk: int) -> float:
    """The largest row norm, read a chunk at a time."""
    norms = (
        np.linalg.norm(np.asarray(vectors[i : i + chunk], np.float32), axis=1) for i in range(0, len(vectors), chunk)
    )
    return max(float(n.max()) for n in norms)


def warn_relaxed(relaxed: int, queries: int, count: int, margin: float) -> None:
    if relaxed:
        logger.warning(
            f"mine_hard_negatives {count}: {relaxed} of {queries} queries have fewer than {count} other passages "
            f"the teacher scores at least {margin:.0%} below their positive; they also got the highest-scoring closer "
            "ones (likelier unlabelled positives)"
        )


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
    cost: ModelCost | None = None  # its size and speed on the main process's device (efficiency.py)
    cost_note: str | None = None  # why `cost` is missing or has no size (an API, a vectors file)
    members: dict[str, EvalVectors] = field(default_factory=dict)  # a combined teacher's members, by name

    def fit_sample(self, data: DistillData) -> tuple[list[str], np.ndarray | None]:
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
    accelerator: Accelerator, config: Config, data: DistillData, cost_texts: CostTexts | None = None
) -> TeacherVectors:
    """The teacher stage: every text the run needs, through the teacher cache; the teacher is freed afterwards.

    With `cost_texts`, the teacher's size and speed are measured too (efficiency.py): while it is loaded, or
    from the figures kept beside the cache for this device, or, with neither, by loading it once on the main
    process.
    """
    batch_size = config.performance.teacher_batch_size or config.training.batch_size
    caches = partial(TeacherCache, accelerator, cache_dir=config.output.teacher_cache_dir, batch_size=batch_size)
    cache = caches(make_source(config, accelerator.device, caches))
    phase1_cache = cache  # phase 1's texts go through phase 1's own target where phase1_teacher_model names one
    if data.phase1_texts and config.model.phase1_teacher_model:
        phase1_cache = caches(make_source(config, accelerator.device, caches, phase1=True))
    phase1 = phase1_cache.embeddings(data.phase1_texts, "document") if data.phase1_texts else None
    seconds = {"phase1": phase1_cache.seconds}
    own = phase1_cache is not cache  # loaded and freed before the teacher
    phase1_loaded, phase1_load_seconds = (phase1_cache.loaded, phase1_cache.load_seconds) if own else (False, 0.0)
    if own:
        phase1_cache.release()
    queries = passages = rows = None
    started = cache.seconds  # the teacher's time before phase 2: phase 1's, unless phase 1 has its own target
    if len(data.phase2):
        texts, rows = passage_texts(data.phase2)
        queries = cache.embeddings(data.phase2.queries, "query")
        passages = cache.embeddings(texts, "document")
    seconds["phase2"] = cache.seconds - started
    evaluation, members = None, {}
    if data.evaluation is not None:
        evaluation = eval_vectors(cache, data.evaluation)
        for member in members_of(cache.source):  # a combined teacher's members, scored apart too (cached)
            members[member.source.name] = eval_vectors(member, data.evaluation)
            member.source.release()
    seconds["evaluation"] = cache.seconds - started - seconds["phase2"]
    loaded = cache.loaded or phase1_loaded
    cost = None
    if cost_texts is not None:
        key = cache.key(cost_texts.passages, "document")  # collective the first time: on every process
        cost = main_decides(accelerator, lambda: cache.cost(cost_texts, key))
    cache.release()
    release_freed_memory()  # the teacher's freed weights and activations go back to the OS
    if rows is not None and config.data.mine_hard_negatives and rows.shape[1] == 1:  # the data brings none
        # after the teacher is gone: on a GPU the search needs the device memory the teacher held
        rows = np.concatenate([rows, mined_negatives(accelerator, config, texts, queries, passages)], axis=1)
    load_seconds = cache.load_seconds + phase1_load_seconds
    note = cache.source.cost_note
    return TeacherVectors(
        phase1, queries, passages, rows, evaluation, seconds, loaded, load_seconds, cost, note, members
    )


def eval_vectors(cache: CachedSource, evaluation: EvalSet) -> EvalVectors:
    """A teacher's unit vectors of the evaluation set's queries, corpus and STS texts, through its cache."""

    def embed(texts: list[str], role: Role) -> np.ndarray:
        return np.asarray(cache.embeddings(texts, role), dtype=np.float32)

    sts = embed(evaluation.sts_texts, "document") if evaluation.sts_texts else None
    return EvalVectors(embed(evaluation.queries, "query"), embed(evaluation.corpus, "document"), sts)


def mined_negatives(
    accelerator: Accelerator, config: Config, texts: list[str], queries: np.ndarray, passages: np.ndarray
) -> np.ndarray:
    """The teacher's hardest negatives for each pair, other pairs' passages (nothing more to encode).

    Each process mines its share of the queries on its device (a GPU that runs out of memory hands its share to
    the CPU); the shares are gathered, so every process ends with all of them.
    """
    first_row: dict[str, int] = {}  # identical texts share an id: a copy of a positive is not its negative
    ids = np.array([first_row.setdefault(text, len(first_row)) for text in texts], dtype=np.int64)
    count, margin = config.data.mine_hard_negatives, MINING_MARGIN
    with accelerator.split_between_processes(list(range(len(queries))), apply_padding=True) as share:
        rows = np.asarray(share, dtype=np.int64)  # contiguous; the last process's padded with its last row
    mine = partial(mine_rows, queries, passages, count, margin, passage_ids=ids, rows=rows)
    try:
        mined, relaxed = mine(device=accelerator.device)
    except torch.OutOfMemoryError:
        release_freed_memory()
        logger.warning(
            f"mine_hard_negatives: {len(passages):,} passages do not fit in {accelerator.device}'s free memory; "
            "searching on the CPU instead (slower)",
            main_process_only=False,  # each process mines on its own device, and may run out alone
        )
        mined, relaxed = mine(device="cpu")
    both = torch.from_numpy(np.concatenate([mined, relaxed[:, None]], axis=1))
    if accelerator.num_processes > 1:  # the shares in process order (NCCL gathers from the device)
        both = accelerator.gather(both.to(accelerator.device)).cpu()
    gathered = both.numpy()[: len(queries)]  # less the last share's padding
    warn_relaxed(int(gathered[:, -1].sum()), len(queries), count, margin)
    return gathered[:, :-1]
