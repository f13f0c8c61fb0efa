"""Tokenized texts kept on disk: each machine tokenizes a list once, every process memory-maps the result.

A run tokenizes every text of both phases and the evaluation set before its first step. Done by every process on
every run, that is most of a large corpus's start-up (docs/BENCHMARKS.md). Here the first process of each machine
tokenizes a list (accelerate's `local_main_process_first`) into `<teacher_cache_dir>/tokens/<key>/`, and every
process reads the arrays back memory-mapped: a resume or a rerun tokenizes nothing, and the processes of a machine
share one copy of the tokens. The key hashes the texts, the tokenizer (its full definition), the kind of batches
and their arguments (the token limit, the padding multiple), so any change of them is another entry.

A tokenized list is an object whose arrays and plain fields are its whole state (`TokenizedTexts`, `FlatTexts`,
`StaticTexts`): its numpy arrays go to `.npy` files, the rest to `fields.json`.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable, Sequence
from functools import partial
from itertools import chain
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from distill.distributed import machine_first
from distill.files import check, mark_used, read_json, staged_folder, texts_fingerprint

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)  # said by the machine's process that tokenizes

TOKENS_FORMAT = 1


CHUNK_MIN_SAVING = 0.05  # a further forward chunk must save this share of a batch's tokens (length_chunks)

MAX_CUT_POINTS = 256  # length_chunks considers at most this many cut points: O(points^2) work per chunk


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


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """What decides a tokenizer's ids: its full definition (vocabulary, normalizer, special tokens), its class."""
    backend = getattr(tokenizer, "backend_tokenizer", tokenizer)  # transformers' fast tokenizer, or `tokenizers`'
    if hasattr(backend, "to_str"):
        # its truncation and padding are per-call state (transformers sets them for a call and may leave them)
        definition = json.dumps({**json.loads(backend.to_str()), "truncation": None, "padding": None}, sort_keys=True)
    else:
        definition = repr(sorted(tokenizer.get_vocab().items()))
    extra = [
        type(tokenizer).__name__,
        getattr(tokenizer, "padding_side", None),
        getattr(tokenizer, "pad_token_id", None),
    ]
    return hashlib.sha256((definition + json.dumps(extra, default=str)).encode()).hexdigest()


def cached_tokens(
    make: Callable[..., Any], tokenizer: Any, texts: Sequence[str], folder: Path | None, **kwargs: Any
) -> Any:
    """`make(tokenizer, texts, **kwargs)`, tokenized once per machine into `folder` and memory-mapped from there
    (without a folder: tokenized here)."""
    if folder is None:
        return make(tokenizer, texts, **kwargs)
    cls, bound = (make.func, make.keywords) if isinstance(make, partial) else (make, {})
    settings = {"format": TOKENS_FORMAT, "kind": cls.__qualname__, "texts": texts_fingerprint(texts), **bound, **kwargs}
    settings["tokenizer"] = tokenizer_fingerprint(tokenizer)
    key = hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:32]
    entry = folder / key
    with machine_first():  # the machine's first process tokenizes; the others read what it wrote
        problem = check(entry)
        if problem is not None:
            if entry.exists():
                logger.warning(f"token cache entry {entry} is {problem}; tokenizing again")
            tokenized = make(tokenizer, texts, **kwargs)
            try:
                save(tokenized, entry)
            except OSError as e:  # a full or read-only disk: this process keeps its tokens in memory
                logger.warning(f"cannot keep the tokens under {folder} ({e.strerror or e}); each process tokenizes")
                return tokenized
    return load(cls, entry)


def save(tokenized: Any, entry: Path) -> None:
    """A tokenized list's arrays and fields into `entry`, through a staging folder renamed into place."""
    with staged_folder(entry) as staging:
        fields = {}
        for name, value in vars(tokenized).items():
            if isinstance(value, np.ndarray):
                np.save(staging / f"{name}.npy", value)
            else:
                fields[name] = value
        (staging / "fields.json").write_text(json.dumps(fields, default=lambda value: value.item()))


def load(cls: Any, entry: Path) -> Any:
    """The tokenized list in `entry` as a `cls`, its arrays memory-mapped read-only."""
    tokenized = cls.__new__(cls)
    mark_used(entry / "fields.json")
    for name, value in read_json(entry / "fields.json").items():
        setattr(tokenized, name, value)
    for array in entry.glob("*.npy"):
        setattr(tokenized, array.stem, np.load(array, mmap_mode="r"))
    return tokenized
