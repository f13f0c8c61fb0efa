"""The student: layer selection and pruning, gradient checkpointing, the projections, dimension checks."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from sentence_transformers import SentenceTransformer

from conftest import sentences
from distill.errors import DistillError
from distill.students.head import (
    DistillationModel,
    add_rotation,
    check_dimensions,
    embedding_dim,
    least_squares_projection,
    matryoshka_dims,
    orthogonal_procrustes,
    orthogonal_projection,
    pca_basis,
)
from distill.students.transformer import enable_gradient_checkpointing, evenly_spaced, load_student, prune_layers


def encoder_layers(model: SentenceTransformer) -> torch.nn.ModuleList:
    return model[0].auto_model.encoder.layer


def student_features(student: SentenceTransformer, texts: list[str]) -> dict[str, torch.Tensor]:
    features = student.preprocess(texts)
    features.pop("modality", None)
    return features


# ---------------------------------------------------------------- layer choice


def test_evenly_spaced_examples() -> None:
    assert evenly_spaced(6, 3) == [0, 2, 5]
    assert evenly_spaced(12, 4) == [0, 4, 7, 11]
    assert evenly_spaced(4, 2) == [0, 3]
    assert evenly_spaced(5, 5) == [0, 1, 2, 3, 4]
    assert evenly_spaced(6, 1) == [5]


@pytest.mark.parametrize("total", range(2, 25))
def test_evenly_spaced_keeps_first_and_last(total: int) -> None:
    for keep in range(2, total + 1):
        kept = evenly_spaced(total, keep)
        assert len(kept) == keep
        assert kept == sorted(set(kept))
        assert kept[0] == 0 and kept[-1] == total - 1


# ---------------------------------------------------------------- pruning


def test_prune_layers_keeps_the_chosen_layers(tiny_models: dict[str, Path]) -> None:
    original = SentenceTransformer(str(tiny_models["student"]), device="cpu")
    pruned = SentenceTransformer(str(tiny_models["student"]), device="cpu")
    assert len(encoder_layers(original)) == 4
    kept = prune_layers(pruned, 2)
    assert kept == [0, 3]
    layers = encoder_layers(pruned)
    assert len(layers) == 2
    assert pruned[0].auto_model.config.num_hidden_layers == 2
    for new_index, old_index in enumerate(kept):
        new_state = layers[new_index].state_dict()
        old_state = encoder_layers(original)[old_index].state_dict()
        assert new_state.keys() == old_state.keys()
        for name in new_state:
            assert torch.equal(new_state[name], old_state[name]), name
    # the dropped layer 1 is really gone: layer 1 of the pruned model is the old layer 3
    old_second = encoder_layers(original)[1].state_dict()
    assert not all(torch.equal(v, old_second[k]) for k, v in layers[1].state_dict().items())
    # embeddings and other modules are untouched
    assert torch.equal(
        pruned[0].auto_model.embeddings.word_embeddings.weight, original[0].auto_model.embeddings.word_embeddings.weight
    )


def test_pruned_model_saves_and_reloads(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    texts = sentences(6, seed=4)
    pruned = SentenceTransformer(str(tiny_models["student"]), device="cpu")
    full_vectors = pruned.encode(texts)
    prune_layers(pruned, 3)
    assert evenly_spaced(4, 3) == [0, 2, 3]
    expected = pruned.encode(texts)
    assert not np.allclose(expected, full_vectors, atol=1e-4)  # pruning changed the function
    pruned.save(str(tmp_path / "pruned"), create_model_card=False)
    reloaded = SentenceTransformer(str(tmp_path / "pruned"), device="cpu")
    assert len(encoder_layers(reloaded)) == 3
    assert reloaded[0].auto_model.config.num_hidden_layers == 3
    np.testing.assert_allclose(reloaded.encode(texts), expected, atol=1e-5)


def test_load_student_prunes_and_sets_length(tiny_models: dict[str, Path]) -> None:
    student = load_student(str(tiny_models["student"]), num_layers=1, max_seq_length=16)
    assert len(encoder_layers(student)) == 1
    assert student.max_seq_length == 16
    assert embedding_dim(student) == 32
    assert next(student.parameters()).device.type == "cpu"
    original = SentenceTransformer(str(tiny_models["student"]), device="cpu")
    last = encoder_layers(original)[3].state_dict()
    for name, value in encoder_layers(student)[0].state_dict().items():
        assert torch.equal(value, last[name])


def test_attention_dropout_is_set_for_training_and_the_config_keeps_the_models_own(
    tiny_models: dict[str, Path], tmp_path: Path
) -> None:
    folder = tmp_path / "student"
    shutil.copytree(tiny_models["student"], folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "attention_probs_dropout_prob": 0.3}))
    features = load_student(str(folder)).tokenize(sentences(4, seed=9))

    def attention_dropouts(student: SentenceTransformer) -> list[float]:
        return [layer.attention.self.dropout.p for layer in encoder_layers(student)]

    def two_training_passes_agree(student: SentenceTransformer) -> bool:
        student.train()  # the tiny model's hidden dropout is 0, so only attention dropout can differ
        first, second = (student(dict(features))["sentence_embedding"] for _ in range(2))
        return torch.equal(first, second)

    own = load_student(str(folder))
    assert attention_dropouts(own) == [0.3] * 4
    assert not two_training_passes_agree(own)

    student = load_student(str(folder), attention_dropout=0.0)
    assert attention_dropouts(student) == [0.0] * 4
    assert two_training_passes_agree(student)
    backbone_config = student[0].auto_model.config
    assert backbone_config.attention_probs_dropout_prob == 0.3  # the checkpoint's value, as exported
    assert not hasattr(backbone_config, "attention_dropout")  # the other family's field is not left behind
    student.save(str(tmp_path / "saved"))
    saved = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert saved["attention_probs_dropout_prob"] == 0.3 and "attention_dropout" not in saved
    assert attention_dropouts(load_student(str(folder), attention_dropout=0.2)) == [0.2] * 4


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_student_saved_in_half_precision_trains_in_float32(
    tiny_models: dict[str, Path], tmp_path: Path, dtype: torch.dtype
) -> None:
    """transformers 5 loads a checkpoint in its saved dtype unless told (Qwen3-Embedding is saved in bfloat16): the
    optimizer would update half-precision weights, and autocast's mixed precision expects float32 ones."""
    SentenceTransformer(str(tiny_models["student"]), device="cpu").to(dtype).save(str(tmp_path / "half"))
    assert next(SentenceTransformer(str(tmp_path / "half"), device="cpu").parameters()).dtype == dtype  # as saved
    for dropout in (None, 0.0):  # with and without config overrides
        student = load_student(str(tmp_path / "half"), num_layers=2, attention_dropout=dropout)
        assert {parameter.dtype for parameter in student.parameters()} == {torch.float32}


def test_pruning_to_more_layers_than_exist(tiny_models: dict[str, Path]) -> None:
    student = SentenceTransformer(str(tiny_models["student"]), device="cpu")
    with pytest.raises(DistillError, match=r"the student has 4 layers, cannot keep 5; pass a number from 1 to 4"):
        prune_layers(student, 5)
    assert len(encoder_layers(student)) == 4  # left as it was


def test_missing_student_folder() -> None:
    with pytest.raises(DistillError, match=r"model folder '/no/such/student' does not exist"):
        load_student("/no/such/student")


# ---------------------------------------------------------------- gradient checkpointing


def test_gradient_checkpointing_recomputes_each_layer_with_the_same_gradients(tiny_models: dict[str, Path]) -> None:
    texts = sentences(4, seed=5)
    gradients, attention_calls = {}, {}
    for checkpointing in (False, True):
        # attention dropout on: the recomputed forward pass must replay the first pass's masks
        student = load_student(str(tiny_models["student"]), attention_dropout=0.3)
        if checkpointing:
            assert enable_gradient_checkpointing(student) == [student[0].auto_model]
            assert all(layer.gradient_checkpointing for layer in encoder_layers(student))
        calls = []
        for layer in encoder_layers(student):
            layer.attention.register_forward_hook(lambda *_, seen=calls: seen.append(1))
        student.train()
        torch.manual_seed(0)
        student(student_features(student, texts))["sentence_embedding"].pow(2).sum().backward()
        attention_calls[checkpointing] = len(calls)
        gradients[checkpointing] = {n: p.grad for n, p in student.named_parameters() if p.grad is not None}
    assert attention_calls == {False: 4, True: 8}  # each layer runs again in the backward pass
    assert gradients[True].keys() == gradients[False].keys()
    for name, gradient in gradients[False].items():
        torch.testing.assert_close(gradients[True][name], gradient, rtol=0, atol=1e-6, msg=name)


def test_gradient_checkpointing_needs_a_transformer(tiny_models: dict[str, Path]) -> None:
    from sentence_transformers.sentence_transformer.modules import StaticEmbedding
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tiny_models["student"] / "tokenizer.json"))
    static = SentenceTransformer(modules=[StaticEmbedding(tokenizer, embedding_dim=8)], device="cpu")
    with pytest.raises(
        DistillError,
        match=r"^gradient_checkpointing: the student \(StaticEmbedding\) has no repeated layers to checkpoint; "
        r"drop --gradient_checkpointing or use a student built on a Hugging Face transformer$",
    ):
        enable_gradient_checkpointing(static)


def test_gradient_checkpointing_wraps_the_layers_of_a_backbone_hugging_face_cannot_checkpoint(
    tiny_models: dict[str, Path],
) -> None:
    """MPNet (the default student) has no Hugging Face checkpointing in transformers 5: its layers are wrapped."""

    def gradients(checkpointing: bool) -> tuple[torch.Tensor, int]:
        student = load_student(str(tiny_models["student"]), attention_dropout=0.3)  # masks to replay
        backbone = student[0].auto_model
        backbone.supports_gradient_checkpointing = False  # as MPNetModel declares it
        layers = list(backbone.encoder.layer)
        calls = [0]
        layers[0].attention.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
        if checkpointing:
            assert enable_gradient_checkpointing(student) == layers
        student.train()
        torch.manual_seed(0)  # dropout: checkpointing must replay the forward pass's masks
        features = student.preprocess(["a first sentence", "a second, longer sentence than the first"])
        features.pop("modality", None)
        student(features)["sentence_embedding"].pow(2).sum().backward()
        grads = torch.cat([p.grad.flatten() for p in student.parameters() if p.grad is not None])
        return grads, calls[0]

    plain, plain_calls = gradients(False)
    checkpointed, checkpointed_calls = gradients(True)
    assert (plain_calls, checkpointed_calls) == (1, 2)  # the layer ran again in the backward pass
    assert torch.allclose(plain, checkpointed, atol=1e-6)


# ---------------------------------------------------------------- projection


def test_least_squares_projection_recovers_a_linear_map() -> None:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(3000, 32, generator=generator)
    weight = torch.randn(32, 48, generator=generator) / 6
    bias = torch.randn(48, generator=generator)
    y = x @ weight + bias
    projection = least_squares_projection(x, y)
    assert projection.linear.weight.shape == (48, 32)
    assert torch.allclose(projection.linear.weight.T, weight, atol=1e-4)
    assert torch.allclose(projection.linear.bias, bias, atol=1e-4)
    with torch.no_grad():
        out = projection({"sentence_embedding": x})["sentence_embedding"]
    assert out.dtype == torch.float32
    assert torch.allclose(out, y, atol=1e-3)


def test_projection_is_identity_activated_and_trainable() -> None:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(200, 4, generator=generator)
    projection = least_squares_projection(x, -x)  # a negative map: a tanh or relu would clip it
    with torch.no_grad():
        out = projection({"sentence_embedding": x})["sentence_embedding"]
    assert torch.allclose(out, -x, atol=1e-3)
    assert all(p.requires_grad for p in projection.parameters())


def test_distillation_model_outputs(tiny_models: dict[str, Path]) -> None:
    student = SentenceTransformer(str(tiny_models["student"]), device="cpu")
    generator = torch.Generator().manual_seed(2)
    projection = least_squares_projection(
        torch.randn(100, 32, generator=generator), torch.randn(100, 48, generator=generator)
    )
    texts = sentences(5, seed=1)
    features = student_features(student, texts)
    with torch.no_grad():
        projected = DistillationModel(student, projection)
        ((embedding, target),) = projected(features)
        assert embedding.shape == (5, 32) and target.shape == (5, 48)
        np.testing.assert_allclose(embedding.numpy(), student.encode(texts), atol=1e-5)
        expected_target = projection({"sentence_embedding": embedding})["sentence_embedding"]
        assert torch.allclose(target, expected_target)

        mrl = DistillationModel(student)
        assert mrl.student_dim == 32
        first, second = mrl(features, student_features(student, texts[:2]))
        assert torch.equal(first[0], first[1])  # no projection: the target is the student's own vector
        assert second[0].shape == (2, 32)


# ---------------------------------------------------------------- dimensions


def test_check_dimensions() -> None:
    with pytest.raises(DistillError, match=r"truncates the teacher's 48-d embeddings to the student's 64 dimensions"):
        check_dimensions(64, 48, use_projection=False)
    check_dimensions(64, 48, use_projection=True)  # a projection maps to any width
    check_dimensions(32, 48, use_projection=False)
    check_dimensions(48, 48, use_projection=False)


def test_matryoshka_dims() -> None:
    assert matryoshka_dims(32, None) == [32, 16, 8]
    assert matryoshka_dims(384, None) == [384, 192, 96]
    assert matryoshka_dims(384, []) == [384, 192, 96]
    assert matryoshka_dims(64, [16, 32]) == [64, 32, 16]  # sorted, the full dim always included
    assert matryoshka_dims(64, [64, 64, 8]) == [64, 8]
    with pytest.raises(DistillError, match=r"matryoshka_dims \[128\] exceed the student's 64 dimensions"):
        matryoshka_dims(64, [128, 32])


# ---------------------------------------------------------------- Matryoshka basis


def test_pca_basis_is_orthonormal_ordered_and_deterministic() -> None:
    rng = np.random.default_rng(0)
    rotation = np.linalg.qr(rng.normal(size=(6, 6)))[0]
    scales = np.array([5.0, 3.0, 2.0, 1.0, 0.5, 0.1])
    vectors = (rng.normal(size=(500, 6)) * scales) @ rotation.T  # variance along rotation's columns, in order
    basis = pca_basis(vectors, chunk_size=64)
    np.testing.assert_allclose(basis.T @ basis, np.eye(6), atol=1e-5)
    # the leading direction is rotation's first column (up to sign), then the second
    assert abs(basis[:, 0] @ rotation[:, 0]) > 0.99 and abs(basis[:, 1] @ rotation[:, 1]) > 0.98
    np.testing.assert_array_equal(basis, pca_basis(vectors, chunk_size=500))  # chunking changes nothing
    np.testing.assert_array_equal(basis, pca_basis(-vectors))  # signs are fixed by the data's second moment
    assert (basis[np.abs(basis).argmax(axis=0), np.arange(6)] > 0).all()


def test_orthogonal_procrustes_recovers_a_rotation() -> None:
    generator = torch.Generator().manual_seed(3)
    source = torch.randn(200, 8, generator=generator)
    rotation = torch.linalg.qr(torch.randn(8, 8, generator=generator))[0]
    found = orthogonal_procrustes(source, source @ rotation)
    torch.testing.assert_close(found, rotation, atol=1e-5, rtol=0)
    torch.testing.assert_close(found.T @ found, torch.eye(8), atol=1e-5, rtol=0)


def test_rotation_keeps_cosines_reorders_coordinates_and_saves(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    texts = sentences(6, seed=4)
    student = load_student(str(tiny_models["student"]))
    before = student.encode(texts, convert_to_tensor=True)
    rotation = torch.linalg.qr(torch.randn(32, 32, generator=torch.Generator().manual_seed(5)))[0]
    add_rotation(student, rotation)
    after = student.encode(texts, convert_to_tensor=True)
    expected = torch.nn.functional.normalize(before @ rotation, dim=-1)
    torch.testing.assert_close(after, expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(after @ after.T, before @ before.T, atol=1e-5, rtol=0)  # no cosine changes
    assert not any(p.requires_grad for p in student[len(student) - 2].parameters())  # a fixed rotation
    student.save(str(tmp_path / "rotated"))
    reloaded = SentenceTransformer(str(tmp_path / "rotated"), device="cpu")
    torch.testing.assert_close(reloaded.encode(texts, convert_to_tensor=True), after, atol=1e-6, rtol=0)


def test_orthogonal_projection_keeps_the_students_cosines() -> None:
    generator = torch.Generator().manual_seed(8)
    student = F.normalize(torch.randn(100, 8, generator=generator), dim=-1)
    teacher = torch.randn(100, 12, generator=generator)
    projection = orthogonal_projection(student, teacher)
    projected = projection({"sentence_embedding": student})["sentence_embedding"]
    assert projected.shape == (100, 12) and projection.linear.bias is None
    torch.testing.assert_close(
        F.normalize(projected, dim=-1) @ F.normalize(projected, dim=-1).T, student @ student.T, atol=1e-5, rtol=0
    )
    assert all(p.requires_grad for p in projection.parameters())  # it trains like the least-squares one
    with pytest.raises(DistillError, match="fit a least-squares projection instead"):
        orthogonal_projection(teacher, student)  # 12 -> 8 cannot keep cosines


def test_orthogonal_projection_matches_the_teachers_norms() -> None:
    """A student without a final Normalize (norms about 6 here) is projected to the teacher's unit length, so
    phase 1's squared distance starts at 2 * (1 - cos), not at the norm gap; unit students stay unscaled."""
    generator = torch.Generator().manual_seed(9)
    direction = torch.randn(200, 8, generator=generator)
    teacher = F.normalize(torch.cat([direction, 0.3 * torch.randn(200, 4, generator=generator)], dim=1), dim=-1)
    for scale in (6.0, 1.0):
        student = scale * F.normalize(direction, dim=-1)
        projected = orthogonal_projection(student, teacher)({"sentence_embedding": student})["sentence_embedding"]
        torch.testing.assert_close(projected.norm(dim=-1), torch.ones(200), atol=1e-5, rtol=0)
        torch.testing.assert_close(
            F.normalize(projected, dim=-1) @ F.normalize(projected, dim=-1).T,
            F.normalize(student, dim=-1) @ F.normalize(student, dim=-1).T,
            atol=1e-5,
            rtol=0,
        )


def test_pruning_keeps_the_kept_layers_types(tiny_models: dict[str, Path]) -> None:
    """ModernBERT, Qwen, Gemma, Mistral configs list one attention type per layer; it must follow the pruning."""
    student = SentenceTransformer(str(tiny_models["student"]), device="cpu")
    config = student[0].auto_model.config
    config.layer_types = ["full", "sliding", "sliding", "full_last"]
    assert prune_layers(student, 2) == [0, 3]
    assert config.layer_types == ["full", "full_last"]
    assert config.num_hidden_layers == 2
