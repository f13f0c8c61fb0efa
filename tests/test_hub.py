"""Model resolution (shipped copies for exact names only) and model fingerprints for cache keys."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

import distill.embedded.models as models
import distill.files as files
import distill.hub as hub
from distill.hub import declared_dimension, declared_max_seq_length, model_fingerprint, resolve_model


def test_a_shipped_copy_stands_in_only_for_its_exact_name_without_revision(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shipped = tmp_path / "shipped"
    monkeypatch.setattr(
        models, "SHIPPED", [models.ShippedModel("sentence-transformers/all-MiniLM-L6-v2", "pip", lambda: shipped)]
    )
    assert resolve_model("sentence-transformers/all-MiniLM-L6-v2") == str(shipped)
    assert resolve_model("all-MiniLM-L6-v2") == str(shipped)
    assert resolve_model("myorg/all-MiniLM-L6-v2") == "myorg/all-MiniLM-L6-v2"  # someone else's fine-tune
    assert resolve_model("sentence-transformers/all-MiniLM-L6-v2", "v1") == "sentence-transformers/all-MiniLM-L6-v2"


def test_a_hub_snapshot_is_its_commit_whatever_files_arrive_later(tmp_path: Path) -> None:
    commit = "0123456789abcdef0123456789abcdef01234567"
    snapshot = tmp_path / "models--org--teacher" / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (snapshot / "model.safetensors").write_bytes(b"weights")
    before = model_fingerprint(str(snapshot))
    (snapshot / "README.md").write_text("# card")  # what loading the model fetches
    (snapshot / "modeling.py").write_text("# remote code")
    assert model_fingerprint(str(snapshot)) == before
    assert commit in before and "models--org--teacher" in before


def test_a_local_folder_is_hashed_whole_and_the_digests_are_remembered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tmp_path / "teacher"
    folder.mkdir()
    weights = folder / "model.safetensors"
    data = bytearray(os.urandom(6 << 20))
    weights.write_bytes(bytes(data))
    memo = tmp_path / "cache-fingerprints.json"
    first = model_fingerprint(str(folder), memo=memo)
    assert json.loads(memo.read_text())[str(weights.resolve())]["size"] == 6 << 20
    # a warm run reads no weights again
    read = []
    real = hub.file_sha256
    monkeypatch.setattr(hub, "file_sha256", lambda path, **kwargs: read.append(path) or real(path, **kwargs))
    assert model_fingerprint(str(folder), memo=memo) == first
    assert read == []
    # a fine-tune that changes only middle bytes (same size, same header) is another model
    data[3 << 20] ^= 0xFF
    weights.write_bytes(bytes(data))
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 1_000_000))
    assert model_fingerprint(str(folder), memo=memo) != first
    assert read == [weights.resolve()]


def sentence_transformer_folder(folder: Path, modules: list[tuple[str, dict]]) -> Path:
    """A model folder with only modules.json and each module's config.json (no weights)."""
    entries = []
    for i, (kind, config) in enumerate(modules):
        path = f"{i}_{kind}"
        (folder / path).mkdir(parents=True)
        (folder / path / "config.json").write_text(json.dumps(config))
        entries.append({"idx": i, "name": str(i), "path": path, "type": f"sentence_transformers.models.{kind}"})
    (folder / "modules.json").write_text(json.dumps(entries))
    return folder


@pytest.mark.parametrize(
    ("pooling", "expected"),
    [
        ({"embedding_dimension": 48, "pooling_mode": "mean"}, 48),
        ({"embedding_dimension": 48, "pooling_mode": ["mean", "cls"]}, 96),  # concatenated: twice the width
        ({"word_embedding_dimension": 48, "pooling_mode_cls_token": True, "pooling_mode_max_tokens": True}, 96),
        ({"word_embedding_dimension": 48, "pooling_mode_mean_tokens": True, "pooling_mode_cls_token": False}, 48),
    ],
)
def test_declared_dimension_counts_every_concatenated_pooling(tmp_path: Path, pooling: dict, expected: int) -> None:
    """A too-narrow reading would refuse a valid Matryoshka pairing (a 96-d teacher for a 64-d student)."""
    folder = sentence_transformer_folder(tmp_path / "model", [("Transformer", {}), ("Pooling", pooling)])
    assert declared_dimension(str(folder)) == expected
    dense = sentence_transformer_folder(
        tmp_path / "dense", [("Transformer", {}), ("Pooling", pooling), ("Dense", {"out_features": 24})]
    )
    assert declared_dimension(str(dense)) == 24


def test_fingerprinting_a_large_folder_shows_a_bar_and_a_warm_one_reads_nothing(tmp_path, monkeypatch, capsys):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"w" * 3000)
    (folder / "config.json").write_text("{}")
    memo = tmp_path / "memo.json"
    monkeypatch.setattr(files, "BAR_BYTES", 1000)  # the folder counts as large
    first = model_fingerprint(str(folder), memo=memo)
    bar = capsys.readouterr().err.replace("\r", "\n")
    assert "fingerprinting model" in bar and "3.00k/3.00k" in bar
    assert model_fingerprint(str(folder), memo=memo) == first
    assert "fingerprinting" not in capsys.readouterr().err  # every digest remembered: nothing to read, no bar


def test_a_folders_token_limit_is_read_as_sentence_transformers_sets_it(tiny_models, tmp_path):
    """sentence_bert_config.json's max_seq_length (older folders), else the tokenizer's model_max_length at most the
    model's positions; the tiny models are saved by sentence-transformers 6, whose limit is the tokenizer's."""
    assert declared_max_seq_length(tiny_models["teacher"]) == 64

    def folder(name: str, **files: dict) -> Path:
        (tmp_path / name).mkdir()
        for file, content in files.items():
            (tmp_path / name / f"{file}.json").write_text(json.dumps(content))
        return tmp_path / name

    positions = {"max_position_embeddings": 512}
    old = folder("old", sentence_bert_config={"max_seq_length": 256}, config=positions)
    assert declared_max_seq_length(old) == 256
    assert declared_max_seq_length(folder("new", tokenizer_config={"model_max_length": 1024}, config=positions)) == 512
    unset = folder("unset", tokenizer_config={"model_max_length": int(1e30)}, config=positions)
    assert declared_max_seq_length(unset) == 512
    assert declared_max_seq_length(folder("none")) is None
