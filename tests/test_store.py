"""The content-keyed teacher-embedding cache: correct vectors, warm hits without a model, keys, corruption."""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from accelerate import Accelerator

import distill.cache as cache_module
import distill.stages.negatives as negatives_module
import distill.stages.targets as teacher_module
import distill.store as store_module
import distill.teachers.local as local_module
from conftest import build_tiny_decoder, sentences, teacher_spec
from distill.errors import DistillError
from distill.pipeline import teacher_context
from distill.stages.targets import TeacherCache, texts_fingerprint
from distill.store import CACHE_FORMAT
from distill.teachers.local import LocalTeacher, TeacherSpec


def make_cache(
    accelerator: Accelerator, model: Path, cache_dir: Path, *, prompt: str | None = None, max_len: int | None = None
) -> TeacherCache:
    spec = teacher_spec(
        accelerator.device, teacher_model=str(model), teacher_query_prompt=prompt, max_seq_length=max_len
    )
    return TeacherCache(accelerator, LocalTeacher(spec), cache_dir, batch_size=8)


def forbid_teacher_loading(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the teacher was loaded although the cache holds every entry")

    monkeypatch.setattr(local_module, "load_teacher", refuse)


def reference_embeddings(model: Path, texts: list[str], prompt: str | None = None) -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    teacher = SentenceTransformer(str(model), device="cpu")
    return teacher.encode(texts, prompt=prompt, normalize_embeddings=True, convert_to_numpy=True)


def spy_on_map_sharded(monkeypatch: pytest.MonkeyPatch) -> dict[str, object]:
    """What the teacher hands map_sharded (the sort lengths, the prepare function), filled in when it is called."""
    seen: dict[str, object] = {}
    real_map = teacher_module.map_sharded

    def spy(accelerator, lengths, batch_size, encode, **kwargs):
        seen["lengths"], seen["prepare"] = np.asarray(lengths), kwargs.get("prepare")
        return real_map(accelerator, lengths, batch_size, encode, **kwargs)

    monkeypatch.setattr(teacher_module, "map_sharded", spy)
    return seen


def cache_entries(cache_dir: Path) -> list[Path]:
    return sorted(cache_dir.iterdir())


def test_embeddings_match_the_teacher(accelerator: Accelerator, tiny_models: dict[str, Path], tmp_path: Path) -> None:
    texts = sentences(37, seed=11)
    cache = make_cache(accelerator, tiny_models["teacher"], tmp_path / "cache")
    vectors = cache.embeddings(texts, "document")
    assert vectors.shape == (37, 48)
    assert vectors.dtype == np.float16
    assert cache.loaded
    expected = reference_embeddings(tiny_models["teacher"], texts)
    np.testing.assert_allclose(np.asarray(vectors, dtype=np.float32), expected, atol=2e-3)
    np.testing.assert_allclose(np.linalg.norm(np.asarray(vectors, dtype=np.float32), axis=1), 1.0, atol=2e-3)


def test_a_decoder_teachers_vectors_match_its_own_encode(accelerator: Accelerator, tmp_path: Path) -> None:
    """The 7B retrievers' layout (left padding, last-token pooling): the cache's token-sorted batches change nothing."""
    from sentence_transformers import SentenceTransformer

    teacher = build_tiny_decoder(tmp_path / "decoder")
    texts = sentences(37, seed=12)
    vectors = make_cache(accelerator, teacher, tmp_path / "cache").embeddings(texts, "document")
    reference = SentenceTransformer(str(teacher), device="cpu", model_kwargs={"dtype": torch.float32})
    expected = reference.encode(texts, normalize_embeddings=True, batch_size=5)  # other batches, other padding
    np.testing.assert_allclose(np.asarray(vectors, dtype=np.float32), expected, atol=2e-3)


def test_query_prompt_is_applied(accelerator: Accelerator, tiny_models: dict[str, Path], tmp_path: Path) -> None:
    texts = sentences(12, seed=5)
    cache = make_cache(accelerator, tiny_models["teacher"], tmp_path / "cache", prompt="query: ")
    queries = np.asarray(cache.embeddings(texts, "query"), dtype=np.float32)
    documents = np.asarray(cache.embeddings(texts, "document"), dtype=np.float32)
    np.testing.assert_allclose(queries, reference_embeddings(tiny_models["teacher"], texts, "query: "), atol=2e-3)
    np.testing.assert_allclose(documents, reference_embeddings(tiny_models["teacher"], texts), atol=2e-3)
    assert not np.allclose(queries, documents, atol=1e-2)


def test_warm_cache_loads_no_teacher(
    accelerator: Accelerator, tiny_models: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    texts = sentences(20, seed=1)
    cold = make_cache(accelerator, tiny_models["teacher"], tmp_path / "cache", prompt="q: ")
    first_docs = np.array(cold.embeddings(texts, "document"))
    first_queries = np.array(cold.embeddings(texts, "query"))
    assert cold.loaded
    manifest = tmp_path / "cache" / cold.key(texts, "document") / "manifest.json"
    os.utime(manifest, (1e9, 1e9))  # last used in 2001

    forbid_teacher_loading(monkeypatch)
    warm = make_cache(accelerator, tiny_models["teacher"], tmp_path / "cache", prompt="q: ")
    docs = warm.embeddings(texts, "document")
    queries = warm.embeddings(texts, "query")
    assert not warm.loaded
    assert warm.seconds == 0.0
    np.testing.assert_array_equal(docs, first_docs)
    np.testing.assert_array_equal(queries, first_queries)
    assert isinstance(docs, np.memmap) and not docs.flags.writeable
    assert manifest.stat().st_mtime > time.time() - 600  # a hit marks the entry used, for `distill.cache prune`
    assert json.loads(manifest.read_text())["format"] == CACHE_FORMAT  # `prune` tells it from another version's

    # a miss with the teacher forbidden proves the warm hits above did not sneak around the loader
    with pytest.raises(AssertionError, match="the teacher was loaded"):
        warm.embeddings(texts + ["one more text"], "document")


def test_key_depends_on_texts_prompt_and_length(
    accelerator: Accelerator, tiny_models: dict[str, Path], tmp_path: Path
) -> None:
    texts = sentences(10, seed=3)
    base = make_cache(accelerator, tiny_models["teacher"], tmp_path / "cache", prompt="query: ")
    key = base.key(texts, "document")
    assert key == base.key(list(texts), "document")  # deterministic
    assert key == make_cache(accelerator, tiny_models["teacher"], tmp_path / "cache", prompt="query: ").key(
        texts, "document"
    )

    # texts: content, order and boundaries
    assert base.key(texts[:-1], "document") != key
    assert base.key(texts[::-1], "document") != key
    assert base.key([texts[0] + " ", *texts[1:]], "document") != key
    assert base.key(["ab", "c"], "document") != base.key(["a", "bc"], "document")
    assert texts_fingerprint(["ab", "c"]) != texts_fingerprint(["a", "bc"])

    # prompt: only queries carry it
    query_key = base.key(texts, "query")
    assert query_key != key
    other_prompt = make_cache(accelerator, tiny_models["teacher"], tmp_path / "cache", prompt="search_query: ")
    assert other_prompt.key(texts, "query") != query_key
    assert other_prompt.key(texts, "document") == key  # documents get no prompt, so the prompt is irrelevant
    no_prompt = make_cache(accelerator, tiny_models["teacher"], tmp_path / "cache", prompt="")
    assert no_prompt.key(texts, "query") == no_prompt.key(texts, "document")

    # max_seq_length
    short = make_cache(accelerator, tiny_models["teacher"], tmp_path / "cache", prompt="query: ", max_len=8)
    assert short.key(texts, "document") != key
    shorter = make_cache(accelerator, tiny_models["teacher"], tmp_path / "cache", prompt="query: ", max_len=6)
    assert shorter.key(texts, "document") != short.key(texts, "document")

    # the model's weights
    other_model = make_cache(accelerator, tiny_models["wide_student"], tmp_path / "cache", prompt="query: ")
    assert other_model.key(texts, "document") != key


def test_max_seq_length_truncates_the_teacher(
    accelerator: Accelerator, tiny_models: dict[str, Path], tmp_path: Path
) -> None:
    long_text = " ".join(["river music king war state film team game"] * 4)
    texts = [long_text, "the city."]
    full = make_cache(accelerator, tiny_models["teacher"], tmp_path / "cache")
    short = make_cache(accelerator, tiny_models["teacher"], tmp_path / "cache", max_len=6)
    full_vectors = np.asarray(full.embeddings(texts, "document"), dtype=np.float32)
    short_vectors = np.asarray(short.embeddings(texts, "document"), dtype=np.float32)
    assert len(cache_entries(tmp_path / "cache")) == 2
    assert not np.allclose(full_vectors[0], short_vectors[0], atol=1e-2)  # the long text was cut
    np.testing.assert_allclose(full_vectors[1], short_vectors[1], atol=2e-3)  # the short one was not


def corrupt_by_truncation(entry: Path) -> None:
    data = entry / "embeddings.npy"
    data.write_bytes(data.read_bytes()[:-64])


def corrupt_manifest_count(entry: Path) -> None:
    manifest = json.loads((entry / "manifest.json").read_text())
    manifest["count"] += 1
    (entry / "manifest.json").write_text(json.dumps(manifest))


def corrupt_manifest_json(entry: Path) -> None:
    (entry / "manifest.json").unlink()


def corrupt_manifest_text(entry: Path) -> None:
    (entry / "manifest.json").write_text('{"key": "trunc')


def corrupt_values_header(entry: Path) -> None:
    """Same size, wrong shape: the .npy is rewritten with fewer rows and padded back to the recorded size."""
    data = entry / "embeddings.npy"
    size = data.stat().st_size
    vectors = np.load(data)
    np.save(data, vectors[:-1])
    with open(data, "ab") as out:
        out.write(b"\0" * (size - data.stat().st_size))


@pytest.mark.parametrize(
    "corrupt",
    [
        corrupt_by_truncation,
        corrupt_manifest_count,
        corrupt_manifest_json,
        corrupt_manifest_text,
        corrupt_values_header,
    ],
)
def test_corrupt_entry_is_rebuilt(
    corrupt, accelerator: Accelerator, tiny_models: dict[str, Path], tmp_path: Path
) -> None:
    texts = sentences(16, seed=9)
    cache_dir = tmp_path / "cache"
    first = make_cache(accelerator, tiny_models["teacher"], cache_dir)
    good = np.array(first.embeddings(texts, "document"))
    (entry,) = cache_entries(cache_dir)
    corrupt(entry)
    assert cache_module.read_entry(entry, first.key(texts, "document"), len(texts)) is None

    second = make_cache(accelerator, tiny_models["teacher"], cache_dir)
    rebuilt = second.embeddings(texts, "document")
    assert second.loaded  # it recomputed rather than trusting the damaged entry
    np.testing.assert_array_equal(np.asarray(rebuilt), good)
    assert cache_entries(cache_dir) == [entry]
    manifest = json.loads((entry / "manifest.json").read_text())
    assert manifest["count"] == 16 and manifest["dim"] == 48
    assert manifest["bytes"] == (entry / "embeddings.npy").stat().st_size


def test_no_temporary_folders_left(accelerator: Accelerator, tiny_models: dict[str, Path], tmp_path: Path) -> None:
    cache_dir = tmp_path / "cache"
    cache = make_cache(accelerator, tiny_models["teacher"], cache_dir, prompt="query: ")
    texts = sentences(9, seed=2)
    cache.embeddings(texts, "document")
    cache.embeddings(texts, "query")
    (cache_dir / cache.key(texts, "query") / "manifest.json").write_text("{}")  # force a rebuild over an entry
    cache.embeddings(texts, "query")
    entries = cache_entries(cache_dir)
    assert [p.name for p in entries] == sorted([cache.key(texts, "document"), cache.key(texts, "query")])
    assert not [p for p in entries if p.name.startswith(".")]
    for entry in entries:
        names = sorted(p.name for p in entry.iterdir())
        assert names == ["contents.json", "embeddings.npy", "manifest.json", "texts.npy"]


def test_manifest_records_what_was_computed(
    accelerator: Accelerator, tiny_models: dict[str, Path], tmp_path: Path
) -> None:
    cache = make_cache(accelerator, tiny_models["teacher"], tmp_path / "cache", prompt="query: ", max_len=16)
    texts = sentences(5, seed=4)
    cache.embeddings(texts, "query")
    manifest = json.loads((tmp_path / "cache" / cache.key(texts, "query") / "manifest.json").read_text())
    assert manifest["key"] == cache.key(texts, "query")
    assert manifest["role"] == "query"
    assert manifest["prompt"] == "query: "
    assert manifest["max_seq_length"] == 16
    assert manifest["dtype"] == "float16"
    assert manifest["count"] == 5 and manifest["dim"] == 48


def test_default_prompt_comes_from_the_teacher_config(accelerator: Accelerator, tmp_path: Path) -> None:
    folder = tmp_path / "prompted"
    folder.mkdir()
    (folder / "config_sentence_transformers.json").write_text(json.dumps({"prompts": {"query": "Query: "}}))
    spec = teacher_spec(accelerator.device, teacher_model=str(folder))
    assert spec.query_prompt == "Query: "
    assert spec.compute_dtype == "float32"
    explicit = teacher_spec(accelerator.device, teacher_model=str(folder), teacher_query_prompt="")
    assert explicit.query_prompt == ""


def test_teacher_token_limit_defaults_to_the_students_and_can_be_set_alone(
    accelerator: Accelerator, tmp_path: Path
) -> None:
    folder = tmp_path / "teacher"
    folder.mkdir()
    shared = teacher_spec(accelerator.device, teacher_model=str(folder), max_seq_length=64)
    assert shared.max_seq_length == 64
    alone = teacher_spec(accelerator.device, teacher_model=str(folder), max_seq_length=64, teacher_max_seq_length=256)
    assert alone.max_seq_length == 256  # the teacher reads 256 tokens, the student still 64
    # a static table has no limit, asked of no hub: the teacher reads up to its own
    for student in ("static", "static:org/model"):
        spec = teacher_spec(accelerator.device, teacher_model=str(folder), student_model=student)
        assert spec.max_seq_length is None
        given = teacher_spec(accelerator.device, teacher_model=str(folder), student_model=student, max_seq_length=64)
        assert given.max_seq_length == 64  # --max_seq_length limits the teacher alone
    # a different limit means different vectors: a different cache entry
    cache_a = TeacherCache(accelerator, LocalTeacher(shared), tmp_path / "cache", batch_size=8)
    cache_b = TeacherCache(accelerator, LocalTeacher(alone), tmp_path / "cache", batch_size=8)
    cache_a._model_key = cache_b._model_key = "same-model"
    assert cache_a.key(["a text"], "document") != cache_b.key(["a text"], "document")


def test_mined_negatives_are_the_teachers_top_other_passages() -> None:
    from distill.stages.negatives import mine_hard_negatives

    passages = np.eye(6, 8, dtype=np.float32)  # orthonormal: a passage scores 0 against every other
    queries = passages.copy()  # each query is its own positive, exactly
    queries[0] = passages[0] + 0.9 * passages[3]  # query 0 also looks much like passage 3...
    queries[0] /= np.linalg.norm(queries[0])
    mined = mine_hard_negatives(queries, passages, count=2, margin=0.0)
    assert mined.shape == (6, 2)
    assert all(i not in row for i, row in enumerate(mined))  # never the query's own positive
    assert mined[0, 0] == 3  # ...so passage 3 is its hardest negative
    scores = queries @ passages.T
    for i, row in enumerate(mined):
        others = np.delete(scores[i], i)
        assert scores[i, row[0]] == others.max()


def test_mining_skips_near_duplicates_of_the_positive_and_needs_enough_passages() -> None:
    from distill.stages.negatives import mine_hard_negatives

    passages = np.eye(4, dtype=np.float32)
    passages[1] = passages[0]  # passage 1 duplicates query 0's positive: a likely unlabelled positive
    mined = mine_hard_negatives(passages.copy(), passages, count=1, margin=0.05)
    assert mined[0, 0] != 1
    with pytest.raises(DistillError, match="mine_hard_negatives 4 needs more than 4 passages"):
        mine_hard_negatives(passages, passages, count=4)


def test_mining_never_returns_the_positive_or_a_copy_of_it(
    accelerator: Accelerator, caplog: pytest.LogCaptureFixture
) -> None:
    """A query with too few passages below the margin makes up its count with the highest-scoring skipped ones, never
    its own positive, and a warning counts such queries."""
    from distill.stages.negatives import mine_hard_negatives

    passages = np.eye(4, dtype=np.float32)
    passages[1] = passages[2] = passages[0]  # three pairs share one passage text
    mined = mine_hard_negatives(passages.copy(), passages, count=2, margin=0.05)  # by score alone, no text ids
    assert all(i not in row for i, row in enumerate(mined))
    assert "3 of 4 queries have fewer than 2 other passages the teacher scores at least 5% below" in caplog.text
    ids = np.array([0, 0, 0, 1])
    mined = mine_hard_negatives(passages.copy(), passages, count=1, margin=0.05, passage_ids=ids)
    assert mined[:3, 0].tolist() == [3, 3, 3] and mined[3, 0] == 0  # one row of the shared text, never its copies
    with pytest.raises(DistillError, match="mine_hard_negatives 2 needs more than 2 passages of distinct text, the "):
        mine_hard_negatives(passages.copy(), passages, count=2, margin=0.05, passage_ids=ids)


def test_mining_skips_copies_of_the_positive_whatever_the_sign_of_its_score(accelerator: Accelerator) -> None:
    """A copy of the positive is never a negative, even where the positive's score is negative and (1 - margin) x it
    lies above it."""
    from distill.stages.negatives import mine_hard_negatives

    passages = np.eye(5, dtype=np.float32)
    passages[1] = passages[0]  # a copy of query 0's positive
    queries = passages.copy()
    queries[0] = -0.5 * passages[0] + 0.3 * passages[2] - 0.8 * passages[4]  # its positive scores -0.5
    mined = mine_hard_negatives(queries, passages, count=1, margin=0.05)  # by score alone, no text ids
    assert mined[0, 0] == 4  # the one passage scoring below the positive, not the copy (-0.5)
    mined = mine_hard_negatives(queries, passages, count=1, margin=0.0, passage_ids=np.array([0, 0, 1, 2, 3]))
    assert mined[0, 0] == 4  # with ids, the copy is out even without a margin
    queries[0] = -0.5 * passages[0] + 0.3 * passages[2] + 0.2 * passages[3]  # nothing scores below the positive
    mined = mine_hard_negatives(queries, passages, count=1, margin=0.05)
    assert mined[0, 0] == 2  # the highest-scoring skipped passage, not the copy


def test_mining_takes_a_text_shared_by_several_pairs_once() -> None:
    from distill.stages.negatives import mine_hard_negatives

    passages = np.eye(6, dtype=np.float32)
    passages[2] = passages[1]  # pairs 1 and 2 share a passage
    queries = passages.copy()
    queries[0] = passages[0] + 0.5 * passages[1] + 0.2 * passages[3]
    queries[0] /= np.linalg.norm(queries[0])
    mined = mine_hard_negatives(queries, passages, count=2, margin=0.05, passage_ids=np.array([0, 1, 1, 2, 3, 4]))
    assert mined[0].tolist() == [1, 3]  # not [1, 2]: the same text twice


def test_teacher_seconds_count_the_loading_once(
    accelerator: Accelerator, tiny_models: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Loading is part of the teacher's time exactly once, and is reported on its own."""
    import time

    real_load = local_module.load_teacher

    def slow_load(*args: object, **kwargs: object):
        time.sleep(1.0)
        return real_load(*args, **kwargs)

    monkeypatch.setattr(local_module, "load_teacher", slow_load)
    cache = make_cache(accelerator, tiny_models["teacher"], tmp_path / "cache")
    cache.embeddings(sentences(6, seed=2), "document")
    assert cache.load_seconds >= 1.0
    encoding = cache.seconds - cache.load_seconds
    assert 0 < encoding < 1.0  # six short texts through the tiny teacher; a second load would add >= 1 s


def test_cpu_batches_are_formed_by_token_count_not_characters(
    accelerator: Accelerator, tiny_models: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a CPU the forward pass is the cost: texts are sorted by exact token count, with no background thread."""
    seen = spy_on_map_sharded(monkeypatch)
    # characters and tokens disagree: short words are one token each, and a word of over 100 characters is one
    # [UNK] (WordPiece's max_input_chars_per_word)
    texts = ["a b c d e f g h i j", "abcdefghijklmnopqrstuvwxyz" * 5, *sentences(10, seed=3)]
    cache = make_cache(accelerator, tiny_models["teacher"], tmp_path / "cache")
    vectors = cache.embeddings(texts, "document")
    tokenizer = cache.source.model.tokenizer
    expected = [
        len(tokenizer(t, truncation=True, max_length=cache.source.model.max_seq_length)["input_ids"]) for t in texts
    ]
    assert seen["lengths"].tolist() == expected
    assert seen["prepare"] is None
    assert expected[0] > expected[1] and len(texts[0]) < len(texts[1])  # the example does tell the two apart
    np.testing.assert_allclose(
        np.asarray(vectors, dtype=np.float32), reference_embeddings(tiny_models["teacher"], texts), atol=2e-3
    )


def test_tokenizing_ahead_gives_the_same_vectors(
    accelerator: Accelerator, tiny_models: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The GPU path (next batch tokenized in a background thread), forced on the CPU: same vectors, same order."""
    seen = spy_on_map_sharded(monkeypatch)
    monkeypatch.setattr(local_module, "tokenize_ahead", lambda device: True)
    texts = sentences(37, seed=11)
    cache = make_cache(accelerator, tiny_models["teacher"], tmp_path / "cache", prompt="query: ")
    vectors = np.asarray(cache.embeddings(texts, "query"), dtype=np.float32)
    assert seen["prepare"] is not None
    expected = reference_embeddings(tiny_models["teacher"], texts, prompt="query: ")
    np.testing.assert_allclose(vectors, expected, atol=2e-3)


@pytest.mark.parametrize("ahead", [False, True])
def test_a_teacher_batch_too_large_for_the_device_is_encoded_in_halves(
    accelerator: Accelerator,
    tiny_models: dict[str, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    ahead: bool,
) -> None:
    """A --teacher_batch_size too large for the GPU (out of memory above 3 texts): same vectors, smaller batches."""
    import torch

    monkeypatch.setattr(local_module, "tokenize_ahead", lambda device: ahead)
    texts = sentences(37, seed=11)
    expected = reference_embeddings(tiny_models["teacher"], texts)  # before forward is patched
    cache = make_cache(accelerator, tiny_models["teacher"], tmp_path / "cache")
    teacher = cache.source.load(accelerator)
    real_forward, sizes = type(teacher).forward, []

    def forward(self, features, *args, **kwargs):
        sizes.append(len(features["input_ids"]))
        if sizes[-1] > 3:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB.")
        return real_forward(self, features, *args, **kwargs)

    monkeypatch.setattr(type(teacher), "forward", forward)
    vectors = np.asarray(cache.embeddings(texts, "document"), dtype=np.float32)
    assert sizes[:3] == [8, 4, 2] and max(sizes[3:]) == 2
    np.testing.assert_allclose(vectors, expected, atol=2e-3)


class Killed(BaseException):
    """Stands for the run being killed (not an Exception: nothing may catch it on the way out)."""


def interrupt_after_blocks(monkeypatch: pytest.MonkeyPatch, blocks: int) -> list[int]:
    """map_sharded in the teacher raises Killed once `blocks` blocks are encoded; returns the blocks' sizes."""
    from distill.sharding import map_sharded as real_map  # not an earlier spy

    sizes: list[int] = []

    def spy(accelerator, lengths, batch_size, encode, **kwargs):
        if len(sizes) == blocks:
            raise Killed
        sizes.append(len(lengths))
        return real_map(accelerator, lengths, batch_size, encode, **kwargs)

    monkeypatch.setattr(teacher_module, "map_sharded", spy)
    return sizes


def killed_after_two_blocks(
    accelerator: Accelerator, tiny_models: dict[str, Path], cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> list[str]:
    """A run killed after encoding 2 blocks of 8 of 37 texts; the texts. Blocks stay 8 texts per process."""
    monkeypatch.setattr(teacher_module, "BLOCK_ROWS_PER_PROCESS", 8)
    texts = sentences(37, seed=11)
    sizes = interrupt_after_blocks(monkeypatch, 2)
    with pytest.raises(Killed):
        make_cache(accelerator, tiny_models["teacher"], cache_dir).embeddings(texts, "document")
    assert sizes == [8, 8]  # the 16 longest texts, then the kill
    return texts


def test_an_interrupted_encoding_is_continued_not_started_over(
    accelerator: Accelerator,
    tiny_models: dict[str, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The next run continues it, on whatever host it is requeued (the folder's name holds no host name)."""
    cache_dir = tmp_path / "cache"
    texts = killed_after_two_blocks(accelerator, tiny_models, cache_dir, monkeypatch)
    (staging,) = cache_dir.iterdir()  # no entry yet, only what the next run continues from
    assert staging.name.startswith(".") and staging.name.endswith(".partial")
    assert json.loads((staging / "progress.json").read_text())["rows_done"] == 16

    monkeypatch.setattr(socket, "gethostname", lambda: "requeued-node-7f3a")
    second = interrupt_after_blocks(monkeypatch, 99)
    cache = make_cache(accelerator, tiny_models["teacher"], cache_dir)
    with caplog.at_level("WARNING"):
        vectors = np.asarray(cache.embeddings(texts, "document"), dtype=np.float32)
    assert second == [8, 8, 5]  # the 21 texts left, not all 37
    said = "continuing an interrupted encoding at 16 of 37 document texts"
    assert any(said in r.getMessage() for r in caplog.records)
    np.testing.assert_allclose(vectors, reference_embeddings(tiny_models["teacher"], texts), atol=2e-3)
    entries = cache_entries(cache_dir)
    assert [p.name for p in entries] == [cache.key(texts, "document")]  # staging renamed, lock file gone
    expected = ["contents.json", "embeddings.npy", "manifest.json", "texts.npy"]
    assert sorted(p.name for p in entries[0].iterdir()) == expected


def test_an_interrupted_encoding_is_listed_and_pruned_by_age(
    accelerator: Accelerator,
    tiny_models: dict[str, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
) -> None:
    cache_dir = tmp_path / "cache"
    texts = killed_after_two_blocks(accelerator, tiny_models, cache_dir, monkeypatch)
    assert cache_module.main(["list", "--teacher_cache_dir", str(cache_dir)]) == 0
    (row,) = [line for line in capsys.readouterr().out.splitlines() if " partial " in line]
    assert f" partial 16/37  {tiny_models['teacher']}  document  37 " in row

    assert cache_module.main(["prune", "--teacher_cache_dir", str(cache_dir)]) == 0  # still resumable: kept
    assert len(list(cache_dir.iterdir())) == 1
    assert cache_module.main(["prune", "--teacher_cache_dir", str(cache_dir), "--unused_days", "0"]) == 0
    assert "an interrupted encoding, unused for 0.0 days" in capsys.readouterr().out
    assert list(cache_dir.iterdir()) == []
    sizes = interrupt_after_blocks(monkeypatch, 99)
    make_cache(accelerator, tiny_models["teacher"], cache_dir).embeddings(texts, "document")
    assert sizes == [8, 8, 8, 8, 5]  # started over


def test_a_staging_folder_from_other_inputs_is_not_continued(
    accelerator: Accelerator, tiny_models: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache_dir = tmp_path / "cache"
    texts = killed_after_two_blocks(accelerator, tiny_models, cache_dir, monkeypatch)
    (staging,) = cache_dir.iterdir()
    progress = json.loads((staging / "progress.json").read_text())
    (staging / "progress.json").write_text(json.dumps({**progress, "count": 36}))  # not these texts
    sizes = interrupt_after_blocks(monkeypatch, 99)
    make_cache(accelerator, tiny_models["teacher"], cache_dir).embeddings(texts, "document")
    assert sum(sizes) == 37


def test_a_held_lock_makes_another_run_wait_and_a_machine_of_the_same_job_read(
    accelerator: Accelerator, tiny_models: dict[str, Path], tmp_path: Path
) -> None:
    """Two writers of one entry: the second one, of another run, waits and names who holds the lock; one of the
    same job (another machine sharing the folder) writes nothing. Once the lock is free, the next one takes it."""
    cache = make_cache(accelerator, tiny_models["teacher"], tmp_path / "cache")
    texts = sentences(5, seed=1)
    entry, key = tmp_path / "cache" / cache.key(texts, "document"), cache.key(texts, "document")
    first = store_module.CacheWriter(entry, key, 5, "document", cache.source, job="job-a")
    other_run = store_module.CacheWriter(entry, key, 5, "document", cache.source, job="job-b")
    same_job = store_module.CacheWriter(entry, key, 5, "document", cache.source, job="job-a")
    assert first.staging.name.endswith(".partial") and first.writes
    assert other_run.waiting and other_run.holder == {"host": socket.gethostname(), "pid": os.getpid(), "job": "job-a"}
    assert same_job.sibling and not same_job.writes and same_job.resume() == 5  # the holder's count decides
    first.close()
    other_run.claim_again()  # the lock is free again
    assert not other_run.waiting and other_run.staging.name.endswith(".partial")
    other_run.close()
    same_job.close()


def test_a_run_waits_for_another_runs_encoding_then_reads_its_entry(
    accelerator: Accelerator,
    tiny_models: dict[str, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A second run on one cache used to encode everything again under its own name, and its commit removed the
    entry the first run was reading. Now it waits, says so once, and reads the first run's entry: it encodes
    nothing, and the entry in place is never replaced."""
    cache_dir = tmp_path / "cache"
    cache = make_cache(accelerator, tiny_models["teacher"], cache_dir)
    texts = sentences(6, seed=3)
    key = cache.key(texts, "document")
    lock = store_module.claim(store_module.lock_file(cache_dir, key), "another-job")
    assert lock.fd is not None
    sleeps: list[float] = []
    inodes: list[int] = []

    def first_run_finishes(seconds: float) -> None:  # while the second waits, the first puts its entry in place
        sleeps.append(seconds)
        if len(sleeps) == 2:
            make_cache(accelerator, tiny_models["teacher"], tmp_path / "elsewhere").embeddings(texts, "document")
            shutil.copytree(tmp_path / "elsewhere" / key, cache_dir / key)
            inodes.append((cache_dir / key / "embeddings.npy").stat().st_ino)
            os.unlink(store_module.lock_file(cache_dir, key))
            os.close(lock.fd)

    monkeypatch.setattr(teacher_module.time, "sleep", first_run_finishes)
    encoded = interrupt_after_blocks(monkeypatch, 99)
    with caplog.at_level("WARNING"):
        vectors = cache.embeddings(texts, "document")
    assert encoded == [6] and len(sleeps) == 2  # the other run's encoding; this run's none
    waited = [r.getMessage() for r in caplog.records if "waiting for it to finish" in r.getMessage()]
    assert len(waited) == 1 and "another run (host" in waited[0]
    assert (cache_dir / key / "embeddings.npy").stat().st_ino == inodes[0] and vectors.shape[0] == 6


def test_a_filesystem_without_locks_is_said_once(
    accelerator: Accelerator,
    tiny_models: dict[str, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """flock refused (Lustre `noflock`, some FUSE mounts): one line says what it costs, and encoding goes on."""
    import fcntl

    def no_locks(fd: int, operation: int) -> None:
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    cache = make_cache(accelerator, tiny_models["teacher"], tmp_path / "cache")
    with caplog.at_level("WARNING"):
        cache.embeddings(sentences(4, seed=1), "document")
        cache.embeddings(sentences(4, seed=2), "document")
    said = [r.getMessage() for r in caplog.records if "takes no file locks" in r.getMessage()]
    assert len(said) == 1 and "(No locks available)" in said[0]
    assert len(cache_entries(tmp_path / "cache")) == 2


def test_a_run_killed_as_it_put_its_entry_in_place_finds_every_text_done(
    accelerator: Accelerator, tiny_models: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A SIGKILL between sealing the staging folder and renaming it: the next run finds all texts done there and
    only puts it in place (the progress file stays until then; it used to go first, and the folder with it)."""
    cache_dir = tmp_path / "cache"
    cache = make_cache(accelerator, tiny_models["teacher"], cache_dir)
    texts = sentences(7, seed=4)

    def killed(*args: object, **kwargs: object) -> None:
        raise Killed

    monkeypatch.setattr(store_module, "put_in_place", killed)
    with pytest.raises(Killed):
        cache.embeddings(texts, "document")
    monkeypatch.undo()
    for fd in Path("/proc/self/fd").iterdir():  # a killed process's locks go with it
        with contextlib.suppress(OSError):
            if os.readlink(fd).endswith(".lock"):
                os.close(int(fd.name))
    encoded = interrupt_after_blocks(monkeypatch, 99)
    vectors = make_cache(accelerator, tiny_models["teacher"], cache_dir).embeddings(texts, "document")
    assert encoded == [] and vectors.shape[0] == 7
    assert [p.name for p in cache_entries(cache_dir)] == [cache.key(texts, "document")]


CONTINUE_ON_TWO_PROCESSES = """
import json, sys
from pathlib import Path
from accelerate import Accelerator
import distill.stages.targets as teacher_module
import distill.stages.negatives as negatives_module
import distill.teachers.local as local_module
from distill.config import TeacherConfig
from distill.teachers import TeacherContext

model, cache_dir, texts_file, out = sys.argv[1:5]
teacher_module.BLOCK_ROWS_PER_PROCESS = 4
accelerator = Accelerator(cpu=True)
blocks, real_map = [], teacher_module.map_sharded

def spy(accelerator, lengths, *args, **kwargs):
    blocks.append(len(lengths))
    return real_map(accelerator, lengths, *args, **kwargs)

teacher_module.map_sharded = spy
spec = local_module.TeacherSpec.from_config(TeacherConfig(teacher_model=model), TeacherContext(accelerator.device))
cache = teacher_module.TeacherCache(accelerator, local_module.LocalTeacher(spec), cache_dir, batch_size=8)
cache.embeddings(json.loads(Path(texts_file).read_text()), "document")
Path(f"{out}.{accelerator.process_index}").write_text(json.dumps([accelerator.num_processes, blocks]))
"""


@pytest.mark.multiprocess
def test_two_processes_continue_what_one_process_began(
    accelerator: Accelerator, tiny_models: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The resume point is agreed by every rank (a collective), and is a count of texts, not of one run's blocks."""
    cache_dir = tmp_path / "cache"
    texts = killed_after_two_blocks(accelerator, tiny_models, cache_dir, monkeypatch)
    (tmp_path / "texts.json").write_text(json.dumps(texts))
    run_on_two_processes(CONTINUE_ON_TWO_PROCESSES, tiny_models["teacher"], cache_dir, tmp_path)
    for rank in (0, 1):  # 21 texts left, in blocks of 4 per process
        assert json.loads((tmp_path / f"seen.{rank}").read_text()) == [2, [8, 8, 5]]
    cache = make_cache(accelerator, tiny_models["teacher"], cache_dir)
    vectors = np.asarray(cache.embeddings(texts, "document"), dtype=np.float32)  # a warm hit now
    assert not cache.loaded
    np.testing.assert_allclose(vectors, reference_embeddings(tiny_models["teacher"], texts), atol=2e-3)


# ---------------------------------------------------------------- prompts, token limit, agreement on hits


def prompted_teacher(tiny_models: dict[str, Path], folder: Path, prompts: dict[str, str]) -> Path:
    import shutil

    shutil.copytree(tiny_models["teacher"], folder)
    (folder / "config_sentence_transformers.json").write_text(json.dumps({"prompts": prompts}))
    return folder


def test_document_prompt_is_applied_and_keyed(
    accelerator: Accelerator, tiny_models: dict[str, Path], tmp_path: Path
) -> None:
    """The teacher's own document prompt (encode_document's order: document, passage, corpus) reaches documents."""
    teacher = prompted_teacher(tiny_models, tmp_path / "e5", {"query": "query: ", "passage": "passage: "})
    spec = teacher_spec(accelerator.device, teacher_model=str(teacher))
    assert (spec.query_prompt, spec.document_prompt) == ("query: ", "passage: ")
    cache = TeacherCache(accelerator, LocalTeacher(spec), tmp_path / "cache", batch_size=8)
    texts = sentences(9, seed=2)
    documents = np.asarray(cache.embeddings(texts, "document"), dtype=np.float32)
    np.testing.assert_allclose(documents, reference_embeddings(teacher, texts, "passage: "), atol=2e-3)
    manifest = json.loads((tmp_path / "cache" / cache.key(texts, "document") / "manifest.json").read_text())
    assert manifest["prompt"] == "passage: "
    unprompted = teacher_spec(accelerator.device, teacher_model=str(teacher), teacher_document_prompt="")
    assert unprompted.document_prompt == ""
    other = TeacherCache(accelerator, LocalTeacher(unprompted), tmp_path / "cache", batch_size=8)
    assert other.key(texts, "document") != cache.key(texts, "document")
    assert other.key(texts, "query") == cache.key(texts, "query")  # the key is per role


def test_role_prompt_by_name_text_or_none() -> None:
    declared = {"query": "", "document": "", "passage": "passage: ", "corpus": "corpus: ", "qa": "Answer: "}
    assert local_module.role_prompt(declared, None, "document", "t") == "passage: "  # empty placeholders skipped
    assert local_module.role_prompt({"corpus": "c: ", "document": "d: "}, None, "document", "t") == "d: "
    assert local_module.role_prompt(declared, "qa", "query", "t") == "Answer: "  # a name the teacher declares
    assert local_module.role_prompt(declared, "Find: ", "query", "t") == "Find: "  # a text
    assert local_module.role_prompt({"query": "q: "}, "", "query", "t") == ""  # explicitly none
    assert local_module.role_prompt({"document": "d: "}, None, "query", "t") == ""


def test_a_teacher_without_a_query_prompt_but_with_task_prompts_is_an_error(
    accelerator: Accelerator, tiny_models: dict[str, Path], tmp_path: Path
) -> None:
    """e5-mistral-7b-instruct declares only task-named prompts: distill cannot guess which one queries need."""
    prompts = {"web_search_query": "Instruct: Given a web search query\nQuery: ", "sts_query": "Instruct: STS\nQuery: "}
    teacher = prompted_teacher(tiny_models, tmp_path / "e5mistral", prompts)
    with pytest.raises(
        DistillError,
        match=r"declares the prompts sts_query, web_search_query but none named 'query'.*"
        r"pass --teacher_query_prompt",
    ):
        teacher_spec(accelerator.device, teacher_model=str(teacher))
    named = teacher_spec(accelerator.device, teacher_model=str(teacher), teacher_query_prompt="web_search_query")
    assert named.query_prompt == prompts["web_search_query"]


def test_hub_prompts_are_read_at_the_teachers_revision(
    accelerator: Accelerator, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import huggingface_hub
    from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError

    asked = []
    config = tmp_path / "config_sentence_transformers.json"
    config.write_text(json.dumps({"prompts": {"query": "v1 query: "}}))

    def download(repo: str, filename: str, revision: str | None = None, **kwargs: object) -> str:
        asked.append((repo, filename, revision))
        return str(config)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    assert local_module.teacher_prompts("org/teacher", "v1") == {"query": "v1 query: "}
    assert asked == [("org/teacher", "config_sentence_transformers.json", "v1")]

    def missing(*args: object, **kwargs: object) -> str:
        raise EntryNotFoundError("no such file")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", missing)
    assert local_module.teacher_prompts("org/teacher", "v1") == {}
    warnings = []
    monkeypatch.setattr(local_module.logger, "warning", lambda message, **kwargs: warnings.append(message))

    def offline(*args: object, **kwargs: object) -> str:
        raise LocalEntryNotFoundError("offline and not cached")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", offline)
    # the model itself is cached (its snapshot is found), only its prompts file is not: no prompts, with a warning
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda *args, **kwargs: str(tmp_path))
    assert local_module.teacher_prompts("org/teacher", "v1") == {}
    assert len(warnings) == 1 and "could not read the prompts of teacher 'org/teacher'" in warnings[0]

    # the model cannot be found at all: its one error, and no warning about prompts first ("encoding with none")
    def not_cached(*args: object, **kwargs: object) -> str:
        raise LocalEntryNotFoundError("offline and not cached")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", not_cached)
    warnings.clear()
    with pytest.raises(DistillError, match=r"model 'org/teacher' cannot be found locally or on the Hub"):
        local_module.teacher_prompts("org/teacher", "v1")
    assert warnings == []

    def broken(*args: object, **kwargs: object) -> str:
        raise RuntimeError("a bug, not a missing file")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", broken)
    with pytest.raises(RuntimeError, match="a bug"):
        local_module.teacher_prompts("org/teacher", "v1")


def test_teacher_token_limit_defaults_to_the_students_own(
    accelerator: Accelerator, tiny_models: dict[str, Path], tmp_path: Path
) -> None:
    """Neither limit set: the teacher reads the student's own limit (its sentence_bert_config.json), not its own."""
    student = tmp_path / "student"
    student.mkdir()
    (student / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 24}))
    teacher = str(tiny_models["teacher"])
    assert teacher_spec(accelerator.device, teacher_model=teacher, student_model=str(student)).max_seq_length == 24
    given = teacher_spec(accelerator.device, teacher_model=teacher, student_model=str(student), max_seq_length=40)
    assert given.max_seq_length == 40
    unknown = teacher_spec(accelerator.device, teacher_model=teacher, student_model="nobody/no-such-student")
    assert unknown.max_seq_length is None  # the teacher's own


def test_embedded_demo_cache_keys_keep_their_token_limit_and_prompts(accelerator: Accelerator) -> None:
    """The demo sets max_seq_length 128 itself, and its teacher has no prompts: the defaults leave its keys alone."""
    from distill.config import load_config

    demo = Path(__file__).resolve().parents[1] / "configs" / "demo.yaml"
    config = load_config(["--config", str(demo)])
    assert config.student.max_seq_length == 128
    spec = TeacherSpec.from_config(config.teacher, teacher_context(config, accelerator.device))
    assert (spec.max_seq_length, spec.query_prompt, spec.document_prompt) == (128, "", "")


def test_a_hit_needs_every_process_to_hit(
    accelerator: Accelerator, tiny_models: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    class TwoProcesses:
        num_processes = 2

        def __init__(self, flags: list[int]) -> None:
            self.flags = flags
            self.device = "cpu"

        def gather(self, tensor):
            import torch

            return torch.tensor(self.flags)

    assert teacher_module.everyone(TwoProcesses([1, 1]), True)
    assert not teacher_module.everyone(TwoProcesses([1, 0]), True)  # the other machine lacks it
    assert teacher_module.everyone(accelerator, True) and not teacher_module.everyone(accelerator, False)
    # a process that has the entry while another does not encodes with the others, and ends with the same vectors
    texts = sentences(6, seed=8)
    make_cache(accelerator, tiny_models["teacher"], tmp_path / "cache").embeddings(texts, "document")
    monkeypatch.setattr(teacher_module, "everyone", lambda accelerator, here: False)
    monkeypatch.setattr(teacher_module, "agreed", lambda accelerator, held: np.zeros_like(held))  # nor its rows
    cache = make_cache(accelerator, tiny_models["teacher"], tmp_path / "cache")
    vectors = np.asarray(cache.embeddings(texts, "document"), dtype=np.float32)
    assert cache.loaded
    np.testing.assert_allclose(vectors, reference_embeddings(tiny_models["teacher"], texts), atol=2e-3)


ONE_MACHINE_LACKS_THE_ENTRY = """
import json, sys, time
from datetime import timedelta
from pathlib import Path
from accelerate import Accelerator, InitProcessGroupKwargs
import distill.hub as hub
import distill.stages.targets as teacher_module
import distill.stages.negatives as negatives_module
import distill.teachers.local as local_module
from distill.config import TeacherConfig
from distill.teachers import TeacherContext

model, cache_dir, texts_file, out = sys.argv[1:5]
accelerator = Accelerator(cpu=True, kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=40))])
real_read, calls, real_sha, hashed = teacher_module.read_entry, [], hub.file_sha256, []


def file_sha256(path, **kwargs):  # slow on rank 0: without the wait, rank 1 would hash the files meanwhile
    hashed.append(str(path))
    time.sleep(0.5 if accelerator.process_index == 0 else 0)
    return real_sha(path, **kwargs)


hub.file_sha256 = file_sha256

def read_entry(*args):
    calls.append(1)
    if accelerator.process_index == 1 and len(calls) <= 2:
        return None  # this "machine" has no copy of the entry: not for a hit, nor for its rows
    return real_read(*args)

teacher_module.read_entry = read_entry
spec = local_module.TeacherSpec.from_config(TeacherConfig(teacher_model=model), TeacherContext(accelerator.device))
cache = teacher_module.TeacherCache(accelerator, local_module.LocalTeacher(spec), cache_dir, batch_size=8)
vectors = cache.embeddings(json.loads(Path(texts_file).read_text()), "document")
Path(f"{out}.{accelerator.process_index}").write_text(json.dumps([cache.loaded, vectors.tolist(), len(hashed)]))
"""


@pytest.mark.multiprocess
def test_one_machine_without_the_entry_does_not_hang_the_others(
    accelerator: Accelerator, tiny_models: dict[str, Path], tmp_path: Path
) -> None:
    """Rank 1 misses what rank 0 has: both encode (rank 0 rewrites its entry) instead of rank 0 leaving alone.

    With no digests remembered, only the machine's first process reads the teacher's files to hash them.
    """
    texts = sentences(10, seed=4)
    make_cache(accelerator, tiny_models["teacher"], tmp_path / "cache").embeddings(texts, "document")
    (tmp_path / "cache-fingerprints.json").unlink()
    (tmp_path / "texts.json").write_text(json.dumps(texts))
    run_on_two_processes(ONE_MACHINE_LACKS_THE_ENTRY, tiny_models["teacher"], tmp_path / "cache", tmp_path)
    seen = [json.loads((tmp_path / f"seen.{rank}").read_text()) for rank in (0, 1)]
    assert [loaded for loaded, _, _ in seen] == [True, True]  # both encoded, together
    hashed = [count for _, _, count in seen]
    assert hashed[0] > 0 and hashed[1] == 0, hashed
    expected = reference_embeddings(tiny_models["teacher"], texts)
    for _, vectors, _ in seen:
        np.testing.assert_allclose(np.asarray(vectors, dtype=np.float32), expected, atol=2e-3)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_on_two_processes(driver: str, teacher: Path, cache_dir: Path, tmp_path: Path) -> None:
    """Run `driver` (a script) under torchrun on 2 gloo processes with (teacher, cache, texts.json, seen prefix)."""
    # every driver ends its group before the interpreter exits, then says it got there
    end = "\nimport os, torch.distributed\nif torch.distributed.is_initialized():\n"
    end += "    torch.distributed.barrier()\n    torch.distributed.destroy_process_group()\n"
    end += f"open({str(tmp_path / 'finished')!r} + '.' + os.environ['RANK'], 'w').close()\n"
    (tmp_path / "driver.py").write_text(driver + end)
    repo = Path(__file__).resolve().parents[1]
    env = dict(os.environ, HF_HUB_OFFLINE="1", ACCELERATE_USE_CPU="true", PYTHONPATH=str(repo))
    args = [str(teacher), str(cache_dir), str(tmp_path / "texts.json"), str(tmp_path / "seen")]
    done = subprocess.run(
        # a free port of its own, not the default 29500, which another launch may hold at the same time
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port())]
        + [str(tmp_path / "driver.py"), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    finished = all((tmp_path / f"finished.{rank}").exists() for rank in (0, 1))
    # On a loaded machine a gloo process can abort in the interpreter's teardown ("terminate called without an
    # active exception"), after the driver's last line: that abort is the interpreter's, not the code's under test.
    torn_down = finished and "terminate called without an active exception" in done.stderr
    assert done.returncode == 0 or torn_down, done.stderr[-3000:]


def saved_copy(model: Path, folder: Path, edit: Callable[[object], object]) -> Path:
    """`model` loaded, changed in place by `edit(model)`, and saved to `folder`."""
    from sentence_transformers import SentenceTransformer

    copy = SentenceTransformer(str(model), device="cpu")
    edit(copy)
    copy.save(str(folder), create_model_card=False)
    return folder


def poison_word(word: str) -> Callable[[object], None]:
    """An edit that makes the word's embedding NaN: every text holding it encodes to NaN, the others are finite."""

    def edit(model) -> None:
        with torch.no_grad():
            model[0].auto_model.embeddings.word_embeddings.weight[model.tokenizer.convert_tokens_to_ids(word)] = np.nan

    return edit


def committed_entries(cache_dir: Path) -> list[Path]:
    return [path for path in cache_entries(cache_dir) if cache_module.KEY.fullmatch(path.name)]


def test_non_finite_teacher_vectors_stop_the_run_and_are_not_cached(
    accelerator: Accelerator, tiny_models: dict[str, Path], tmp_path: Path
) -> None:
    """A NaN teacher vector would make the student's loss NaN at the first batch holding it and stay cached."""
    teacher = saved_copy(tiny_models["teacher"], tmp_path / "poisoned", poison_word("river"))
    texts = [text for text in sentences(40, seed=5) if "river" not in text]
    texts[7:7] = ["the river was light."]
    texts.append("a river.")
    cache = make_cache(accelerator, teacher, tmp_path / "cache")
    with pytest.raises(DistillError) as raised:
        cache.embeddings(texts, "document")
    assert str(raised.value) == (
        f"teacher {str(teacher)!r} computing in float32 gave non-finite vectors (NaN or inf) for 2 of the "
        f"{len(texts)} document texts of the chunk where it first happened, the first text #7 ('the river was "
        "light.'); check the teacher's weights for NaN or inf values (a broken or partly written checkpoint). No "
        "cache entry was written"
    )
    assert committed_entries(tmp_path / "cache") == []
    clean = [text for text in texts if "river" not in text]  # the same teacher's finite vectors are cached
    assert np.isfinite(cache.embeddings(clean, "document")).all()
    assert len(committed_entries(tmp_path / "cache")) == 1


def test_the_fix_for_non_finite_vectors_follows_the_compute_dtype(tmp_path: Path) -> None:
    texts = ["a", "b"]
    for dtype, fix in [("float16", "pass --teacher_dtype bfloat16"), ("bfloat16", "pass --teacher_dtype float32")]:
        spec = TeacherSpec("t", None, 64, "", False, dtype)
        with pytest.raises(DistillError, match=f"computing in {dtype} gave .* for 1 of the 2 query texts .*'b'.*{fix}"):
            local_module.check_finite(np.array([[1.0, 0.0], [np.inf, 0.0]]), np.array([0, 1]), texts, "query", spec)
        local_module.check_finite(np.eye(2), np.array([0, 1]), texts, "query", spec)  # finite: no error


def test_auto_teacher_dtype_is_bfloat16_only_where_the_gpu_has_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before compute capability 8 (V100, T4) bfloat16 is emulated in float32 arithmetic: float16 is what runs fast."""
    from distill.teachers.local import teacher_dtype

    capability = {"value": (8, 0)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability["value"])
    gpu = torch.device("cuda", 0)
    assert teacher_dtype("auto", "cpu") == "float32"
    assert teacher_dtype("auto", gpu) == "bfloat16"
    capability["value"] = (9, 0)
    assert teacher_dtype("auto", gpu) == "bfloat16"
    capability["value"] = (7, 5)
    assert teacher_dtype("auto", gpu) == "float16"
    assert teacher_dtype("float32", gpu) == "float32"
    assert teacher_dtype("bfloat16", "cpu") == "bfloat16"


def test_a_teacher_saved_in_half_precision_computes_in_the_chosen_dtype(
    accelerator: Accelerator, tiny_models: dict[str, Path], tmp_path: Path
) -> None:
    """transformers 5 loads a checkpoint in its saved dtype unless told; the cache key's dtype must be the real one."""
    from sentence_transformers import SentenceTransformer

    teacher = saved_copy(tiny_models["teacher"], tmp_path / "bf16", lambda model: model.to(torch.bfloat16))
    texts = sentences(24, seed=6)
    as_float32 = SentenceTransformer(str(teacher), device="cpu", model_kwargs={"dtype": torch.float32})
    expected = as_float32.encode(texts, normalize_embeddings=True)
    cache = make_cache(accelerator, teacher, tmp_path / "cache")
    vectors = cache.embeddings(texts, "document")
    assert cache.source.spec.compute_dtype == "float32"
    assert {parameter.dtype for parameter in cache.source.model.parameters()} == {torch.float32}
    np.testing.assert_allclose(vectors, expected, atol=2e-3)

    spec = teacher_spec(accelerator.device, teacher_model=str(teacher), teacher_dtype="bfloat16")
    in_bf16 = TeacherCache(accelerator, LocalTeacher(spec), tmp_path / "cache", 8)
    half_vectors = in_bf16.embeddings(texts, "document")
    assert {parameter.dtype for parameter in in_bf16.source.model.parameters()} == {torch.bfloat16}
    assert len(committed_entries(tmp_path / "cache")) == 2  # its own entry: the dtype is part of the key
    assert np.abs(half_vectors.astype(np.float32) - expected).max() > 2e-3  # so the check above can tell them apart


NON_FINITE_ON_TWO_PROCESSES = """
import json, sys
from datetime import timedelta
from pathlib import Path
from accelerate import Accelerator, InitProcessGroupKwargs
import distill.stages.targets as teacher_module
import distill.stages.negatives as negatives_module
import distill.teachers.local as local_module
from distill.config import TeacherConfig
from distill.teachers import TeacherContext
from distill.errors import DistillError

model, cache_dir, texts_file, out = sys.argv[1:5]
accelerator = Accelerator(cpu=True, kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=40))])
spec = local_module.TeacherSpec.from_config(TeacherConfig(teacher_model=model), TeacherContext(accelerator.device))
cache = teacher_module.TeacherCache(accelerator, local_module.LocalTeacher(spec), cache_dir, batch_size=4)
try:
    cache.embeddings(json.loads(Path(texts_file).read_text()), "document")
    seen = "no error"
except DistillError as e:
    seen = str(e)
Path(f"{out}.{accelerator.process_index}").write_text(seen)
"""


@pytest.mark.multiprocess
def test_non_finite_vectors_stop_every_process_at_once(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    """Whichever rank encoded the bad text, every rank raises the same error (none is left waiting in a gather)."""
    teacher = saved_copy(tiny_models["teacher"], tmp_path / "poisoned", poison_word("river"))
    texts = [text for text in sentences(30, seed=5) if "river" not in text] + ["the river was light."]
    (tmp_path / "texts.json").write_text(json.dumps(texts))
    run_on_two_processes(NON_FINITE_ON_TWO_PROCESSES, teacher, tmp_path / "cache", tmp_path)
    seen = [(tmp_path / f"seen.{rank}").read_text() for rank in (0, 1)]
    assert seen[0] == seen[1] and "gave non-finite vectors (NaN or inf) for 1 of the" in seen[0], seen
    assert committed_entries(tmp_path / "cache") == []


def test_encoding_shows_a_progress_bar_of_every_text(
    accelerator: Accelerator, tiny_models: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    texts = sentences(2500, seed=9)  # more than one gathered chunk (1,024 per process), so the bar moves
    make_cache(accelerator, tiny_models["teacher"], tmp_path / "cache").embeddings(texts, "document")
    bar = capsys.readouterr().err.replace("\r", "\n").splitlines()
    counts = [line.split("|")[-1].split()[0] for line in bar if line.startswith("teacher: document texts")]
    assert counts[-1] == f"{len(texts)}/{len(texts)}"
    assert len(set(counts)) >= 3  # 0, after the first chunk, ..., all: it moved while encoding


def test_mining_a_chunk_of_passages_at_a_time_gives_the_whole_search(accelerator: Accelerator) -> None:
    """The running top-k over chunks of 7 passages (memory bounded whatever the pair count) mines what one search
    over all 200 does, margin, shared texts and made-up counts included; any share of the queries mines its own
    rows as the whole does; the relaxed flags agree too."""
    from distill.stages.negatives import mine_rows

    rng = np.random.default_rng(3)
    passages = rng.standard_normal((200, 16)).astype(np.float32)
    passages /= np.linalg.norm(passages, axis=1, keepdims=True)
    passages[50] = passages[49]  # a text two pairs share
    queries = passages + 0.8 * rng.standard_normal((200, 16)).astype(np.float32)
    queries[:10] = -passages[:10]  # their positives score lowest: little lies below their margin line
    queries = queries.astype(np.float16)
    ids = np.arange(200)
    ids[50] = 49
    whole, relaxed = mine_rows(queries, passages.astype(np.float16), 5, 0.3, passage_ids=ids, passage_chunk=1_000)
    assert relaxed.any() and not relaxed.all()  # some queries needed passages within the margin
    chunked, chunked_relaxed = mine_rows(queries, passages.astype(np.float16), 5, 0.3, chunk_size=16,
                                         passage_ids=ids, passage_chunk=7)  # fmt: skip
    np.testing.assert_array_equal(chunked, whole)
    np.testing.assert_array_equal(chunked_relaxed, relaxed)
    share = np.arange(120, 200)
    part, _ = mine_rows(queries, passages.astype(np.float16), 5, 0.3, passage_ids=ids, rows=share, passage_chunk=7)
    np.testing.assert_array_equal(part, whole[120:])
    assert not (whole == np.arange(200)[:, None]).any() and not (whole[49] == 50).any()  # not its own text
    # brute force: each query's 5 best-scoring other texts below its margin line, where it has 5 of them
    scores = queries.astype(np.float32) @ passages.astype(np.float16).astype(np.float32).T
    for i in np.flatnonzero(~relaxed):
        line = scores[i, i] - abs(scores[i, i]) * 0.3
        allowed = [j for j in np.argsort(-scores[i]) if ids[j] != ids[i] and scores[i, j] <= line and j != 50]
        assert list(whole[i]) == allowed[:5], i


MINING_DRIVER = """
import sys

import numpy as np
import torch
from accelerate import Accelerator

from distill.stages.negatives import mined_negatives

accelerator = Accelerator(cpu=True)
assert accelerator.num_processes == 2  # one gloo group, each process mining its share
rng = np.random.default_rng(5)
vectors = rng.standard_normal((37, 8)).astype(np.float16)  # 37 pairs: the second process's share is padded
texts = [f"passage {i % 30}" for i in range(37)]  # some texts shared by two pairs
mined = mined_negatives(accelerator, 3, texts, vectors, vectors)
np.save(f"{sys.argv[4]}.{accelerator.process_index}.npy", mined)
accelerator.wait_for_everyone()
"""


@pytest.mark.multiprocess
def test_two_processes_mine_their_shares_and_each_ends_with_every_queries_negatives(tmp_path: Path) -> None:
    from types import SimpleNamespace

    from accelerate import PartialState

    run_on_two_processes(MINING_DRIVER, tmp_path, tmp_path, tmp_path)
    rng = np.random.default_rng(5)
    vectors = rng.standard_normal((37, 8)).astype(np.float16)
    texts = [f"passage {i % 30}" for i in range(37)]
    PartialState(cpu=True)
    one = negatives_module.mined_negatives(
        SimpleNamespace(device="cpu", num_processes=1, split_between_processes=PartialState().split_between_processes),
        3,
        texts,
        vectors,
        vectors,
    )
    for rank in (0, 1):
        np.testing.assert_array_equal(np.load(tmp_path / f"seen.{rank}.npy"), one)


def encoded_texts(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many texts each teacher forward pass encodes, filled in as they run."""
    counts: list[int] = []
    real = LocalTeacher.encoder

    def spy(self, accelerator, texts, role):
        encoder = real(self, accelerator, texts, role)
        encode = encoder.encode

        def counted(batch):
            counts.append(len(batch["input_ids"]) if isinstance(batch, dict) else len(batch))
            return encode(batch)

        encoder.encode = counted
        return encoder

    monkeypatch.setattr(LocalTeacher, "encoder", spy)
    return counts


def test_new_texts_beside_cached_ones_are_the_only_ones_encoded(
    accelerator: Accelerator, tiny_models: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A raised cap, a new seed's split, an added file: the texts an earlier entry of this teacher and role holds
    are read from it, and only the others are encoded; the vectors are those of encoding every text afresh."""
    counts = encoded_texts(monkeypatch)
    texts = sentences(40, seed=21)
    first = make_cache(accelerator, tiny_models["teacher"], tmp_path / "cache")
    first.embeddings(texts[:30], "document")
    assert sum(counts) == 30
    counts.clear()
    grown = make_cache(accelerator, tiny_models["teacher"], tmp_path / "cache")
    shuffled = texts[35:] + texts[:10][::-1] + texts[30:35]  # 10 cached, 10 new, in another order
    vectors = np.asarray(grown.embeddings(shuffled, "document"), dtype=np.float32)
    assert sum(counts) == 10  # the new ones alone
    assert len(committed_entries(tmp_path / "cache")) == 2  # the 10 new rows are kept once, in the new entry
    np.testing.assert_allclose(vectors, reference_embeddings(tiny_models["teacher"], shuffled), atol=2e-3)
    counts.clear()
    again = make_cache(accelerator, tiny_models["teacher"], tmp_path / "cache")
    subset = texts[5:25]
    earlier = first.embeddings(texts[:30], "document")[5:25]
    np.testing.assert_array_equal(again.embeddings(subset, "document"), earlier)
    assert counts == []  # every row found: nothing encoded
    make_cache(accelerator, tiny_models["teacher"], tmp_path / "cache").embeddings(texts[:3], "query")
    assert counts == []  # no query prompt: a query's vector is its document vector, the same rows
    prompted = make_cache(accelerator, tiny_models["teacher"], tmp_path / "cache", prompt="query: ")
    prompted.embeddings(texts[:3], "query")
    assert sum(counts) == 3  # a prompt changes the vectors: none of the earlier rows is reused


def test_entries_without_a_text_index_are_said_once_and_encoded_again(
    accelerator: Accelerator, tiny_models: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog
) -> None:
    """Entries that keep no per-text index are read by a run with the same texts; a run with other texts says so
    once and encodes its texts."""
    texts = sentences(12, seed=22)
    make_cache(accelerator, tiny_models["teacher"], tmp_path / "cache").embeddings(texts, "document")
    (entry,) = committed_entries(tmp_path / "cache")
    (entry / "texts.npy").unlink()
    (entry / "contents.json").unlink()  # an earlier distill sealed nothing
    manifest = json.loads((entry / "manifest.json").read_text())
    del manifest["model"]
    (entry / "manifest.json").write_text(json.dumps(manifest))
    counts = encoded_texts(monkeypatch)
    cache = make_cache(accelerator, tiny_models["teacher"], tmp_path / "cache")
    cache.embeddings(texts, "document")
    assert counts == []  # the same texts: its own key
    with caplog.at_level(logging.WARNING):
        cache.embeddings(texts[:6], "document")
        cache.embeddings(texts[6:], "document")
    assert sum(counts) == 12
    said = [r for r in caplog.records if "keep no per-text index" in r.getMessage()]
    assert len(said) == 1


REUSED_ON_TWO_PROCESSES = """
import json, sys
from pathlib import Path
from accelerate import Accelerator
from distill.config import TeacherConfig
from distill.stages.targets import TeacherCache
from distill.teachers import TeacherContext
from distill.teachers.local import LocalTeacher, TeacherSpec

accelerator = Accelerator(cpu=True)
teacher, cache_dir, texts_file, out = sys.argv[1:5]
texts = json.loads(Path(texts_file).read_text())
spec = TeacherSpec.from_config(TeacherConfig(teacher_model=teacher), TeacherContext(accelerator.device))
encoded = []
source = LocalTeacher(spec)
real = source.encoder

def counting(accelerator, batch_texts, role):
    encoded.append(len(batch_texts))
    return real(accelerator, batch_texts, role)

source.encoder = counting
cache = TeacherCache(accelerator, source, cache_dir, 4)
cache.embeddings(texts[:20], "document")
vectors = cache.embeddings(texts, "document")
Path(f"{out}.{accelerator.process_index}").write_text(json.dumps([encoded, vectors.astype(float).tolist()]))
"""


@pytest.mark.multiprocess
def test_two_processes_agree_on_the_rows_they_reuse(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    """Both processes find the same earlier rows, encode the same new texts together, and end with one entry."""
    texts = sentences(28, seed=23)
    (tmp_path / "texts.json").write_text(json.dumps(texts))
    run_on_two_processes(REUSED_ON_TWO_PROCESSES, tiny_models["teacher"], tmp_path / "cache", tmp_path)
    seen = [json.loads((tmp_path / f"seen.{rank}").read_text()) for rank in (0, 1)]
    assert seen[0][0] == seen[1][0] == [20, 8]  # the first list, then only the 8 new texts
    np.testing.assert_array_equal(seen[0][1], seen[1][1])
    np.testing.assert_allclose(seen[0][1], reference_embeddings(tiny_models["teacher"], texts), atol=2e-3)


FULL_DISK = """
import subprocess, sys
from pathlib import Path
import numpy as np
from distill.store import CacheWriter

class Spec:
    path, revision, max_seq_length = "teacher", None, None
    def prompt(self, role):
        return ""

folder = Path(sys.argv[1])
subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(folder)], check=True)
writer = CacheWriter(folder / ("0" * 32), "0" * 32, 4096, "document", Spec(), job="test")
for start in range(0, 4096, 256):  # 4096 x 256 float16: 2 MiB, on a disk of 1 MiB
    writer.write(np.arange(start, start + 256), np.ones((256, 256), dtype=np.float32))
print(writer.commit())
"""


def test_a_full_disk_while_encoding_is_one_line_not_a_sigbus(tmp_path: Path) -> None:
    """The entry is a memory map: a sparse file that runs out of space at a page fault killed the process with
    SIGBUS (exit 135), and the other processes waited out --ddp_timeout. It is allocated in full before the first
    write now, so a full disk is the cache's one-line error. A 1 MiB tmpfs stands for the disk (a user and mount
    namespace of its own: `unshare -rm`)."""
    if shutil.which("unshare") is None or subprocess.run(["unshare", "-rm", "true"]).returncode != 0:
        pytest.skip("no user namespaces here (unshare -rm)")
    (tmp_path / "disk").mkdir()
    (tmp_path / "driver.py").write_text(FULL_DISK)
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    done = subprocess.run(
        ["unshare", "-rm", sys.executable, str(tmp_path / "driver.py"), str(tmp_path / "disk")],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert done.stdout.startswith(f"cannot write the teacher cache under {tmp_path / 'disk'} (No space left on device")
    assert "needed, " in done.stdout and "free" in done.stdout


def test_a_full_disk_stops_the_encoding_after_its_first_block(
    accelerator: Accelerator, tiny_models: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The space the entry needs is allocated at its first write; where the disk refuses it, the encoding stops after
    that block with the cache's one-line error, instead of encoding every text first."""
    monkeypatch.setattr(teacher_module, "BLOCK_ROWS_PER_PROCESS", 8)

    def full(path: Path, size: int) -> None:
        raise OSError(errno.ENOSPC, f"No space left on device: {size} B needed, 0 B free")

    monkeypatch.setattr(store_module, "reserve", full)
    blocks = interrupt_after_blocks(monkeypatch, 99)
    cache = make_cache(accelerator, tiny_models["teacher"], tmp_path / "cache")
    with pytest.raises(DistillError, match=r"cannot write the teacher cache under .* \(No space left on device: "):
        cache.embeddings(sentences(37, seed=11), "document")
    assert blocks == [8]  # of 5
    assert [p.name for p in (tmp_path / "cache").iterdir() if not p.name.startswith(".")] == []  # no entry
    assert not list((tmp_path / "cache").glob("*/progress.json"))  # nothing marked done: a rerun starts clean


def test_a_lock_file_that_cannot_be_opened_is_no_lock_to_wait_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read-only cache folder: the lock file cannot be made. Taken for a held lock, a writer would wait forever;
    it is a folder without locks, and the write that follows says what is wrong."""
    real_open = os.open

    def denied(path, *args, **kwargs):  # type: ignore[no-untyped-def]
        if str(path).endswith(".lock"):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", denied)
    taken = store_module.claim(tmp_path / f".{'0' * 32}.lock", "job")
    assert taken.fd is None and not taken.held
    assert taken.unsupported == f"cannot open .{'0' * 32}.lock: Permission denied"
