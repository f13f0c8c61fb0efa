"""Student kinds beyond the transformer: the static table (distill/students/static.py)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import sentences, tiny_run_flags
from distill.config import load_config
from distill.errors import DistillError
from distill.students import kind_of
from distill.students.static import STATIC, StaticTexts, is_static, load_static_student, one_table, static_table
from distill.train import main

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def static_student(tiny_models, tmp_path_factory):
    """The tiny teacher's token vectors, distilled by model2vec to 16 dimensions."""
    cache = tmp_path_factory.mktemp("static-cache")
    return load_static_student(f"static:{tiny_models['teacher']}", None, 16, cache)


def test_a_static_student_is_a_table_and_a_normalize(static_student) -> None:
    assert kind_of(static_student) is STATIC and kind_of(static_student).texts(static_student) is StaticTexts
    assert [type(m).__name__ for m in static_student] == ["StaticEmbedding", "Normalize"]
    assert static_student.get_sentence_embedding_dimension() == 16
    assert static_student[0].embedding.weight.dtype == torch.float32  # trained in float32, whatever model2vec kept
    assert is_static("static") and is_static("static:org/model") and not is_static("org/model")


def test_static_batches_are_model2vecs_tokens_and_give_encodes_vectors(static_student) -> None:
    """Flat ids and offsets, model2vec's tokens (no special tokens, unknown ones dropped): the forward pass is
    `encode`'s mean of the token vectors, normalised."""
    from model2vec import StaticModel

    texts = sentences(9, seed=3)
    tokens = StaticTexts(static_student.tokenizer, texts)
    table = static_student[0].embedding.weight.detach().numpy()
    reference = StaticModel(vectors=table, tokenizer=static_student.tokenizer, normalize=True, max_length=None)
    assert [list(tokens.ids[tokens.offsets[i] : tokens.offsets[i + 1]]) for i in range(9)] == reference.tokenize(texts)
    features = tokens.features([4, 0, 7])
    assert set(features) == {"input_ids", "offsets"} and features["offsets"][0] == 0
    with torch.no_grad():
        vectors = static_student(features)["sentence_embedding"].numpy()
    np.testing.assert_allclose(vectors, reference.encode([texts[4], texts[0], texts[7]]), atol=1e-6)


def test_token_vectors_split_over_processes_give_model2vecs_own_table(tiny_models, tmp_path, monkeypatch) -> None:
    """Two processes' shares of the vocabulary, in files of 16 tokens, make the table model2vec's `distill` makes
    in one go; a later run with every file kept builds it again without loading the model."""
    from model2vec.distill import distill

    from distill.students import static

    monkeypatch.setattr(static, "TOKEN_CHUNK", 16)
    teacher = str(tiny_models["teacher"])
    tokens = tmp_path / f"static-{static.model_fingerprint(teacher)[:16]}-tokens"
    static.token_vectors(teacher, tokens, static.Distilling(share=(1, 2)))  # the second process: files 1, 3, 5, ...
    second = sorted(p.name for p in tokens.glob("*.npy"))
    assert second and all(int(name[:5]) % 2 == 1 for name in second)
    waits = []
    ours = static.distilled_embedding(
        teacher, 16, tmp_path, static.Distilling(share=(0, 2), wait=lambda: waits.append(1))
    )
    assert len(waits) == 2  # the first process computes files 0, 2, 4, ..., waits, builds the table, waits
    reference = distill(teacher, pca_dims=16)
    assert ours.tokenizer.get_vocab() == reference.tokenizer.get_vocab()
    np.testing.assert_allclose(
        ours.embedding.weight.detach().numpy(), np.asarray(reference.embedding, np.float32), atol=1e-3
    )

    shutil.rmtree(next(tmp_path.glob("static-*-16")))  # the table gone, the token files kept

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded again")

    monkeypatch.setattr("transformers.AutoModel.from_pretrained", no_model)
    again = static.distilled_embedding(teacher, 16, tmp_path)
    np.testing.assert_array_equal(again.embedding.weight.detach().numpy(), ours.embedding.weight.detach().numpy())


def test_surface_forms_are_the_texts_the_tokens_stand_for() -> None:
    from tokenizers import Tokenizer, decoders
    from tokenizers.models import BPE, WordPiece

    from distill.students.static import surface_forms

    pieces = Tokenizer(WordPiece({"[UNK]": 0, "run": 1, "##ing": 2, "##": 3}, unk_token="[UNK]"))
    pieces.decoder = decoders.WordPiece()
    assert surface_forms(pieces, ["run", "##ing", "##", "[UNK]"]) == ["run", "ing", "##", "[UNK]"]
    byte_level = Tokenizer(BPE({"Ġthe": 0, "the": 1, "Ġ": 2}, []))
    byte_level.decoder = decoders.ByteLevel()
    assert surface_forms(byte_level, ["Ġthe", "the", "Ġ"]) == ["the", "the", "Ġ"]
    metaspace = Tokenizer(BPE({"▁the": 0}, []))
    metaspace.decoder = decoders.Metaspace()
    assert surface_forms(metaspace, ["▁the"]) == ["the"]


def test_a_named_tokenizers_vocabulary_is_run_through_the_model_as_text(tiny_models, tmp_path) -> None:
    """A byte-level BPE tokenizer's tokens become the table's rows; its word 'Ġriver' gets the row the model's own
    distillation gives 'river', and the table tokenizes as the named tokenizer does."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE
    from tokenizers.trainers import BpeTrainer
    from transformers import PreTrainedTokenizerFast

    from distill.students import static

    bpe = Tokenizer(BPE(unk_token=None))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    bpe.decoder = decoders.ByteLevel()
    trainer = BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    bpe.train_from_iterator(sentences(200, seed=3), trainer)
    named = tmp_path / "bpe"
    PreTrainedTokenizerFast(tokenizer_object=bpe).save_pretrained(str(named))
    teacher = str(tiny_models["teacher"])

    own_model, own = static.token_vectors(teacher, tmp_path / "own")
    bpe_model, through = static.token_vectors(teacher, tmp_path / "through", static.Distilling(tokenizer=str(named)))
    own_rows, bpe_rows = own_model.sorted_vocabulary, bpe_model.sorted_vocabulary
    assert "Ġriver" in bpe_rows and len(through()) == len(bpe_rows) != len(own_rows)
    np.testing.assert_allclose(
        through()[bpe_rows.index("Ġriver")], own()[own_rows.index("river")], rtol=1e-5, atol=1e-6
    )
    student = load_static_student(
        f"static:{teacher}", None, 16, tmp_path / "cache", static.Distilling(tokenizer=str(named))
    )
    text = "the river and the king"
    assert student.tokenizer.encode(text).tokens == bpe.encode(text).tokens
    assert student.encode([text]).shape == (1, 16)


def test_static_table_folds_the_linear_modules_after_it(static_student) -> None:
    from distill.students.head import add_rotation

    rotation = torch.linalg.qr(torch.randn(16, 16, generator=torch.Generator().manual_seed(0)))[0]
    add_rotation(static_student, rotation)
    try:
        texts = sentences(5, seed=8)
        table = static_table(static_student).numpy()
        tokens = StaticTexts(static_student.tokenizer, texts)
        means = np.stack([table[tokens.ids[tokens.offsets[i] : tokens.offsets[i + 1]]].mean(axis=0) for i in range(5)])
        means /= np.linalg.norm(means, axis=1, keepdims=True)
        np.testing.assert_allclose(static_student.encode(texts), means, atol=1e-5)
        # what users get: that table and a Normalize, the same vectors, a text with an unknown token ('☃') too
        folded = one_table(static_student)
        assert [type(m).__name__ for m in folded] == ["StaticEmbedding", "Normalize"]
        texts.append("the river ☃ and the king")
        np.testing.assert_allclose(folded.encode(texts), static_student.encode(texts), atol=1e-6)
    finally:
        del static_student._modules[next(k for k, m in static_student._modules.items() if type(m).__name__ == "Dense")]


def test_a_bias_after_the_tables_normalize_does_not_fold(static_student, tmp_path) -> None:
    """normalize(mean E) W + b is no mean of one table: the export refuses it, and the projection a table gets
    when it is wider than its teacher has no bias."""
    from sentence_transformers import SentenceTransformer

    from distill.students.head import least_squares_projection, linear_dense

    x, y = torch.randn(64, 16), torch.randn(64, 8)
    assert least_squares_projection(x, y, bias=False).linear.bias is None
    biased = SentenceTransformer(modules=[*static_student, linear_dense(torch.eye(16), torch.ones(16))])
    with pytest.raises(DistillError, match="has a bias after a Normalize"):
        static_table(biased)
    folder = tmp_path / "biased"
    biased.save(str(folder))
    with pytest.raises(DistillError, match="start from a static folder whose modules"):  # at once, not at export
        load_static_student(str(folder), None, None, tmp_path / "cache")


def static_run_flags(tiny_models, tiny_data, out: Path, **options) -> list[str]:
    """A tiny run of a 16-d static table distilled from the tiny teacher, exported."""
    static = {"student_model": f"static:{tiny_models['teacher']}", "student_dim": 16, "use_projection": False}
    return tiny_run_flags(tiny_models, tiny_data, out, **static, phase1_lr=1e-2, save_to_artifacts=True, **options)


def test_a_static_run_exports_folders_that_both_libraries_load_alike(tiny_models, tiny_data, tmp_path) -> None:
    from model2vec import StaticModel
    from sentence_transformers import SentenceTransformer

    out = tmp_path / "static"
    flags = static_run_flags(tiny_models, tiny_data, out, efficiency_texts=16)
    assert main(flags) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["student_after"]["teacher_cosine"] > results["student_before"]["teacher_cosine"]
    efficiency = results["efficiency"]
    assert efficiency["ratios"]["parameters"] < 1
    # timed a second time as model2vec encodes it, with the same width, table and batch
    as_model2vec = efficiency["student_model2vec"]
    assert as_model2vec["dim"] == efficiency["student"]["dim"] == 16 and as_model2vec["texts_per_second"] > 0
    table = StaticModel.from_pretrained(str(out / "artifacts" / "model2vec"), force_download=False).embedding
    assert (as_model2vec["parameters"], as_model2vec["weights_bytes"]) == (table.size, table.nbytes)
    assert efficiency["ratios"]["throughput_model2vec"] > 0
    assert "x through model2vec)" in (out / "report.md").read_text()
    assert set(results["exported"]) == {"model", "model2vec"}
    modules = json.loads((out / "artifacts" / "model" / "modules.json").read_text())
    assert [m["type"].rsplit(".", 1)[1] for m in modules] == ["StaticEmbedding", "Normalize"]  # the rotation folded in
    exported = StaticModel.from_pretrained(str(out / "artifacts" / "model2vec"), force_download=False)
    long = " ".join(sentences(150, seed=32))  # past model2vec's default limit of 512 tokens: neither export truncates
    assert len(exported.tokenize([long])[0]) > 512
    texts = [*sentences(12, seed=31), "the river ☃ and the king", "☃", long]  # '☃' is the tokenizer's [UNK]
    from_st = SentenceTransformer(str(out / "artifacts" / "model"), device="cpu").encode(texts)
    from_model2vec = exported.encode(texts)
    np.testing.assert_allclose(from_st[:-1], from_model2vec[:-1], atol=1e-6)  # float32 precision
    np.testing.assert_allclose(from_st[-1], from_model2vec[-1], atol=1e-5)  # float32 sums of 1,500 tokens, two orders
    card = (out / "artifacts" / "model2vec" / "README.md").read_text()
    assert "model2vec model" in card and "## Distillation" in card


def test_a_static_student_wider_than_its_teacher_exports_its_projection_folded_in(tiny_models, tiny_data, tmp_path):
    """Projection mode, 64 dims into the teacher's 48: a least-squares projection without a bias, after the table's
    Normalize, folds into the table; both folders answer in the teacher's space, alike."""
    from model2vec import StaticModel
    from sentence_transformers import SentenceTransformer

    out = tmp_path / "projected"
    flags = static_run_flags(tiny_models, tiny_data, out, efficiency_texts=16)
    flags[flags.index("--student_dim") + 1], flags[flags.index("--use_projection") + 1] = "64", "True"
    assert main(flags) == 0
    texts = [*sentences(12, seed=33), "the river ☃ and the king"]
    model = SentenceTransformer(str(out / "artifacts" / "model"), device="cpu")
    assert [type(m).__name__ for m in model] == ["StaticEmbedding", "Normalize"]
    from_st = model.encode(texts)
    as_model2vec = StaticModel.from_pretrained(str(out / "artifacts" / "model2vec"), force_download=False)
    from_model2vec = as_model2vec.encode(texts)
    assert from_st.shape == (13, 48)
    np.testing.assert_allclose(from_st, from_model2vec, atol=1e-6)


@pytest.mark.multiprocess
def test_two_processes_distil_the_table_together_and_train_as_one_with_twice_the_batch(
    tiny_models, tiny_data, tmp_path
) -> None:
    """Two processes distil the table (a cold cache of their own; each takes its share of the token-vector files,
    then waits for the other) as one process does; their static student then follows one process at twice the
    batch, both phases."""
    from safetensors.torch import load_file

    runs = {}
    for processes, batch in ((2, 4), (1, 8)):
        out = tmp_path / f"p{processes}"
        flags = static_run_flags(
            tiny_models, tiny_data, out, batch_size=batch, teacher_cache_dir=tmp_path / f"cache{processes}"
        )
        command = [sys.executable, "-m", "distill.train", "--num_processes", str(processes), *flags]
        done = subprocess.run(
            command,
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=600,
            env=dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false"),
        )
        assert done.returncode == 0, done.stderr[-4000:]
        runs[processes] = out
    tables = [load_file(str(next((tmp_path / f"cache{p}").glob("static-*-16")) / "model.safetensors")) for p in (2, 1)]
    assert tables[0].keys() == tables[1].keys() and all(torch.equal(tables[0][k], tables[1][k]) for k in tables[0])
    results = [json.loads((runs[p] / "results.json").read_text()) for p in (2, 1)]
    assert [r["world_size"] for r in results] == [2, 1]
    for phase in ("phase1", "phase2"):
        two, one = (r["phases"][phase]["losses"] for r in results)
        assert len(two) == len(one) > 0 and two == pytest.approx(one, abs=1e-4), phase
    weights = [load_file(str(runs[p] / "artifacts" / "model" / "model.safetensors")) for p in (2, 1)]
    for key in weights[1]:
        torch.testing.assert_close(weights[0][key], weights[1][key], atol=1e-4, rtol=1e-3)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--student_dim", "64"],
            r"student_dim: applies only to a static student; pass --student_model static or drop --student_dim",
        ),
        (
            ["--student_model", "static", "--student_num_layers", "3"],
            r"student_num_layers: applies only to a transformer student; pass a transformer's name to --student_model",
        ),
        (
            ["--student_model", "static", "--gradient_checkpointing"],
            r"gradient_checkpointing: applies only to a transformer student",
        ),
        (
            ["--student_tokenizer", "bert-base-uncased"],
            r"student_tokenizer: applies only to a static student; pass --student_model static or drop",
        ),
    ],
)
def test_a_static_students_settings_that_do_not_apply_are_refused(argv: list[str], message: str) -> None:
    with pytest.raises(DistillError, match=message):
        load_config(["--teacher_model", "t", *argv])


def test_a_model2vec_folder_keeps_its_table_refuses_what_would_change_it_and_its_card_says_what_was_done(
    static_student, tiny_models, tiny_data, tmp_path
) -> None:
    """A table read from a folder keeps its width and vocabulary: --student_dim and --student_tokenizer are refused
    with a hint that works, --student_num_layers as for any table; the run's card claims no cut layers."""
    from distill.students.static import save_model2vec

    folder = tmp_path / "table"
    save_model2vec(static_student, folder, "a table")
    named = ["--teacher_model", "t", "--student_model", str(folder)]
    with pytest.raises(
        DistillError,
        match=r"^student_dim: applies only to a static table distilled here .*"
        r"pass --student_model static or static:<model> to distil one or drop --student_dim$",
    ):
        load_config([*named, "--student_dim", "8"])
    with pytest.raises(DistillError, match=r"^student_tokenizer: applies only to a static table distilled here"):
        load_config([*named, "--student_tokenizer", str(tiny_models["teacher"])])
    with pytest.raises(DistillError, match=r"^student_num_layers: applies only to a transformer student; [^;]*$"):
        load_config([*named, "--student_num_layers", "3"])
    out = tmp_path / "from-folder"
    table = {"student_model": folder, "use_projection": False, "save_to_artifacts": True, "skip_phase2": True}
    assert main(tiny_run_flags(tiny_models, tiny_data, out, **table)) == 0
    card = (out / "artifacts" / "model" / "README.md").read_text()
    assert f"into `{folder}` (16-d" in card and "layers" not in card.split("## Distillation")[1].split("###")[0]


def test_static_needs_a_model_to_distil_when_the_teacher_is_not_one(tmp_path: Path) -> None:
    with pytest.raises(
        DistillError, match=r"^student_model static distils the teacher's token vectors, .* static:<model>"
    ):
        load_static_student("static", "openai/text-embedding-3-small", 16, tmp_path)


def tiny_mpnet(seed: int = 0):
    from transformers import MPNetConfig, MPNetModel

    torch.manual_seed(seed)
    config = MPNetConfig(
        vocab_size=120,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=80,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return MPNetModel(config)


@pytest.mark.parametrize("training", [False, True])
def test_fused_mpnet_attention_equals_the_eager_forward_and_backward(training):
    """fp32 on a CPU: hidden states and every gradient (the relative position bias's included) within 1e-5, with
    padding in the batch and texts longer than the exact position buckets."""
    from distill.students.attention import use_fused_attention

    eager, fused = tiny_mpnet(), tiny_mpnet()
    assert use_fused_attention(fused) == 1 and use_fused_attention(fused) == 0  # once only
    lengths = torch.tensor([60, 37, 5, 60])
    ids = torch.randint(3, 120, (4, 60))
    mask = (torch.arange(60)[None, :] < lengths[:, None]).long()
    ids = torch.where(mask.bool(), ids, 1)
    outputs = []
    for model in (eager, fused):
        model.train(training)
        hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state
        weights = torch.randn(hidden.shape, generator=torch.Generator().manual_seed(3)) * mask[..., None]
        (hidden * weights).sum().backward()  # linear in the states: a sum of squares would cancel in LayerNorm
        outputs.append((hidden.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    (eager_hidden, eager_grads), (fused_hidden, fused_grads) = outputs
    real = mask.bool()
    assert (eager_hidden[real] - fused_hidden[real]).abs().max() < 1e-5
    assert eager_grads.keys() == fused_grads.keys() and "encoder.relative_attention_bias.weight" in fused_grads
    for name, grad in eager_grads.items():
        if name.endswith("k.bias"):  # a softmax ignores it (it shifts a query's scores alike): its gradient is rounding
            continue
        assert (grad - fused_grads[name]).norm() <= 1e-5 * grad.norm(), name


def test_a_fused_mpnet_student_saves_and_loads_as_plain_mpnet(tmp_path):
    """The switch touches forward methods only: the saved folder loads in plain transformers, same weights."""
    from transformers import AutoModel

    from distill.students.attention import use_fused_attention

    model = tiny_mpnet()
    use_fused_attention(model)
    model.save_pretrained(tmp_path / "m")
    loaded = AutoModel.from_pretrained(tmp_path / "m")
    assert type(loaded.encoder.forward).__name__ == "method"  # transformers' own forward
    ids = torch.randint(3, 120, (2, 9))
    with torch.no_grad():
        assert torch.allclose(
            model(input_ids=ids).last_hidden_state, loaded(input_ids=ids).last_hidden_state, atol=1e-5
        )


def test_unpadded_batches_equal_padded_ones_forward_and_backward(tiny_models, tmp_path):
    """A BERT student on its batch's texts end to end (FlatTexts, each text attending to itself) gives the padded
    batch's sentence vectors and gradients within float32 rounding; padded batches still work after the switch, and
    the saved folder names no custom attention."""
    from distill.batching import FlatTexts, TokenizedTexts
    from distill.students.attention import use_unpadded_batches
    from distill.students.transformer import load_student

    texts = sentences(12, seed=3)
    padded_student = load_student(str(tiny_models["student"]), attention_dropout=0.0)
    flat_student = load_student(str(tiny_models["student"]), attention_dropout=0.0)
    assert use_unpadded_batches(flat_student) and kind_of(flat_student).texts(flat_student) is not TokenizedTexts
    padded = TokenizedTexts(padded_student.tokenizer, texts, 32)
    flat = kind_of(flat_student).texts(flat_student)(flat_student.tokenizer, texts, 32)
    assert isinstance(flat, FlatTexts) and flat.lengths.min() < flat.lengths.max()  # the batch has padding to drop
    rows = list(range(len(texts)))
    features = flat.features(rows)
    assert features["input_ids"].shape == (1, int(flat.lengths.sum())) == (1, int(features["cu_seq_lens_q"][-1]))
    outputs = []
    for student, batch in ((padded_student, padded.features(rows)), (flat_student, features)):
        student.train()
        vectors = student(dict(batch))["sentence_embedding"]
        weights = torch.randn(vectors.shape, generator=torch.Generator().manual_seed(0))
        (vectors * weights).sum().backward()
        outputs.append((vectors.detach(), {n: p.grad for n, p in student.named_parameters() if p.grad is not None}))
    (padded_vectors, padded_grads), (flat_vectors, flat_grads) = outputs
    assert (padded_vectors - flat_vectors).abs().max() < 1e-5
    assert padded_grads.keys() == flat_grads.keys()
    for name, grad in padded_grads.items():
        if name.endswith("key.bias"):  # a softmax ignores it: its gradient is rounding
            continue
        assert (grad - flat_grads[name]).norm() <= 1e-5 * grad.norm(), name
    with torch.no_grad():  # a padded batch through the switched student: transformers' SDPA path, as before
        again = flat_student.eval()(dict(padded.features(rows)))["sentence_embedding"]
        plain = padded_student.eval()(dict(padded.features(rows)))["sentence_embedding"]
    assert (again - plain).abs().max() < 1e-5
    from sentence_transformers import SentenceTransformer

    flat_student.save(str(tmp_path / "saved"))
    assert "distill" not in (tmp_path / "saved" / "config.json").read_text()
    assert SentenceTransformer(str(tmp_path / "saved"), device="cpu").encode(texts[:2]).shape == (2, 32)


def test_a_run_on_unpadded_batches_follows_the_padded_run(tiny_models, tiny_data, tmp_path, monkeypatch):
    """Both phases, evaluation and export with the student switched to unpadded batches (on a CPU the switch is off,
    so it is forced here): every loss and the exported weights follow the padded run's."""
    from safetensors.torch import load_file

    import distill.students.transformer
    from distill.batching import FlatTexts
    from distill.students.attention import use_unpadded_batches
    from tests.conftest import reset_accelerate

    def run(out: Path) -> dict:
        reset_accelerate()
        flags = tiny_run_flags(
            tiny_models, tiny_data, out, teacher_cache_dir=tmp_path / "cache", save_to_artifacts=True
        )
        assert main(flags) == 0
        return json.loads((out / "results.json").read_text())

    padded = run(tmp_path / "padded")
    load_student = distill.students.transformer.load_student

    def unpadded(*args, **kwargs):
        student = load_student(*args, **kwargs)
        assert use_unpadded_batches(student)
        return student

    monkeypatch.setattr(distill.students.transformer, "load_student", unpadded)
    batches = []
    features = FlatTexts.features
    monkeypatch.setattr(FlatTexts, "features", lambda self, rows: batches.append(rows) or features(self, rows))
    flat = run(tmp_path / "flat")
    assert len(batches) > 20 + 20  # the training batches of both phases, and the evaluations
    for phase in ("phase1", "phase2"):
        # relative: phase 2's label loss (scale 20, weight 4) makes its losses about 10, at float32 rounding 5e-5
        assert flat["phases"][phase]["losses"] == pytest.approx(padded["phases"][phase]["losses"], rel=1e-4, abs=1e-4)
    assert flat["student_after"]["ndcg@10"] == pytest.approx(padded["student_after"]["ndcg@10"], abs=1e-3)
    weights = [
        load_file(str(out / "artifacts" / "model" / "model.safetensors"))
        for out in (tmp_path / "padded", tmp_path / "flat")
    ]
    moved = max((weights[0][k] - weights[1][k]).abs().max().item() for k in weights[0])
    assert moved < 1e-3


def tiny_backbone(tiny_models, **config_fields):
    """The tiny BERT student's transformers model, with `config_fields` set on its config."""
    from distill.students.transformer import load_student

    backbone = load_student(str(tiny_models["student"]))[0].auto_model
    for name, value in config_fields.items():
        setattr(backbone.config, name, value)
    return backbone


# Each case changes one condition of a run the variable-length kernel serves (a BERT student, a CUDA GPU of
# compute capability 9.0, bf16 autocast, a torch with the varlen module) and names the reason it then gives.
UNPADDED_RUN = dict(device_type="cuda", mixed_precision="bf16", capability=(9, 0), has_varlen=True)
PADDED_CASES = {
    "no GPU": (dict(device_type="cpu"), "runs on CUDA GPUs, not on cpu"),
    "fp32": (dict(mixed_precision="no"), "takes bf16 or fp16; pass --mixed_precision bf16"),
    "a T4": (dict(capability=(7, 5)), "needs compute capability 8.0+, this GPU has 7.5"),
    "a torch without varlen_attn(scale=)": (
        dict(has_varlen=False),
        "has no torch.nn.attention.varlen.varlen_attn taking scale",
    ),
}


def test_the_attention_decision_is_unpadded_only_where_every_condition_holds(tiny_models):
    from distill.students.attention import attention_path

    backbone = tiny_backbone(tiny_models)
    assert attention_path(backbone, **UNPADDED_RUN).unpadded
    assert attention_path(backbone, **{**UNPADDED_RUN, "mixed_precision": "fp16", "capability": (8, 0)}).unpadded
    for case, (change, reason) in PADDED_CASES.items():
        path = attention_path(backbone, **{**UNPADDED_RUN, **change})
        assert not path.unpadded and reason in path.reason, case


def test_the_attention_decision_keeps_windowed_and_unsupported_models_padded(tiny_models):
    """ModernBERT's local layers (layer_types) or a sliding window would attend globally in the kernel; MPNet takes
    no attention function; a static table has no backbone."""
    from distill.students.attention import attention_path

    windowed = tiny_backbone(tiny_models, layer_types=["full_attention", "sliding_attention"])
    assert "windowed" in attention_path(windowed, **UNPADDED_RUN).reason
    assert not attention_path(tiny_backbone(tiny_models, sliding_window=64), **UNPADDED_RUN).unpadded
    assert attention_path(tiny_backbone(tiny_models, layer_types=["full_attention"] * 4), **UNPADDED_RUN).unpadded
    assert "takes no attention function" in attention_path(tiny_mpnet(), **UNPADDED_RUN).reason
    assert attention_path(None, **UNPADDED_RUN).reason == "the student is no transformer encoder"


def test_choose_attention_switches_the_student_only_when_the_decision_says_so(tiny_models, monkeypatch):
    """On this CPU the student stays padded; with a capable GPU faked, it is switched to unpadded batches and
    the decision is kept on it for results.json."""
    from distill.batching import FlatTexts, TokenizedTexts
    from distill.students import attention
    from distill.students.transformer import load_student

    student = load_student(str(tiny_models["student"]))
    path = attention.choose_attention(student, torch.device("cpu"), "bf16")
    assert not path.unpadded and kind_of(student).texts(student) is TokenizedTexts and student.attention_path == path
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(attention, "has_varlen", lambda: True)
    assert not attention.choose_attention(student, torch.device("cuda"), "no").unpadded
    path = attention.choose_attention(student, torch.device("cuda"), "bf16")
    assert path.unpadded and student.attention_path.to_dict() == {"unpadded": True, "reason": path.reason}
    assert kind_of(student).texts(student).func is FlatTexts


def test_has_varlen_reads_the_installed_torchs_signature(monkeypatch):
    """torch 2.9's varlen_attn takes no `scale`, which the unpadded attention passes: that torch counts as none."""
    import inspect
    import types

    from distill.students.attention import has_varlen

    major, minor = (int(part) for part in torch.__version__.split(".")[:2])
    if (major, minor) >= (2, 9):
        from torch.nn.attention.varlen import varlen_attn

        assert has_varlen() == ("scale" in inspect.signature(varlen_attn).parameters)

    def torch_2_9(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None): ...

    monkeypatch.setitem(sys.modules, "torch.nn.attention.varlen", types.SimpleNamespace(varlen_attn=torch_2_9))
    assert not has_varlen()
    monkeypatch.setitem(sys.modules, "torch.nn.attention.varlen", None)  # no such module: torch before 2.9
    assert not has_varlen()
