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
from pathlib import Path
from typing import Any

import numpy as np

from distill.distributed import machine_first
from distill.files import check, mark_used, read_json, staged_folder

logger = logging.getLogger(__name__)  # said by the machine's process that tokenizes

TOKENS_FORMAT = 1


def texts_fingerprint(texts: Sequence[str]) -> str:
    """A digest of a list of texts, in order (a column of distill/prepared.py brings it computed)."""
    known = getattr(texts, "fingerprint", None)
    if known:
        return known
    digest = hashlib.sha256()
    for text in texts:
        encoded = text.encode("utf8")
        digest.update(len(encoded).to_bytes(8, "little"))  # length prefix: ["ab","c"] != ["a","bc"]
        digest.update(encoded)
    return digest.hexdigest()


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
