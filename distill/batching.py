"""Batches for the student: texts tokenized once, grouped by length, padded per batch.

`LengthGroupedBatchSampler` yields GLOBAL batches (batch_size x num_processes indices) that depend only on
the seed, the epoch and the global batch size; Accelerate (`split_batches=True`) hands each process its
slice. So 2 processes x batch B see exactly the batches 1 process x batch 2B sees, and grouping similar
lengths leaves little padding (about 2% against 56% for random batches on the demo data).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from itertools import chain
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from accelerate.logging import get_logger
from torch.utils.data import DataLoader, Dataset

from distill.files import drop_pages

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = get_logger(__name__)

MEGABATCH_FACTOR = 32  # batches sorted together: larger groups tighter, smaller keeps more randomness
CHUNK_MIN_SAVING = 0.05  # a further forward chunk must save this share of a batch's tokens (length_chunks)
MAX_CUT_POINTS = 256  # length_chunks considers at most this many cut points: O(points^2) work per chunk
# Texts per tokenizer call when tokenizing a whole set: the fast tokenizer's per-token Python objects for
# one call stay in the heap's free lists afterwards (4,096 at once: +25 MiB peak RSS at 40k texts against
# 512; no measured speed difference, docs/BENCHMARKS.md)
TOKENIZE_CHUNK = 512


def ids_of(tokenizer: PreTrainedTokenizerBase) -> Callable[[Sequence[str]], list[list[int]]]:
    """What tokenizes a batch of texts into their ids, special tokens added, nothing truncated.

    For a fast tokenizer, the `tokenizers` backend's own `encode_batch_fast`, the call transformers makes inside
    its own (with its `split_special_tokens`), less what a run does not read: no offsets, and no attention masks
    or token types as Python lists. The ids are the same; the pass takes 0.6x the time of transformers' call on 2
    cores (docs/BENCHMARKS.md). Any other tokenizer: transformers' call.
    """
    backend: Any = getattr(tokenizer, "backend_tokenizer", None)
    fast = getattr(backend, "encode_batch_fast", None)
    if fast is None:
        return lambda batch: tokenizer(batch, add_special_tokens=True, truncation=False, verbose=False)["input_ids"]
    split = bool(getattr(tokenizer, "split_special_tokens", False))

    def encode(batch: Sequence[str]) -> list[list[int]]:
        backend.no_truncation()  # transformers sets both for each of its own calls, and may have left them set
        backend.no_padding()
        backend.encode_special_tokens = split
        return [encoding.ids for encoding in fast(batch, add_special_tokens=True)]

    return encode


class TokenizedTexts:
    """Texts tokenized once (truncated to `max_length`), stored as one flat int32 array plus offsets.

    `pad_to_multiple_of` rounds each batch's width up to a multiple of N tokens (never past `max_length`
    unless a text is that long): a few distinct batch shapes instead of one per length, so freed activation
    blocks fit later batches more often (on CPU, 100-190 MiB lower peak RSS at 40k texts, at some speed cost;
    docs/BENCHMARKS.md); GPUs' tensor cores prefer such widths too.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        texts: Sequence[str],
        max_length: int,
        chunk_size: int = TOKENIZE_CHUNK,
        pad_to_multiple_of: int = 1,
    ):
        self.max_length, self.pad_to_multiple_of = max_length, pad_to_multiple_of
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.padding_side = getattr(tokenizer, "padding_side", "right")
        self.with_token_types = "token_type_ids" in getattr(tokenizer, "model_input_names", ())
        pieces, lengths, self.truncated = [], [], 0
        encode = ids_of(tokenizer)
        for start in range(0, len(texts), chunk_size):  # chunks bound the tokenizer's transient memory
            batch = texts[start : start + chunk_size]
            ids = encode(batch)
            long = [i for i, x in enumerate(ids) if len(x) > max_length]
            if long:  # re-tokenize only the few long texts, with the tokenizer's own truncation
                cut = tokenizer([batch[i] for i in long], truncation=True, max_length=max_length)["input_ids"]
                for i, x in zip(long, cut):
                    ids[i] = x
            self.truncated += len(long)
            counts = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
            # one flat array per chunk, not one per text: 40k small arrays interleaved with the tokenizer's
            # freed chunks fragmented the heap (+12 MiB resident at 40k texts, measured in isolation)
            pieces.append(np.fromiter(chain.from_iterable(ids), dtype=np.int32, count=int(counts.sum())))
            lengths.append(counts)
            del ids
        self.lengths = np.concatenate(lengths) if lengths else np.zeros(0, dtype=np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(self.lengths)])
        self.ids = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int32)

    def __len__(self) -> int:
        return len(self.lengths)

    def features(self, indices: list[int]) -> dict[str, torch.Tensor]:
        """Padded input_ids / attention_mask (/ token_type_ids) for these texts, like the tokenizer's own padding.

        Built with one gather from the flat token array, not a copy per row: at batch 256 a per-row loop costs
        milliseconds of host time per step, which a GPU spends idle.
        """
        lengths = self.lengths[indices]
        width = int(self.padded_widths(lengths.max()))
        columns = np.arange(width)[None, :]
        if self.padding_side == "left":
            columns = columns - (width - lengths)[:, None]  # position of each column inside its text
        mask = (columns >= 0) & (columns < lengths[:, None])
        positions = np.where(mask, self.offsets[indices][:, None] + columns, 0)
        input_ids = torch.from_numpy(np.where(mask, self.ids[positions], self.pad_token_id))
        features = {"input_ids": input_ids.long(), "attention_mask": torch.from_numpy(mask).long()}
        if self.with_token_types:
            features["token_type_ids"] = torch.zeros_like(features["input_ids"])
        return features

    def padded_widths(self, longest: np.ndarray | int) -> np.ndarray:
        """The padded width of a batch whose longest text has `longest` tokens (`features`' rounding)."""
        multiple = self.pad_to_multiple_of
        return np.maximum(longest, np.minimum(-(-np.asarray(longest) // multiple) * multiple, self.max_length))

    def chunked_features(self, indices: list[int], max_chunks: int) -> dict[str, object]:
        """These texts in at most `max_chunks` forward chunks of similar length (`length_chunks`).

        {"chunks": [features, ...]} plus, when the rows were reordered, "restore": the positions that put the
        concatenated chunk outputs back in the order of `indices` (`assemble_chunks`).
        """
        chunks = length_chunks(self.lengths[indices], max_chunks)
        rows = np.asarray(indices)
        out: dict[str, object] = {"chunks": [self.features(rows[chunk].tolist()) for chunk in chunks]}
        if len(chunks) > 1:
            out["restore"] = torch.from_numpy(np.argsort(np.concatenate(chunks)))
        return out


class FlatTexts(TokenizedTexts):
    """Texts batched unpadded: a batch's texts end to end as one sequence, with where each starts and ends.

    The features sentence-transformers' pooling reads as "flattened" (as transformers' `DataCollatorWithFlattening`
    makes them): input_ids and position_ids (1, tokens), cu_seq_lens_q / _k (texts + 1,) and the longest text. A
    student switched to unpadded attention (`distill/students/attention.py`) computes no token of padding.
    """

    def __init__(self, *args: Any, position_offset: int = 0, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.position_offset = position_offset  # RoBERTa-family positions start after the padding index

    def features(self, indices: list[int]) -> dict[str, Any]:
        rows = np.asarray(indices)
        lengths = self.lengths[rows]
        ends = np.cumsum(lengths)
        within = np.arange(int(ends[-1])) - np.repeat(ends - lengths, lengths)  # each token's position in its text
        ids = self.ids[np.repeat(self.offsets[rows], lengths) + within]
        bounds = torch.from_numpy(np.concatenate([[0], ends]).astype(np.int32))
        features: dict[str, Any] = {
            "input_ids": torch.from_numpy(ids.astype(np.int64))[None, :],
            "position_ids": torch.from_numpy(within + self.position_offset)[None, :],
            "cu_seq_lens_q": bounds,
            "cu_seq_lens_k": bounds,
            "max_length_q": int(lengths.max()),
            "max_length_k": int(lengths.max()),
        }
        if self.with_token_types:
            features["token_type_ids"] = torch.zeros_like(features["input_ids"])
        return features

    def chunked_features(self, indices: list[int], max_chunks: int) -> dict[str, object]:
        """One chunk: without padding, chunks of similar length save nothing."""
        return {"chunks": [self.features(indices)]}


def assemble_chunks(outputs: list[torch.Tensor], chunked: dict[str, object]) -> torch.Tensor:
    """The outputs of `chunked_features`' chunks, one row per text, in the order the texts were asked for."""
    rows = torch.cat(outputs) if len(outputs) > 1 else outputs[0]
    restore = chunked.get("restore")
    return rows if restore is None else rows[restore]


def length_chunks(lengths: np.ndarray, max_chunks: int, min_saving: float = CHUNK_MIN_SAVING) -> list[np.ndarray]:
    """Positions of `lengths` in at most `max_chunks` groups of similar length that leave the least padding.

    Phase 2's batches are sorted by query + passage length, so a batch's queries (or passages) alone still
    vary: on the demo they are padded to 2.1x their real tokens. Forwarding them in a few chunks, each padded
    to its own longest text, cuts that. The lengths are sorted longest first and cut into contiguous chunks, a
    chunk [i, j) costing (j - i) x sorted[i] tokens; the cuts are the optimal ones (dynamic programming over
    all cut points; above `MAX_CUT_POINTS` rows, cuts only every ceil(rows / MAX_CUT_POINTS) rows, so the work
    stays bounded for large GPU batches). Each further chunk is one more forward call, so it is taken only if it
    saves at least `min_saving` of the batch's one-chunk tokens. One chunk keeps the rows in their given order.
    """
    n = len(lengths)
    if min(max_chunks, n) <= 1:
        return [np.arange(n)]
    order = np.argsort(-np.asarray(lengths), kind="stable")
    sorted_lengths = np.append(np.asarray(lengths, dtype=np.float64)[order], 0.0)  # (n + 1,) longest first
    points = np.append(np.arange(0, n, -(-n // MAX_CUT_POINTS)), n)  # where a chunk may start or end
    starts = np.arange(len(points))
    rows = points[None, :] - points[:, None]  # rows[i, j]: rows from cut point i to cut point j
    cost = np.where(rows > 0, rows * sorted_lengths[points][:, None], np.inf)  # tokens of that chunk
    best = np.full(len(points), np.inf)
    best[0] = 0.0
    last = len(points) - 1  # the cut point at the batch's end
    totals, last_cuts = [], []
    max_chunks = min(max_chunks, last)  # no more chunks than cut intervals (rows, up to MAX_CUT_POINTS)
    for _ in range(max_chunks):  # best[j]: fewest tokens up to cut point j in exactly c chunks
        candidates = best[:, None] + cost
        cut = candidates.argmin(axis=0)
        best = candidates[cut, starts]
        totals.append(best[last])
        last_cuts.append(cut)
    chunks = 1
    while chunks < max_chunks and totals[chunks] <= totals[chunks - 1] - min_saving * totals[0]:
        chunks += 1
    if chunks == 1:
        return [np.arange(n)]
    bounds, end = [last], last
    for c in range(chunks - 1, -1, -1):
        end = int(last_cuts[c][end])
        bounds.append(end)
    cuts = points[bounds[::-1]]
    return [order[a:b] for a, b in zip(cuts[:-1], cuts[1:])]


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
