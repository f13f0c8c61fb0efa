"""Hard negatives mined from the teacher's cached vectors (`--mine_hard_negatives N`): for each query, the N other
passages the teacher ranks highest, less those that score too close to its positive (likelier unlabelled positives).

Each process mines its share of the queries on its device, in chunks of passages with a bounded top-k, and the
shares are gathered; nothing is encoded again. docs/BENCHMARKS.md gives its memory at several pair counts.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.logging import get_logger

from distill.allocator import release_freed_memory
from distill.errors import DistillError

logger = get_logger(__name__)


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


def mined_negatives(
    accelerator: Accelerator, count: int, texts: Sequence[str], queries: np.ndarray, passages: np.ndarray
) -> np.ndarray:
    """The teacher's hardest negatives for each pair, other pairs' passages (nothing more to encode).

    Each process mines its share of the queries on its device (a GPU that runs out of memory hands its share to
    the CPU); the shares are gathered, so every process ends with all of them.
    """
    first_row: dict[str, int] = {}  # identical texts share an id: a copy of a positive is not its negative
    ids = np.array([first_row.setdefault(text, len(first_row)) for text in texts], dtype=np.int64)
    margin = MINING_MARGIN
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
