"""Batches for the student: texts tokenized once, grouped by length, padded per batch.

`LengthGroupedBatchSampler` yields GLOBAL batches (batch_size x num_processes indices) that depend only on
the seed, the epoch and the global batch size; Accelerate (`split_batches=True`) hands each process its
slice. So 2 processes x batch B see exactly the batches 1 process x batch 2B sees, and grouping similar
lengths leaves little padding (about 2% against 56% for random batches on the demo data).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import numpy as np
import torch
from accelerate.logging import get_logger
from torch.utils.data import DataLoader, Dataset

from distill.files import drop_pages

if TYPE_CHECKING:
    from distill.tokens import TokenizedTexts

logger = get_logger(__name__)

MEGABATCH_FACTOR = 32  # batches sorted together: larger groups tighter, smaller keeps more randomness


LOADER_WORKERS = 2  # on a GPU: processes collating the next batches (make_loader)


def largest_first(order: np.ndarray, sizes: list) -> np.ndarray:
    """`order` with its largest batch (by `sizes`, one per entry) swapped to the front, in place: a batch that
    does not fit in memory fails at the first step, not hours in."""
    largest = int(np.argmax(sizes))
    order[[0, largest]] = order[[largest, 0]]
    return order


class LengthGroupedBatchSampler:
    """Deterministic global batches of similar-length samples, reshuffled every epoch.

    Each epoch starts with its widest batch (as transformers' `LengthGroupedSampler` does): a batch size
    that does not fit in memory fails at the first step, not hours in. (The allocator also meets the largest
    activations first; whether that lowers peak memory is not shown: docs/BENCHMARKS.md, memory.)
    """

    def __init__(
        self,
        lengths: np.ndarray,
        batch_size: int,
        seed: int,
        megabatch_factor: int = MEGABATCH_FACTOR,
    ):
        self.lengths = np.asarray(lengths)
        self.batch_size = batch_size  # global: per-process batch x number of processes
        self.seed = seed
        self.megabatch = batch_size * megabatch_factor
        self.epoch = 0
        self.drop_last = True  # every step has a full batch, so in-batch negatives and equivalence hold

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.lengths) // self.batch_size

    def __iter__(self) -> Iterator[list[int]]:
        if not len(self):  # fewer samples than one batch
            return
        rng = np.random.default_rng([self.seed, self.epoch])
        # the samples beyond the last full batch are left out at random, before grouping: cut from the grouped
        # stream, they would be the shortest of its last group, so the shortest texts would never be trained on
        order = rng.permutation(len(self.lengths))[: len(self) * self.batch_size]
        groups = [order[start : start + self.megabatch] for start in range(0, len(order), self.megabatch)]
        # longest first inside each group (a megabatch holds whole batches); the groups end to end, cut into batches
        stream = np.concatenate([g[np.argsort(-self.lengths[g], kind="stable")] for g in groups])
        batches = [stream[i : i + self.batch_size] for i in range(0, len(stream), self.batch_size)]
        order = rng.permutation(len(batches))  # groups themselves in random order, the widest first (class doc)
        for index in largest_first(order, [self.lengths[batches[i]].max() for i in order]):
            yield batches[index].tolist()


class TokenBudgetBatchSampler:
    """Global batches of as many similar-length texts as fit a token budget (`--max_tokens_per_batch`).

    As fairseq's `max_tokens`: the texts sorted by length (ties in a new random order each epoch) are cut into
    batches of at most `budget` padded tokens per process, a multiple of the process count each, and the batches
    come in random order, the one with the most tokens first (see `LengthGroupedBatchSampler`). Short texts come
    in large batches and long ones in small: a GPU gets about the same work every step. The cut points depend on
    the lengths alone, so every epoch has the same number of batches and the schedule knows it up front.

    Accelerate's `split_batches` hands each process `batch_size` items of a global batch: so each global batch is
    yielded as one group of rows per process (`batch_size` = the process count), flattened by `GroupedCollate`.
    """

    def __init__(self, widths: np.ndarray, budget: int, processes: int, seed: int):
        self.lengths = np.asarray(widths)  # padded widths: the sort key and the cost
        self.processes, self.seed, self.epoch = processes, seed, 0
        self.batch_size = processes  # one group of rows for each process
        self.drop_last = True
        self.sizes = self._cut(np.sort(self.lengths)[::-1], budget * processes)

    def _cut(self, widths: np.ndarray, budget: int) -> list[int]:
        """Rows of each batch, cutting the widths (longest first) greedily at the budget."""
        sizes, start = [], 0
        while start < len(widths):
            rows = max(self.processes, int(budget // widths[start]) // self.processes * self.processes)
            rows = min(rows, (len(widths) - start) // self.processes * self.processes)  # the last batch: what is left
            if rows == 0:
                break
            sizes.append(rows)
            start += rows
        return sizes

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.sizes)

    def __iter__(self) -> Iterator[list[tuple[int, ...]]]:
        rng = np.random.default_rng([self.seed, self.epoch])
        shuffled = rng.permutation(len(self.lengths))
        order = shuffled[np.argsort(-self.lengths[shuffled], kind="stable")]  # longest first, ties at random
        ends = np.cumsum(self.sizes)
        batches = [order[end - size : end] for end, size in zip(ends, self.sizes)]
        sequence = rng.permutation(len(batches))
        tokens = [len(batches[i]) * self.lengths[batches[i][0]] for i in sequence]
        for index in largest_first(sequence, tokens):
            yield [tuple(group.tolist()) for group in np.split(batches[index], self.processes)]


class GroupedCollate:
    """A collate over the rows of `TokenBudgetBatchSampler`'s groups: this process's group, flattened."""

    def __init__(self, collate: Callable[[list[int]], dict]):
        self.collate = collate

    def __call__(self, groups: list[tuple[int, ...]]) -> dict:
        return self.collate([row for group in groups for row in group])


class _Indices(Dataset):
    def __init__(self, size: int):
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> int:
        return index


class Phase1Batches:
    """Collate for phase 1: student features of texts, and their teacher vectors."""

    def __init__(self, texts: TokenizedTexts, teacher: np.ndarray):
        self.texts, self.teacher = texts, teacher

    def __call__(self, indices: list[int]) -> dict[str, object]:
        batch = {
            "texts": self.texts.features(indices),
            "teacher": torch.from_numpy(np.asarray(self.teacher[indices], dtype=np.float32)),  # (batch, t_dim)
        }
        let_go(self.teacher, self.texts)
        return batch


class Phase2Batches:
    """Collate for phase 2: queries, then passages (positives, then each query's hard negatives), with teacher vectors.

    `passage_rows[i]` lists the passage-text rows of query i: its positive first, then its negatives. Queries
    and passages each come in up to `max_chunks` forward chunks of similar length (`chunked_features`): the
    batch is grouped by query + passage length, so either alone would otherwise be padded far more.
    """

    def __init__(
        self,
        queries: TokenizedTexts,
        passages: TokenizedTexts,
        passage_rows: np.ndarray,
        teacher_queries: np.ndarray,
        teacher_passages: np.ndarray,
        max_chunks: int = 1,
        scores: np.ndarray | None = None,
    ):
        self.queries, self.passages, self.passage_rows = queries, passages, passage_rows
        self.teacher_queries, self.teacher_passages = teacher_queries, teacher_passages
        self.max_chunks = max_chunks
        self.scores = scores  # (queries, 1 + negatives): a reranker's score of each query's candidates, or None

    def __call__(self, indices: list[int]) -> dict[str, object]:
        rows = self.passage_rows[indices]  # (batch, 1 + negatives)
        passage_indices = np.concatenate([rows[:, 0], rows[:, 1:].reshape(-1)]).tolist()
        batch = {
            "queries": self.queries.chunked_features(indices, self.max_chunks),
            "passages": self.passages.chunked_features(passage_indices, self.max_chunks),
            "teacher_queries": torch.from_numpy(np.asarray(self.teacher_queries[indices], dtype=np.float32)),
            "teacher_passages": torch.from_numpy(np.asarray(self.teacher_passages[passage_indices], dtype=np.float32)),
        }
        if self.scores is not None:
            batch["reranker_scores"] = torch.from_numpy(np.asarray(self.scores[indices], dtype=np.float32))
        let_go(self.teacher_queries, self.teacher_passages, self.queries, self.passages)
        return batch


def let_go(*sources: object) -> None:
    """The pages of the memory-mapped teacher vectors and tokens a batch read, out of this process: an epoch reads
    every row once, and a process (or loader worker) would otherwise count the whole cache entry as its own."""
    for source in sources:
        drop_pages(getattr(source, "ids", source))


def make_loader(
    lengths: np.ndarray,
    global_batch_size: int,
    seed: int,
    collate: Callable[[list[int]], dict],
    sampler: TokenBudgetBatchSampler | None = None,
) -> DataLoader:
    """A DataLoader of global length-grouped batches (or `sampler`'s), for `accelerator.prepare`.

    On a GPU, two worker processes collate the next batches while the GPU runs this one, into pinned memory
    that Accelerate copies without blocking (`make_accelerator`). On a CPU the batches are collated in the
    training process: a worker would take a core from the step.
    """
    batches = sampler or LengthGroupedBatchSampler(lengths, global_batch_size, seed)
    workers = LOADER_WORKERS if torch.cuda.is_available() else 0
    return DataLoader(
        _Indices(len(lengths)),
        batch_sampler=batches,
        collate_fn=collate if sampler is None else GroupedCollate(collate),
        num_workers=workers,
        pin_memory=workers > 0,
        persistent_workers=workers > 0,
    )
