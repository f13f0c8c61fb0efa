"""The exported student's ONNX forms: the same vectors as PyTorch's, a runtime without torch, a form below the
quality line said and never recommended, `distill.evaluate --backend onnx`."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from sentence_transformers import SentenceTransformer
from test_export import projected_model

from conftest import sentences
from distill.evaluate import main as evaluate
from distill.runtime import ONNX_FILE, OnnxEncoder, pool
from distill.stages import forms
from distill.stages.cost import CostTexts
from distill.stages.export import deployable_model, export_models
from distill.stages.forms import INT8_FILE, measure_forms
from distill.stages.tradeoff import QUALITY_LINE, cost_table, forms_sentence, recommended
from distill.students.head import DistillationModel

pytest.importorskip("onnxruntime")


def exported_with_forms(model: DistillationModel, tmp_path: Path) -> Path:
    """The model exported as the run exports it, with both ONNX forms in its folder."""
    deployable = deployable_model(model)
    staging = tmp_path / "forms"
    forms.export_onnx(deployable, deployable[0].auto_model, staging)
    written = export_models(accelerator(), model, tmp_path / "artifacts", {}, "table", None, None, staging)
    return Path(written["model"])


def accelerator():
    from accelerate import Accelerator

    return Accelerator(cpu=True)


@pytest.mark.parametrize("projection", [True, False], ids=["projection", "matryoshka"])
def test_each_form_gives_the_pytorch_vectors_within_tolerance(tiny_models, tmp_path, projection):
    """float32: 1e-5 of PyTorch's vectors; int8: cosine 0.99 with them (the tiny random BERT; the demo's student
    keeps 99.5% of its nDCG@10 in int8, docs/BENCHMARKS.md). Texts of every length, one over max_seq_length."""
    student = SentenceTransformer(str(tiny_models["student"]), device="cpu")
    model = projected_model(tiny_models) if projection else DistillationModel(student, None)
    folder = exported_with_forms(model, tmp_path)
    assert (folder / ONNX_FILE).is_file() and (folder / INT8_FILE).is_file()
    texts = [*sentences(20, seed=9), "x", " ".join(["long"] * 400)]
    reference = SentenceTransformer(str(folder), device="cpu").encode(texts, convert_to_numpy=True)
    vectors = OnnxEncoder(folder).encode(texts, batch_size=4)
    assert vectors.shape == reference.shape
    assert np.abs(vectors - reference).max() < 1e-5
    int8 = OnnxEncoder(folder, INT8_FILE).encode(texts, batch_size=4)
    assert (int8 * reference).sum(axis=1).min() > 0.99


def test_the_runtime_runs_where_torch_cannot_be_imported(tiny_models, tmp_path):
    folder = exported_with_forms(DistillationModel(SentenceTransformer(str(tiny_models["student"])), None), tmp_path)
    expected = OnnxEncoder(folder).encode(["a text", "another one"])
    script = (
        "import sys, json\n"
        "for name in ('torch', 'transformers', 'sentence_transformers', 'optimum'):\n"
        "    sys.modules[name] = None  # any import of them fails\n"
        "from distill.runtime import OnnxEncoder\n"
        f"v = OnnxEncoder({str(folder)!r}).encode(['a text', 'another one'])\n"
        "print(json.dumps(v.tolist()))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert np.allclose(np.array(json.loads(done.stdout)), expected, atol=1e-6)


def test_pooling_matches_sentence_transformers_modes() -> None:
    tokens = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    mask = np.array([[1, 1, 0], [1, 1, 1]])
    assert np.allclose(pool(tokens, mask, "mean")[0], tokens[0, :2].mean(axis=0))
    assert np.allclose(pool(tokens, mask, "cls"), tokens[:, 0])
    assert np.allclose(pool(tokens, mask, "max")[0], tokens[0, 1])
    assert np.allclose(pool(tokens, mask, "lasttoken"), [tokens[0, 1], tokens[1, 2]])
    assert np.allclose(pool(tokens, mask, "mean_sqrt_len_tokens")[0], tokens[0, :2].sum(axis=0) / np.sqrt(2))


def test_the_forms_are_measured_in_a_folder_that_holds_the_deployable_model(tiny_models, tmp_path) -> None:
    """measure_forms, unstubbed: each form timed and scored through the runtime on its own staging folder."""
    from distill.data.containers import EvalSet

    model = DistillationModel(SentenceTransformer(str(tiny_models["student"]), device="cpu"), None)
    deployable = deployable_model(model)
    texts = CostTexts(sentences(16, seed=1), sentences(2, seed=2), 8)
    queries, corpus = sentences(12, seed=3), sentences(12, seed=4)
    evaluation = EvalSet(queries=queries, corpus=corpus, relevant=list(range(12)))
    measured = measure_forms(deployable, deployable[0].auto_model, tmp_path / "f", texts, evaluation, (100.0, 0.5))
    assert [form.name for form in measured] == ["ONNX float32", "ONNX int8"]
    assert all(form.texts_per_second > 0 and form.ndcg is not None and form.file_bytes > 0 for form in measured)
    assert (tmp_path / "f" / "modules.json").is_file() and (tmp_path / "f" / INT8_FILE).is_file()


def test_a_form_below_the_quality_line_is_said_and_not_recommended(tiny_models, tmp_path, monkeypatch, caplog):
    """The int8 form keeps 97% here (stubbed): one warning line, the trade-off line says so, and the recommendation
    is the fastest form above the line."""

    def stub(name, folder, file, texts, evaluation, pytorch):
        share, speed = (0.97, 300.0) if "int8" in name else (1.0, 150.0)
        return forms.FormCost(name, file, 1, speed, 1.0, 0.5 * share, share, speed / 100)

    monkeypatch.setattr(forms, "form_cost", stub)
    model = DistillationModel(SentenceTransformer(str(tiny_models["student"]), device="cpu"), None)
    deployable = deployable_model(model)
    texts = CostTexts(sentences(8, seed=1), sentences(2, seed=2), 4)
    with caplog.at_level(logging.WARNING, logger=forms.__name__):
        measured = measure_forms(deployable, deployable[0].auto_model, tmp_path / "f", texts, None, (100.0, 0.5))
    assert [r.getMessage() for r in caplog.records] == [
        "ONNX int8 keeps 97.0% of the PyTorch student's nDCG@10, below 99%: it is exported but not recommended"
    ]
    as_dicts = forms.forms_to_dict(measured)
    assert recommended(as_dicts)["name"] == "ONNX float32"
    said = forms_sentence({"forms": as_dicts})
    assert "Served as ONNX float32 (`onnx/model.onnx`) it runs at 1.50x" in said
    assert "ONNX int8 keeps 97.0% of its nDCG@10, below 99%: not recommended." in said
    assert recommended([{**f, "share": QUALITY_LINE - 0.001} for f in as_dicts]) is None


def test_the_cost_table_lists_each_form_and_each_index_precision() -> None:
    student = {"dim": 32, "texts_per_second": 100.0, "latency_ms": 2.0, "parameters": 1e6, "weights_bytes": 4e6}
    efficiency = {
        "device": "cpu",
        "batch_size": 8,
        "texts": 16,
        "latency_repeats": 4,
        "student": student,
        "forms": [
            {
                "name": "ONNX int8",
                "file": INT8_FILE,
                "ndcg": 0.5,
                "texts_per_second": 250.0,
                "latency_ms": 1.0,
                "file_bytes": 2e6,
                "share": 0.995,
                "speedup": 2.5,
            }
        ],
    }
    after = {"ndcg@10": 0.5025, "index_ndcg@10": {"int8": 0.5, "binary": 0.45}}
    table = cost_table({"efficiency": efficiency, "student_after": after})
    assert f"| student, ONNX int8 (`{INT8_FILE}`) | 32 | 0.5000 | 250.0 | 1.0 | same | 2.0 |" in table
    assert "| float32 | 128 | 0.5025 |" in table and "| int8 | 32 | 0.5000 |" in table
    assert "| binary | 4 | 0.4500 |" in table


def test_a_folder_without_its_onnx_form_is_one_line(tiny_models) -> None:
    with pytest.raises(Exception, match="expected a sentence-transformers folder with onnx/model.onnx"):
        OnnxEncoder(tiny_models["student"])


def test_evaluate_scores_the_onnx_form_as_pytorch_scores_the_folder(tiny_models, nanobeir_stand_in, tmp_path):
    folder = exported_with_forms(DistillationModel(SentenceTransformer(str(tiny_models["student"])), None), tmp_path)
    scores = {}
    for backend in ("torch", "onnx", f"onnx:{INT8_FILE}"):
        output = tmp_path / f"{backend.replace('/', '_')}.json"
        argv = [str(folder), "--nanobeir", str(nanobeir_stand_in), "--nanobeir_datasets", "scifact", "--backend"]
        assert evaluate([*argv, backend, "--output", str(output)]) == 0
        scores[backend] = json.loads(output.read_text())["nanobeir"]["NanoBEIR_mean_cosine_ndcg@10"]
    assert scores["onnx"] == pytest.approx(scores["torch"], abs=1e-4)
    assert scores[f"onnx:{INT8_FILE}"] == pytest.approx(scores["torch"], abs=0.05)


def test_index_precision_scores_what_an_int8_and_a_binary_index_rank_by() -> None:
    """Bytes per text at each precision; near-copies of the corpus as queries rank their own row first at each;
    a binary index scores only its Hamming shortlist, by the float query against the +-1 bits."""
    from distill.data.containers import EvalSet
    from distill.metrics import RESCORE, TOP_K, binary_scores, index_precision

    rng = np.random.default_rng(0)
    corpus = rng.normal(size=(60, 64)).astype(np.float32)
    queries = corpus + 0.1 * rng.normal(size=corpus.shape).astype(np.float32)
    figures = index_precision(queries, corpus, EvalSet(queries=[""] * 60, corpus=[""] * 60, relevant=list(range(60))))
    assert {k: v["bytes_per_text"] for k, v in figures.items()} == {"float32": 256, "int8": 64, "binary": 8}
    assert all(v["ndcg@10"] > 0.99 for v in figures.values())
    scores = binary_scores(queries[:1], corpus)
    kept = np.isfinite(scores[0])
    assert kept.sum() == TOP_K * RESCORE
    assert np.allclose(scores[0, kept], queries[0] @ np.where(corpus[kept] > 0, 1.0, -1.0).T, atol=1e-4)


def test_asking_for_the_forms_without_the_extra_is_one_line_on_how_to_install_it(monkeypatch) -> None:
    import torch

    from distill.errors import DistillError

    monkeypatch.setattr(forms, "onnx_available", lambda: False)
    with pytest.raises(
        DistillError, match=r"--export_onnx true needs onnx and ONNX Runtime: pip install 'distill\[onnx\]'"
    ):
        forms.wanted("true", torch.device("cpu"))
    assert forms.wanted("auto", torch.device("cpu")) is False  # auto: without the extra, no forms and no error
    monkeypatch.setattr(forms, "onnx_available", lambda: True)
    assert forms.wanted("auto", torch.device("cpu")) is True
    assert forms.wanted("auto", torch.device("cuda")) is False  # never run on a GPU: not on by default there
    assert forms.wanted("false", torch.device("cpu")) is False


def test_only_a_transformer_student_has_an_onnx_form(tiny_models) -> None:
    from distill.students import kind_of

    student = SentenceTransformer(str(tiny_models["student"]), device="cpu")
    assert kind_of(student).onnx_transformer(student) is student[0].auto_model
    static = pytest.importorskip("distill.students.static")
    assert static.StaticKind().onnx_transformer(student) is None  # model2vec's folder is a table's small form


def test_the_forms_folder_a_killed_run_left_goes_at_the_next_run(tmp_path: Path) -> None:
    """A SIGKILL during the forms stage left `.forms-*` (about 120 MB on the demo) under the artifacts folder for
    good. The next run on that machine removes those whose process is gone; a live one's, and another machine's
    (whose pid says nothing here), stay."""
    import os
    import socket

    from distill.stages.forms import staging_folder

    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    host = socket.gethostname()
    dead = tmp_path / f".forms-{host}-{process.pid}-0123abcd"
    live = tmp_path / f".forms-{host}-{os.getpid()}-0123abcd"
    elsewhere = tmp_path / f".forms-other-node-{process.pid}-0123abcd"
    for folder in (dead, live, elsewhere):
        (folder / "onnx").mkdir(parents=True)
    made = staging_folder(str(tmp_path))
    assert not dead.exists() and live.exists() and elsewhere.exists()
    assert made.name.startswith(f".forms-{host}-{os.getpid()}-") and not made.exists()
