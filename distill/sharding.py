"""Inference sharded over the processes: each encodes its share of a list, longest texts first, and the shares are
gathered (or written to a sink) in the list's order. The teacher cache, the student's evaluation and the fitting of
the projection encode through it."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from accelerate.logging import get_logger

from distill.errors import OutOfMemory, memory_message

if TYPE_CHECKING:
    from accelerate import Accelerator

logger = get_logger(__name__)


def map_sharded(
    accelerator: Accelerator,
    lengths: np.ndarray,
    batch_size: int,
    encode_batch: Callable[[Any], torch.Tensor],
    chunk_size: int = 1024,
    sink: Callable[[np.ndarray, np.ndarray], None] | None = None,
    prepare: Callable[[list[int]], object] | None = None,
    too_long_hint: str = "lower the max sequence length or run on a device with more memory",
    progress: Callable[[int], None] | None = None,
) -> np.ndarray | None:
    """Run `encode_batch` over all items, each process on its share, longest first.

    Shares are padded to equal length (`split_between_processes(apply_padding=True)`) and gathered every
    `chunk_size` items, so each rank makes the same number of collective calls and memory stays bounded.
    Each gathered chunk goes to `sink(indices, vectors)`; without a sink the rows are collected and
    returned as one (len(lengths), dim) float32 array (for small sets, e.g. evaluation).

    With `prepare`, `encode_batch` gets `prepare(indices)` instead of the indices, and the next batch is
    prepared in a background thread while this one encodes: tokenizing (which releases the GIL) overlaps
    the model's forward pass instead of leaving a GPU idle between batches.

    `progress(n)` hears of every gathered chunk: n items of all processes done (their padding left out).

    A batch that runs the device out of memory is encoded in halves, and so is every later batch of this
    process (`_encode_all`); the gathers do not change, so ranks may settle on different sizes. A single
    item that does not fit raises `OutOfMemory` with `too_long_hint`.
    """
    order = np.random.default_rng(len(lengths)).permutation(len(lengths)).tolist()  # balances lengths over ranks
    with accelerator.split_between_processes(order, apply_padding=True) as shard:
        shard = list(shard)
    shard = [shard[j] for j in np.argsort(-np.asarray(lengths)[shard], kind="stable")]
    chunks = [shard[start : start + chunk_size] for start in range(0, len(shard), chunk_size)]
    batches = [chunk[b : b + batch_size] for chunk in chunks for b in range(0, len(chunk), batch_size)]
    encoded = _encode_all(batches, encode_batch, prepare, too_long_hint)
    collected: list[tuple[np.ndarray, np.ndarray]] = []
    for chunk in chunks:
        parts, rows = [], 0
        while rows < len(chunk):  # a chunk's batches, however many they became
            parts.append(next(encoded))
            rows += len(parts[-1])
        vectors, indices = accelerator.gather(
            (torch.cat(parts).float().contiguous(), torch.tensor(chunk, device=parts[0].device))
        )
        pair = (indices.cpu().numpy(), vectors.cpu().numpy())
        if progress is not None:
            progress(len(np.unique(pair[0])))
        if sink is not None:
            sink(*pair)
        else:
            collected.append(pair)
    if sink is not None:
        return None
    if not collected:
        raise ValueError("map_sharded needs at least one item")
    out = np.zeros((len(lengths), collected[0][1].shape[1]), dtype=np.float32)
    for indices, vectors in collected:
        out[indices] = vectors  # padded duplicates rewrite the same row with the same vector
    return out


def _encode_all(
    batches: list[list[int]],
    encode_batch: Callable[[object], torch.Tensor],
    prepare: Callable | None,
    too_long_hint: str,
) -> Iterator[torch.Tensor]:
    """encode_batch of each batch in turn; with `prepare`, batch i + 1 is prepared while batch i encodes.

    When the device runs out of memory, that batch and every one after it are split to half its size and
    encoding goes on: batches come longest first, so the size that fits the first fits the rest. The
    accelerate `find_executable_batch_size` way (restart with half the batch) would repeat the gathers.
    """
    queue = deque(batches)
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="distill-prepare") if prepare else nullcontext() as pool:

        def ahead() -> Future | None:  # the next batch's preparation, started now
            return pool.submit(prepare, queue[0]) if pool is not None and prepare is not None and queue else None

        pending = ahead()
        while queue:
            batch = queue.popleft()
            item = batch
            if pending is not None:
                item = pending.result()
                pending = ahead()
            try:
                out, problem = encode_batch(item), None
            except torch.OutOfMemoryError as e:
                out, problem = None, memory_message(e)  # the except block ends: the error's tensors are freed
            if out is not None:
                yield out
                continue
            del item
            if len(batch) == 1:
                raise OutOfMemory(f"out of device memory encoding a single text ({problem}); {too_long_hint}")
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            size = (len(batch) + 1) // 2
            logger.warning(
                f"out of device memory encoding {len(batch)} texts at once ({problem}); "
                f"going on with batches of at most {size}",
                main_process_only=False,
            )
            if pending is not None:
                pending.result()  # prepared for the old plan; waited for so no two preparations overlap
            queue = deque(b[i : i + size] for b in (batch, *queue) for i in range(0, len(b), size))
            pending = ahead()
