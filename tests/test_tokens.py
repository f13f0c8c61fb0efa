"""Tokenized texts kept on disk (distill/tokens.py): tokenized once, read back memory-mapped, keyed by all that
changes the tokens."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch
from sentence_transformers import SentenceTransformer

from conftest import sentences
from distill.students.static import StaticTexts, load_static_student
from distill.tokens import FlatTexts, TokenizedTexts, cached_tokens


@pytest.fixture(scope="module")
def student(tiny_models: dict[str, Path]) -> SentenceTransformer:
    return SentenceTransformer(str(tiny_models["student"]), device="cpu")


def counting(tokenizer, calls: list[int]):  # type: ignore[no-untyped-def]
    """The tokenizer, each call's texts counted."""

    def call(texts, *args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(len(texts))
        return tokenizer(texts, *args, **kwargs)

    return call


def assert_same(cached: TokenizedTexts, fresh: TokenizedTexts, rows: list[int]) -> None:
    assert vars(cached).keys() == vars(fresh).keys()
    for name, value in vars(fresh).items():
        if isinstance(value, np.ndarray):
            np.testing.assert_array_equal(getattr(cached, name), value)
        else:
            assert getattr(cached, name) == value, name
    theirs = cached.features(rows)
    for name, value in fresh.features(rows).items():
        assert torch.equal(theirs[name], value) if isinstance(value, torch.Tensor) else theirs[name] == value, name


def test_texts_are_tokenized_once_and_read_back_memory_mapped(student, tmp_path, monkeypatch) -> None:
    texts = [*sentences(30, seed=5), " ".join(sentences(40, seed=6))]  # one long text, truncated
    fresh = TokenizedTexts(student.tokenizer, texts, 32, pad_to_multiple_of=8)
    calls: list[int] = []
    monkeypatch.setattr(TokenizedTexts, "__init__", wrapped_init(TokenizedTexts.__init__, calls))
    first = cached_tokens(TokenizedTexts, student.tokenizer, texts, tmp_path, max_length=32, pad_to_multiple_of=8)
    again = cached_tokens(TokenizedTexts, student.tokenizer, texts, tmp_path, max_length=32, pad_to_multiple_of=8)
    assert calls == [len(texts)]  # the second read tokenized nothing
    assert isinstance(again.ids, np.memmap) and again.truncated == 1
    assert_same(first, fresh, [0, 5, 30])
    assert_same(again, fresh, [30, 2, 7])
    # anything that changes the tokens is another entry: the limit, the padding multiple, the texts, the kind
    cached_tokens(TokenizedTexts, student.tokenizer, texts, tmp_path, max_length=16, pad_to_multiple_of=8)
    cached_tokens(TokenizedTexts, student.tokenizer, texts, tmp_path, max_length=32, pad_to_multiple_of=1)
    cached_tokens(TokenizedTexts, student.tokenizer, texts[:-1], tmp_path, max_length=32, pad_to_multiple_of=8)
    flat = partial(FlatTexts, position_offset=2)
    unpadded = cached_tokens(flat, student.tokenizer, texts, tmp_path, max_length=32, pad_to_multiple_of=8)
    assert len(calls) == 5 and len([p for p in tmp_path.iterdir() if not p.name.startswith(".")]) == 5
    assert isinstance(unpadded, FlatTexts) and unpadded.position_offset == 2
    assert_same(unpadded, FlatTexts(student.tokenizer, texts, 32, pad_to_multiple_of=8, position_offset=2), [3, 4])


def wrapped_init(init, calls: list[int]):  # type: ignore[no-untyped-def]
    def counted(self, tokenizer, texts, *args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(len(texts))
        init(self, tokenizer, texts, *args, **kwargs)

    return counted


def test_a_static_tables_texts_round_trip_too(tiny_models, tmp_path) -> None:
    table = load_static_student(f"static:{tiny_models['teacher']}", None, 8, tmp_path / "table")
    texts = sentences(12, seed=7)
    cached = cached_tokens(StaticTexts, table[0].tokenizer, texts, tmp_path / "tokens", max_length=None)
    cached = cached_tokens(StaticTexts, table[0].tokenizer, texts, tmp_path / "tokens", max_length=None)
    assert_same(cached, StaticTexts(table[0].tokenizer, texts), [0, 11, 4])


def test_without_a_folder_texts_are_tokenized_here(student) -> None:
    texts = sentences(5, seed=8)
    made = cached_tokens(TokenizedTexts, student.tokenizer, texts, None, max_length=32)
    assert not isinstance(made.ids, np.memmap)
    assert_same(made, TokenizedTexts(student.tokenizer, texts, 32), [0, 1, 2])


def test_a_torn_token_entry_is_tokenized_again_and_a_full_disk_keeps_them_in_memory(
    student, tmp_path, monkeypatch, caplog
) -> None:
    """A node crash leaves an `.npy` cut short: it used to be trusted because fields.json existed, and every later
    run failed on a raw `ValueError: mmap length`. Now it fails its check, is rebuilt with one warning line, and a
    disk that cannot take the tokens is one line too, the run going on with them in memory."""
    texts = sentences(20, seed=8)
    make = partial(cached_tokens, TokenizedTexts, student.tokenizer, texts, tmp_path, max_length=32)
    make()
    (entry,) = [p for p in tmp_path.iterdir() if not p.name.startswith(".")]
    ids = entry / "ids.npy"
    ids.write_bytes(ids.read_bytes()[:-7])
    with caplog.at_level("WARNING"):
        again = make()
    (said,) = [r.getMessage() for r in caplog.records if "token cache entry" in r.getMessage()]
    assert said.startswith(f"token cache entry {entry} is torn (ids.npy:") and said.endswith("; tokenizing again")
    assert_same(again, TokenizedTexts(student.tokenizer, texts, 32), [0, 19])

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(np, "save", full)
    caplog.clear()
    with caplog.at_level("WARNING"):
        kept = cached_tokens(TokenizedTexts, student.tokenizer, texts[:5], tmp_path, max_length=32)
    assert not isinstance(kept.ids, np.memmap) and len(kept) == 5
    assert any("(No space left on device); each process tokenizes" in r.getMessage() for r in caplog.records)
    assert sorted(p.name for p in tmp_path.iterdir()) == [entry.name]  # nothing half-written stays
