"""The static student: a model2vec table (distill/students/static.py), distilled here, trained and exported."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import sentences, tiny_run_flags
from distill.cache import prune
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
    second = sorted(p.name for p in tokens.iterdir())
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

    # a run that loads the kept table marks it used, which is what `python -m distill.cache prune --unused_days`
    # goes by; the token files, read only to build a table, age from that build
    table = next(tmp_path.glob("static-*-16"))
    month_ago = time.time() - 40 * 86400
    for path in [table, *table.rglob("*"), *tokens.rglob("*")]:
        os.utime(path, (month_ago, month_ago))
    static.distilled_embedding(teacher, 16, tmp_path)
    old = [line.split()[2] for line in prune(tmp_path, unused_days=30, dry_run=True)[:-1]]
    assert old and str(table) not in old and all(Path(path).parent == tokens for path in old)


def test_a_torn_file_of_token_vectors_is_computed_again(tiny_models, tmp_path, monkeypatch, caplog) -> None:
    """The token vectors are kept in sealed folders: one cut short (a crash, a full disk) is found by its checksum
    list, said in one line and computed again, and the table is the same."""
    from distill.students import static

    monkeypatch.setattr(static, "TOKEN_CHUNK", 16)
    teacher, folder = str(tiny_models["teacher"]), tmp_path / "tokens"
    whole = static.token_vectors(teacher, folder)[1]()
    torn = sorted(folder.iterdir())[1] / static.TOKEN_VECTORS
    torn.write_bytes(torn.read_bytes()[:200])
    np.testing.assert_array_equal(static.token_vectors(teacher, folder)[1](), whole)
    assert f"static token vectors {torn.parent} are torn (vectors.npy: 200 bytes" in caplog.text


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
        if processes == 1:  # in this process, as a user's one-process run
            assert main(flags) == 0
        else:
            command = [sys.executable, "-m", "distill.train", "--num_processes", str(processes), *flags]
            env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
            done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600, env=env)
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
