"""Export: the deployable SentenceTransformer folder reloads to the same model; failed saves change nothing."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from sentence_transformers import SentenceTransformer

from conftest import sentences, tiny_run_flags
from distill.errors import DistillError
from distill.stages import export
from distill.stages.export import deployable_model, export_models, save_atomic
from distill.students.head import DistillationModel, least_squares_projection

CARD = "---\nlibrary_name: sentence-transformers\n---\n# Distilled student\n\ntest card\n"


def projected_model(tiny_models: dict[str, Path], seed: int = 0) -> DistillationModel:
    student = SentenceTransformer(str(tiny_models["student"]), device="cpu")
    generator = torch.Generator().manual_seed(seed)
    projection = least_squares_projection(
        torch.randn(256, 32, generator=generator), torch.randn(256, 48, generator=generator)
    )
    return DistillationModel(student, projection)


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


def test_exported_projection_model_reloads_identically(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    model = projected_model(tiny_models)
    texts = sentences(10, seed=5)
    deployable = deployable_model(model)
    expected = deployable.encode(texts, convert_to_numpy=True)
    target = tmp_path / "artifacts" / "model"
    save_atomic(deployable, target, CARD)

    reloaded = SentenceTransformer(str(target), device="cpu")
    vectors = reloaded.encode(texts, convert_to_numpy=True)
    assert vectors.shape == (10, 48)
    np.testing.assert_allclose(vectors, expected, atol=1e-5)
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    assert reloaded.max_seq_length == model.student.max_seq_length
    dim = getattr(reloaded, "get_embedding_dimension", None) or reloaded.get_sentence_embedding_dimension
    assert dim() == 48

    # the export is the student followed by the projection: same vectors as the training-time forward
    features = model.student.preprocess(texts)
    features.pop("modality", None)
    with torch.no_grad():
        ((_, target_vectors),) = model(features)
    unit = torch.nn.functional.normalize(target_vectors, dim=-1).numpy()
    np.testing.assert_allclose(vectors, unit, atol=1e-5)

    assert (target / "README.md").read_text() == CARD
    assert (target / "modules.json").is_file()
    assert leftovers(target.parent) == []


def test_matryoshka_mode_exports_the_student_itself(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    student = SentenceTransformer(str(tiny_models["student"]), device="cpu")
    model = DistillationModel(student)
    assert deployable_model(model) is student
    texts = sentences(4, seed=2)
    save_atomic(deployable_model(model), tmp_path / "model", CARD)
    reloaded = SentenceTransformer(str(tmp_path / "model"), device="cpu")
    np.testing.assert_allclose(reloaded.encode(texts), student.encode(texts), atol=1e-5)
    assert reloaded.encode(texts).shape == (4, 32)


def test_matryoshka_export_of_a_student_without_normalize_returns_unit_vectors(
    tiny_models: dict[str, Path], tmp_path: Path, accelerator
) -> None:
    """The losses compare re-normalised vectors, so the student's own norms are untrained: the export normalises."""
    loaded = SentenceTransformer(str(tiny_models["student"]), device="cpu")
    student = SentenceTransformer(modules=list(loaded)[:-1], device="cpu")  # Transformer, Pooling: no Normalize
    student.max_seq_length = 24
    texts = sentences(6, seed=4)
    raw = student.encode(texts)
    assert not np.allclose(np.linalg.norm(raw, axis=1), 1.0, atol=1e-3)
    exported = export_models(accelerator, DistillationModel(student), tmp_path, {}, "")
    reloaded = SentenceTransformer(exported["model"], device="cpu")
    vectors = reloaded.encode(texts)
    np.testing.assert_allclose(vectors, raw / np.linalg.norm(raw, axis=1, keepdims=True), atol=1e-5)
    assert reloaded.max_seq_length == 24
    assert [type(m).__name__ for m in reloaded][-1] == "Normalize"
    assert [type(m).__name__ for m in student][-1] == "Pooling"  # the in-memory student is left as it was


def test_export_replaces_a_previous_export(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    target = tmp_path / "model"
    texts = sentences(4, seed=7)
    save_atomic(deployable_model(projected_model(tiny_models, seed=1)), target, "old card")
    (target / "stale.txt").write_text("from the previous export")
    newer = deployable_model(projected_model(tiny_models, seed=2))
    save_atomic(newer, target, CARD)
    assert (target / "README.md").read_text() == CARD
    assert not (target / "stale.txt").exists()
    np.testing.assert_allclose(
        SentenceTransformer(str(target), device="cpu").encode(texts), newer.encode(texts), atol=1e-5
    )
    assert leftovers(tmp_path) == []


def test_failed_save_keeps_previous_export(
    tiny_models: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "model"
    texts = sentences(4, seed=3)
    previous = deployable_model(projected_model(tiny_models, seed=1))
    save_atomic(previous, target, "previous card")
    before = sorted(p.name for p in target.iterdir())
    expected = previous.encode(texts)

    failing = deployable_model(projected_model(tiny_models, seed=2))
    original_save = failing.save

    def save_then_fail(path: str, *args: object, **kwargs: object) -> None:
        original_save(path, *args, **kwargs)  # half a model written into the staging folder
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(failing, "save", save_then_fail)
    with pytest.raises(DistillError, match=r"cannot write the exported model to .*model \(No space left on device\)"):
        save_atomic(failing, target, CARD)

    assert sorted(p.name for p in target.iterdir()) == before
    assert (target / "README.md").read_text() == "previous card"
    np.testing.assert_allclose(SentenceTransformer(str(target), device="cpu").encode(texts), expected, atol=1e-5)
    assert leftovers(tmp_path) == []


def test_failed_first_save_leaves_nothing(
    tiny_models: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = deployable_model(projected_model(tiny_models))

    def fail(path: str, *args: object, **kwargs: object) -> None:
        Path(path).mkdir(parents=True)
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(model, "save", fail)
    with pytest.raises(DistillError, match=r"\(Permission denied\); make .* writable or pass --artifacts_dir"):
        save_atomic(model, tmp_path / "out" / "model", CARD)
    assert list((tmp_path / "out").iterdir()) == []


def test_failed_swap_puts_the_previous_export_back(
    tiny_models: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "model"
    save_atomic(deployable_model(projected_model(tiny_models, seed=1)), target, "previous card")
    real_replace = export.os.replace

    def replace(src: str | Path, dst: str | Path) -> None:
        if ".tmp-" in Path(src).name:  # the new export's staging folder cannot be moved into place
            raise OSError(18, "Invalid cross-device link")
        real_replace(src, dst)

    monkeypatch.setattr(export.os, "replace", replace)
    with pytest.raises(DistillError, match=r"Invalid cross-device link"):
        save_atomic(deployable_model(projected_model(tiny_models, seed=2)), target, CARD)
    monkeypatch.undo()
    assert (target / "README.md").read_text() == "previous card"
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize("projection", [True, False], ids=["projection", "matryoshka"])
def test_each_exported_folder_has_the_card_of_what_it_holds(
    tiny_models: dict[str, Path],
    tmp_path: Path,
    accelerator,
    projection: bool,
) -> None:
    """The projected model's card says so; the student folder's (projection mode) says it is the bare student."""
    model = projected_model(tiny_models)
    if not projection:
        model = DistillationModel(model.student)
    table = "| metric | student_after |\n|---|---|\n| ndcg@10 | 0.5000 |"
    exported = export_models(accelerator, model, tmp_path, {"teacher_model": "big/teacher"}, table)
    cards = {name: (Path(path) / "README.md").read_text() for name, path in exported.items()}
    assert sorted(cards) == (["model", "student"] if projection else ["model"])
    assert all(table in card for card in cards.values())
    assert ("(32-d, projected to the teacher's 48-d)." in cards["model"]) == projection
    if projection:
        assert "(32-d). This folder is the student at its own 32 dimensions, without the projection" in cards["student"]
        assert "projected" not in cards["student"]


@pytest.mark.parametrize("projection", [True, False], ids=["projection", "matryoshka"])
def test_the_card_says_how_to_use_the_folder_and_the_folder_does_it(
    tiny_models: dict[str, Path],
    tmp_path: Path,
    accelerator,
    projection: bool,
) -> None:
    """What the card tells a user (width, teacher space, truncate_dim, no prompts) is what SentenceTransformer does."""
    model = projected_model(tiny_models) if projection else DistillationModel(projected_model(tiny_models).student)
    settings = {"use_projection": projection, "matryoshka_dims": None if projection else [16, 8]}
    path = export_models(accelerator, model, tmp_path, settings, "")["model"]
    card = (Path(path) / "README.md").read_text()
    texts = sentences(3, seed=8)
    loaded = SentenceTransformer(path, device="cpu")
    width = 48 if projection else 32
    assert f"The vectors are {width}-d" in card and loaded.encode(texts).shape == (3, width)
    assert f"# [3, {width}]" in card  # sentence-transformers' usage example, run on the model when the card is made
    assert "No prompts" in card
    np.testing.assert_allclose(loaded.encode_query(texts), loaded.encode(texts), atol=1e-6)
    assert ("they can query an index of the teacher's own passage vectors" in card) == projection
    if projection:
        own = card[card.index("## Distillation") : card.index("## Training Details")]  # distill's section
        assert "Matryoshka" not in own and "truncate_dim" not in own
        return
    assert "(32-d, Matryoshka)." in card and "trained to be truncated to 32, 16, 8 dimensions" in card
    truncate_dim = int(re.search(r"truncate_dim=(\d+)", card).group(1))
    assert truncate_dim == 16
    short = SentenceTransformer(path, device="cpu", truncate_dim=truncate_dim)
    np.testing.assert_allclose(short.encode(texts), loaded.encode(texts)[:, :16], atol=1e-6)
    unit = short.encode(texts, normalize_embeddings=True)
    np.testing.assert_allclose(np.linalg.norm(unit, axis=1), 1.0, atol=1e-5)


def test_any_failed_save_leaves_no_temporary_folder(
    tiny_models: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not only OSError: a config that fails validation mid-save, say, must not leave `.model.tmp-<pid>` behind."""
    model = deployable_model(projected_model(tiny_models))

    def fail(path: str, *args: object, **kwargs: object) -> None:
        Path(path).mkdir(parents=True)
        raise ValueError("layer_types does not match num_hidden_layers")

    monkeypatch.setattr(model, "save", fail)
    with pytest.raises(ValueError, match="layer_types"):
        save_atomic(model, tmp_path / "out" / "model", CARD)
    assert list((tmp_path / "out").iterdir()) == []


@pytest.mark.parametrize("projection", [True, False])
def test_exported_models_carry_no_prompts(tiny_models: dict[str, Path], tmp_path: Path, projection: bool) -> None:
    """The student was trained on unprompted texts: encode_query/encode_document must not add its old prompts."""
    student = SentenceTransformer(str(tiny_models["student"]), device="cpu")
    student.prompts = {"query": "query: ", "document": "passage: ", "classification": "classify: "}
    student.default_prompt_name = "classification"
    model = projected_model(tiny_models) if projection else DistillationModel(student)
    if projection:
        model.student.prompts, model.student.default_prompt_name = dict(student.prompts), "classification"
    targets = {"model": deployable_model(model)}
    if projection:
        targets["student"] = model.student
    texts = sentences(4, seed=6)
    for name, exported in targets.items():
        save_atomic(exported, tmp_path / name, CARD)
        saved = json.loads((tmp_path / name / "config_sentence_transformers.json").read_text())
        assert not any(saved["prompts"].values()) and saved["default_prompt_name"] is None, name
        reloaded = SentenceTransformer(str(tmp_path / name), device="cpu")
        np.testing.assert_allclose(reloaded.encode_query(texts), reloaded.encode(texts, prompt=""), atol=1e-6)
        np.testing.assert_allclose(reloaded.encode_document(texts), reloaded.encode(texts, prompt=""), atol=1e-6)
    assert model.student.prompts["query"] == "query: "  # the in-memory model is left as it was


def test_push_to_hub_uploads_the_exported_folder_privately_and_records_the_commit(
    tiny_models, tiny_data, tmp_path, local_hub
):
    """--push_to_hub with --hub_private True: a private repository holding the exported folder byte for byte, card
    included, and results.json's `hub` entry names the commit the Hub answered."""
    from distill.train import main

    out = tmp_path / "run"
    flags = tiny_run_flags(tiny_models, tiny_data, out, skip_phase2=True, efficiency_texts=0)
    assert main([*flags, "--push_to_hub", "me/tiny-student", "--hub_private", "True"]) == 0
    results = json.loads((out / "results.json").read_text())
    repo = local_hub.repos["me/tiny-student"]
    assert repo["private"] is True
    assert results["hub"]["repo"] == "me/tiny-student"
    assert results["hub"]["url"].startswith(f"{local_hub.url}/me/tiny-student/commit/")
    folder = out / "artifacts" / "model"
    exported = {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}
    assert repo["files"] == exported and "README.md" in exported and "model.safetensors" in exported
    assert local_hub.card_headers == [exported["README.md"].decode()]
    sent = {authorization for method, _, authorization in local_hub.requests if method == "POST"}
    assert sent == {"Bearer hf_local_stand_in"}


def test_a_failed_private_push_names_the_retry_command_with_private(
    tiny_models, tiny_data, tmp_path, local_hub, caplog
):
    from distill.train import main

    local_hub.fail_commits = True
    out = tmp_path / "run"
    flags = tiny_run_flags(tiny_models, tiny_data, out, skip_phase2=True, efficiency_texts=0)
    with caplog.at_level(logging.WARNING):
        assert main([*flags, "--push_to_hub", "me/tiny-student", "--hub_private", "True"]) == 0
    folder = out / "artifacts" / "model"
    pushes = [r.getMessage() for r in caplog.records if "push to the Hub" in r.getMessage()]
    assert len(pushes) == 1 and pushes[0].endswith(f"retry with: hf upload me/tiny-student {folder} . --private")
    assert json.loads((out / "results.json").read_text())["hub"]["error"]
    assert (folder / "model.safetensors").is_file()
