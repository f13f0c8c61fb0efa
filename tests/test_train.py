"""End-to-end runs: tiny models in-process, the shipped MiniLM on the embedded data, and multi-process runs."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from accelerate import PartialState
from safetensors.torch import load_file
from sentence_transformers import SentenceTransformer
from sentence_transformers.sentence_transformer.evaluation import (
    EmbeddingSimilarityEvaluator,
    InformationRetrievalEvaluator,
)

from conftest import build_tiny_decoder, reset_accelerate, shared_folder, tiny_run_flags
from distill.allocator import find_tcmalloc, heap_allocator
from distill.config import load_config
from distill.data import load_data
from distill.errors import DistillError
from distill.stages.tradeoff import trade_off_line
from distill.train import main

REPO = Path(__file__).resolve().parents[1]
TIMED = ("texts_per_second", "latency_ms", "machine_gflops")  # the cost stage's timings, which differ run to run


def results_of(out: Path) -> dict:
    return json.loads((out / "results.json").read_text())


def launch(args: list[str], timeout: int = 600, **env: str) -> subprocess.CompletedProcess:
    """Run a command from the repo root with the test environment; fail with its output if it fails."""
    full_env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", **env)
    done = subprocess.run(args, cwd=REPO, env=full_env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    return done


def exported_weights(out: Path) -> dict[str, torch.Tensor]:
    weights = load_file(str(out / "artifacts" / "model" / "model.safetensors"))
    dense = out / "artifacts" / "model" / "3_Dense" / "model.safetensors"
    if dense.is_file():
        weights.update({f"dense.{k}": v for k, v in load_file(str(dense)).items()})
    return weights


def assert_closer_to_the_teacher(results: dict) -> None:
    """Each phase brings the student's vectors closer to the teacher's (mean cosine on the evaluation texts).

    Measured on the tiny models, seeds 7-10, both modes: before 0.964-0.968, phase 1 adds 0.012-0.015 and
    phase 2 another 0.004-0.006; the bounds are half the smallest of those gains.
    """
    before, phase1, after = (
        results[row]["teacher_cosine"] for row in ("student_before", "after_phase1", "student_after")
    )
    assert phase1 > before + 0.006, (before, phase1)
    assert after > phase1 + 0.002, (phase1, after)


class DistinctTextsSimilarityEvaluator(EmbeddingSimilarityEvaluator):
    """sentence-transformers' STS evaluator, encoding each distinct text once: Lee STS pairs 50 news texts into 1,225
    pairs, which the evaluator would encode 2,450 times (25 s of the MiniLM test on one core). The scores and the
    correlation are still the evaluator's own; `embed_inputs` is its hook for how inputs become vectors."""

    def embed_inputs(self, model: SentenceTransformer, sentences, **kwargs) -> np.ndarray:
        distinct = list(dict.fromkeys(sentences))
        vectors = super().embed_inputs(model, distinct, **kwargs)
        row = {text: i for i, text in enumerate(distinct)}
        return vectors[[row[text] for text in sentences]]


def assert_sentence_transformers_evaluators_agree(
    flags: list[str], model: SentenceTransformer, row: dict, matryoshka_dims: tuple[int, ...] = ()
) -> None:
    """results.json's nDCG@10, MRR@10, STS and Matryoshka nDCG@10 equal what sentence-transformers' own evaluators,
    encoding with the exported model on one process, report for it (distill encodes sharded, with its own batches)."""
    config = load_config(flags)
    evaluation = load_data(config.data, config.training.seed).evaluation

    def retrieval(truncate_dim: int | None = None) -> dict[str, float]:
        return InformationRetrievalEvaluator(
            queries=dict(enumerate(evaluation.queries)),
            corpus=dict(enumerate(evaluation.corpus)),
            relevant_docs={i: {row} for i, row in enumerate(evaluation.relevant)},
            mrr_at_k=[10],
            ndcg_at_k=[10],
            write_csv=False,
            truncate_dim=truncate_dim,
        )(model)

    full = retrieval()
    assert row["ndcg@10"] == pytest.approx(full["cosine_ndcg@10"], abs=1e-6)
    assert row["mrr@10"] == pytest.approx(full["cosine_mrr@10"], abs=1e-6)
    for dim in matryoshka_dims:
        assert row["matryoshka_ndcg@10"][str(dim)] == pytest.approx(retrieval(dim)["cosine_ndcg@10"], abs=1e-6), dim
    if not evaluation.sts_pairs:  # STS comes with the embedded set only
        assert "sts_spearman" not in row
        return
    left, right = zip(*evaluation.sts_pairs)
    sts = DistinctTextsSimilarityEvaluator(
        [evaluation.sts_texts[i] for i in left],
        [evaluation.sts_texts[i] for i in right],
        evaluation.sts_scores,
        write_csv=False,
    )(model)
    assert row["sts_spearman"] == pytest.approx(sts["spearman_cosine"], abs=1e-4)


def test_tiny_run_projection_mode_end_to_end(tiny_models, tiny_data, tmp_path, caplog):
    out = tmp_path / "run"
    flags = tiny_run_flags(
        tiny_models,
        tiny_data,
        out,
        save_to_artifacts=True,
        mnrl_weight=0,  # the teacher's terms alone: the test checks the student moves towards the teacher
        efficiency_texts=256,  # the default: the cost stage runs
    )
    assert main(flags) == 0
    results = results_of(out)
    assert results["world_size"] == 1 and results["mode"] == "projection"
    assert "capped" not in results  # no cap given: every text and pair read
    assert results["attention"] == {
        "unpadded": False,
        "reason": "the variable-length kernel runs on CUDA GPUs, not on cpu",
    }
    assert results["heap_allocator"] == heap_allocator()
    if results["heap_allocator"] == "glibc":  # README: a CPU run on glibc logs a line saying so (at a level shown)
        notices = [r for r in caplog.records if "heap allocator: glibc malloc" in r.getMessage()]
        assert notices and notices[0].levelno >= logging.WARNING, caplog.text
    for row in ("teacher", "student_before", "after_phase1", "student_after"):
        assert {"ndcg@10", "mrr@10"} <= set(results[row])
    for phase in ("phase1", "phase2"):
        stats = results["phases"][phase]
        assert stats["train_samples"] > 0 and stats["train_seconds"] > 0 and stats["teacher_seconds"] >= 0
        assert all(np.isfinite(stats["losses"]))
    assert_closer_to_the_teacher(results)
    logged = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO and r.name.startswith("distill")]
    for stage in ("data", "teacher", "student", "evaluation before training", "phase1", "phase2", "cost"):
        assert any(line.endswith(f"] {stage} ...") for line in logged), (stage, logged)
        assert any(re.search(rf"\] {stage}: done in \d+\.\d s$", line) for line in logged), (stage, logged)
    assert any("teacher cache: " in line and "not cached; encoding them into" in line for line in logged)
    assert sum("student attention: padded batches (the variable-length kernel runs on" in line for line in logged) == 1
    assert any(line.endswith(f"exported model: {out / 'artifacts' / 'model'}") for line in logged)
    assert (out / "config.yaml").is_file()
    assert (out / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| ndcg@10 |" in (out / "report.md").read_text()
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert "config" in logged[0] and any("phase2/loss" in line.get("values", {}) for line in logged[1:])
    # The exported model maps into the teacher's 48-d space; the plain student stays 32-d.
    model = SentenceTransformer(str(out / "artifacts" / "model"), device="cpu")
    student = SentenceTransformer(str(out / "artifacts" / "student"), device="cpu")
    vectors = model.encode(["the king of the city", "a river"])
    assert vectors.shape == (2, 48)
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    assert student.encode(["a river"]).shape == (1, 32)
    card = (out / "artifacts" / "model" / "README.md").read_text()
    assert "## Evaluation" in card
    # the cost stage: both models measured on this CPU; the exported folder's size; the same line everywhere
    efficiency = results["efficiency"]
    assert efficiency["student"]["parameters"] == sum(p.numel() for p in model.parameters())
    assert efficiency["student"]["dim"] == 48 and efficiency["teacher"]["dim"] == 48  # projected to the teacher's
    assert efficiency["teacher"]["parameters"] == sum(
        p.numel() for p in SentenceTransformer(str(tiny_models["teacher"]), device="cpu").parameters()
    )
    files = [f for f in (out / "artifacts" / "model").rglob("*") if f.is_file()]
    assert efficiency["exported_bytes"] == sum(f.stat().st_size for f in files)
    assert 0 < efficiency["texts"] <= 256 and efficiency["latency_repeats"] == 16  # max_eval_queries 16
    line = trade_off_line(results)
    assert line and line in card and line in (out / "report.md").read_text()
    assert_sentence_transformers_evaluators_agree(flags, model, results["student_after"])


def test_a_decoder_student_saved_in_bfloat16_trains_and_exports(tiny_models, tiny_data, tmp_path):
    """The Qwen3-Embedding layout (bf16 checkpoint, left padding, last-token pooling), pruned and checkpointed."""
    student = build_tiny_decoder(tmp_path / "decoder")
    out = tmp_path / "run"
    flags = tiny_run_flags(
        tiny_models,
        tiny_data,
        out,
        student_model=student,
        student_num_layers=2,
        mnrl_weight=0,  # the teacher's terms alone: the test checks the student moves towards the teacher
    )
    assert main([*flags, "--gradient_checkpointing", "True", "--save_to_artifacts"]) == 0
    results = results_of(out)
    for phase in ("phase1", "phase2"):
        assert all(np.isfinite(results["phases"][phase]["losses"]))
    assert results["student_after"]["teacher_cosine"] > results["student_before"]["teacher_cosine"] + 0.01
    model = SentenceTransformer(str(out / "artifacts" / "model"), device="cpu")
    assert {parameter.dtype for parameter in model.parameters()} == {torch.float32}
    config = json.loads((out / "artifacts" / "model" / "config.json").read_text())
    assert config["num_hidden_layers"] == 2 and len(config["layer_types"]) == 2
    assert model.tokenizer.padding_side == "left" and model[1].pooling_mode == "lasttoken"
    alone = model.encode(["a river"])
    beside_a_longer_text = model.encode(["a river", "the king of the city was at war with the world"])[:1]
    np.testing.assert_allclose(alone, beside_a_longer_text, atol=1e-5)  # the pooled last token is the real one
    assert alone.shape == (1, 48)


def test_second_run_reuses_the_teacher_cache_without_loading_the_teacher(tiny_models, tiny_data, tmp_path, monkeypatch):
    cache = tmp_path / "shared-cache"
    measured = {"teacher_cache_dir": cache, "efficiency_texts": 256}  # the cold run measures the teacher's cost
    assert main(tiny_run_flags(tiny_models, tiny_data, tmp_path / "a", **measured)) == 0
    cold = results_of(tmp_path / "a")
    assert cold["teacher_loaded"] is True
    assert (
        0
        < cold["teacher_load_seconds"]
        <= sum(p["teacher_seconds"] for p in cold["phases"].values()) + cold["teacher_seconds_evaluation"]
    )

    reset_accelerate()

    def no_teacher(*args, **kwargs):
        raise AssertionError("the teacher was loaded although every embedding was cached")

    monkeypatch.setattr("distill.teachers.local.load_teacher", no_teacher)
    assert main(tiny_run_flags(tiny_models, tiny_data, tmp_path / "b", **measured)) == 0
    warm = results_of(tmp_path / "b")
    assert warm["teacher_loaded"] is False
    assert warm["teacher_load_seconds"] == 0
    assert all(p["teacher_seconds"] == 0 for p in warm["phases"].values())
    assert warm["teacher"] == results_of(tmp_path / "a")["teacher"]
    # the teacher's cost, measured while the cold run had it loaded, is read back from beside the cache
    assert warm["efficiency"]["teacher"] == cold["efficiency"]["teacher"]


def test_matryoshka_mode_trains_truncated_dims(tiny_models, tiny_data, tmp_path, caplog):
    """Also: --push_to_hub offline exports, then fails to upload with one warning; the model and results stay."""
    out = tmp_path / "mrl"
    flags = tiny_run_flags(
        tiny_models,
        tiny_data,
        out,
        use_projection=False,
        matryoshka_dims="32,16,8",
        mnrl_weight=0,  # the teacher's terms alone: the test checks the student moves towards the teacher
    )
    with caplog.at_level(logging.WARNING):
        assert main([*flags, "--push_to_hub", "me/tiny-student"]) == 0  # HF_HUB_OFFLINE=1 (conftest)
    pushes = [r.getMessage() for r in caplog.records if "push to the Hub" in r.getMessage()]
    assert len(pushes) == 1 and "\n" not in pushes[0]
    folder = out / "artifacts" / "model"
    assert "push to the Hub failed (OfflineModeIsEnabled: " in pushes[0]
    assert pushes[0].endswith(f"the model stays in {folder}; retry with: hf upload me/tiny-student {folder} .")
    results = results_of(out)
    assert results["hub"]["repo"] == "me/tiny-student" and results["hub"]["error"].startswith("OfflineModeIsEnabled")
    card = (out / "artifacts" / "model" / "README.md").read_text()
    assert 'SentenceTransformer("me/tiny-student")' in card and "\nmetrics:\n- cosine_ndcg@10\n" in card
    assert results["mode"] == "matryoshka"
    assert set(results["student_after"]["matryoshka_ndcg@10"]) == {"32", "16", "8"}
    assert_closer_to_the_teacher(results)
    assert not (out / "artifacts" / "student").exists()
    model = SentenceTransformer(str(out / "artifacts" / "model"), device="cpu")
    assert model.encode(["a"]).shape == (1, 32)
    # the default PCA basis: the exported student ends with its fixed 32x32 rotation, then Normalize
    assert [type(m).__name__ for m in model][-2:] == ["Dense", "Normalize"]
    rotation = model[len(model) - 2].linear.weight.detach()
    torch.testing.assert_close(rotation @ rotation.T, torch.eye(32), atol=1e-4, rtol=0)
    assert_sentence_transformers_evaluators_agree(flags, model, results["student_after"], matryoshka_dims=(32, 16, 8))


def test_phase1_teacher_model_sets_phase_1s_target_and_leaves_the_teacher_to_phase_2(
    tiny_models, tiny_data, tmp_path, monkeypatch
):
    """The student pruned from its source (4 -> 2 layers) is aligned to the source in phase 1, and learns the teacher's
    similarities in phase 2; each phase reads its targets in its own model's basis; a warm run loads neither model."""
    from distill.phases import Phase
    from distill.stages.targets import TeacherCache

    encoded, bases = [], {}
    embeddings, use_student = TeacherCache.embeddings, Phase.use_student

    def spy_embeddings(self, texts, role):
        encoded.append((Path(self.source.path).parent.name, role, len(texts)))
        return embeddings(self, texts, role)

    def spy_use_student(self, dims, basis):
        bases[self.name] = None if basis is None else basis.shape
        return use_student(self, dims, basis)

    monkeypatch.setattr(TeacherCache, "embeddings", spy_embeddings)
    monkeypatch.setattr(Phase, "use_student", spy_use_student)
    source = tiny_models["student"]
    cache = tmp_path / "cache"
    flags = tiny_run_flags(
        tiny_models,
        tiny_data,
        tmp_path / "cold",
        use_projection=False,
        student_num_layers=2,
        phase1_teacher_model=source,
        teacher_cache_dir=cache,
    )
    assert main([*flags, "--save_to_artifacts"]) == 0
    texts = len((tiny_data["texts"]).read_text().splitlines())
    assert encoded[0] == ("student", "document", texts)  # phase 1's texts, by the source alone
    assert {name for name, _, _ in encoded[1:]} == {"teacher"}  # pairs and evaluation, by the teacher
    assert bases == {"phase1": (32, 32), "phase2": (48, 32)}  # the source's 32-d basis, the teacher's 48-d one
    results = results_of(tmp_path / "cold")
    assert results["teacher_loaded"] is True and results["mode"] == "matryoshka"
    assert results["config"]["phase1_teacher_model"] == str(source)
    model = SentenceTransformer(str(tmp_path / "cold" / "artifacts" / "model"), device="cpu")
    assert model.encode(["a"]).shape == (1, 32)
    card = (tmp_path / "cold" / "artifacts" / "model" / "README.md").read_text()
    assert f"Phase 1 aligned it to `{source}`; phase 2 distilled the teacher's similarities." in card

    reset_accelerate()

    def no_teacher(*args, **kwargs):
        raise AssertionError("a model was loaded although every embedding was cached")

    monkeypatch.setattr("distill.teachers.local.load_teacher", no_teacher)
    warm = tiny_run_flags(
        tiny_models,
        tiny_data,
        tmp_path / "warm",
        use_projection=False,
        student_num_layers=2,
        phase1_teacher_model=source,
        teacher_cache_dir=cache,
        efficiency_texts=0,
    )
    assert main(warm) == 0
    assert results_of(tmp_path / "warm")["teacher_loaded"] is False


def test_bad_input_prints_one_line_and_exits_2(tiny_models, tiny_data, tmp_path, capsys):
    flags = tiny_run_flags(tiny_models, tiny_data, tmp_path / "x", phase1_data=tmp_path / "missing.jsonl")
    assert main(flags) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: data file") and "does not exist" in err[0]
    assert not (tmp_path / "x" / "results.json").exists()


@pytest.mark.slow
def test_shipped_minilm_on_embedded_data_gets_closer_to_the_teacher(tmp_path):
    """The real thing, small: MiniLM-L6 teacher, its 3-layer copy, embedded Wikipedia data, Lee STS."""
    out = tmp_path / "minilm"
    flags = [
        "--config",
        str(REPO / "configs" / "demo.yaml"),
        "--output_dir",
        str(out),
        "--artifacts_dir",
        str(out / "artifacts"),
        "--teacher_cache_dir",
        str(tmp_path / "cache"),
        "--max_samples_phase1",
        "384",
        "--max_samples_phase2",
        "256",
        "--phase2_epochs",
        "1",
        "--max_eval_queries",
        "200",
        "--max_seq_length",  # the evaluation corpus is the 867 passages of the held-out articles, encoded 4 times
        "64",
        "--efficiency_texts",
        "64",
        # sentence-transformers' evaluator must rank as results.json does, exactly (below). A label-trained student
        # of this size has two passages 1.2e-7 apart in a query's top hits, which the two encoders order apart.
        "--mnrl_weight",
        "0",
        "--mine_hard_negatives",  # the pairs alone, as the figures above were measured
        "0",
    ]
    assert main(flags) == 0
    results = results_of(out)
    assert set(results["phases"]) == {"phase1", "phase2"}
    # results.json names the terms that trained each phase and what each phase added
    phases = results["phases"]
    assert phases["phase1"]["terms"] == {"cosine": 1.0, "mse": 1.0}
    assert phases["phase2"]["terms"] == {"cosine": 1.0, "mse": 1.0, "similarity_kl": 1.0}
    for phase, before, after in (
        ("phase1", "student_before", "after_phase1"),
        ("phase2", "after_phase1", "student_after"),
    ):
        gain = results[after]["ndcg@10"] - results[before]["ndcg@10"]
        assert phases[phase]["added"]["ndcg@10"] == pytest.approx(gain, abs=1e-4)
    # Training raises the student's retrieval score. With these flags, over seeds 42, 1 and 2 (each seed holds out
    # its own articles), nDCG@10 rose by 0.0140, 0.0045 and 0.0309 on a 2-core CPU; the margin is below the least.
    assert results["student_after"]["ndcg@10"] >= results["student_before"]["ndcg@10"] + 0.002
    # the student starts rotated onto the teacher's principal axes (Procrustes), and training brings it closer still
    assert results["student_after"]["teacher_cosine"] > results["student_before"]["teacher_cosine"] + 0.03
    matryoshka = results["student_after"]["matryoshka_ndcg@10"]
    assert matryoshka["192"] >= 0.95 * matryoshka["384"]  # the PCA basis keeps half the dimension nearly whole
    assert {"ndcg@10", "sts_spearman"} <= set(results["teacher"]) and results["teacher"]["ndcg@10"] > 0.3
    exported = SentenceTransformer(str(out / "artifacts" / "model"), device="cpu")
    assert len(exported[0].auto_model.encoder.layer) == 3
    # a CPU run with the onnx extra exports the ONNX forms beside the weights, each measured in the run
    efficiency = results["efficiency"]
    assert [form["name"] for form in efficiency["forms"]] == ["ONNX float32", "ONNX int8"]
    assert all((out / "artifacts" / "model" / form["file"]).is_file() for form in efficiency["forms"])
    assert efficiency["forms"][0]["share"] == pytest.approx(1.0, abs=0.002)  # float32: the student's own ranking
    assert set(results["student_after"]["index_ndcg@10"]) == {"int8", "binary"}  # the vectors in an index
    assert not [p for p in (out / "artifacts").iterdir() if p.name.startswith(".forms-")]  # no staging left behind
    # Lee STS comes with the embedded set: results.json's STS is what sentence-transformers' evaluator says
    assert_sentence_transformers_evaluators_agree(flags, exported, results["student_after"])


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("use_projection", "accumulation", "form", "teachers", "budget"),
    [
        (True, 1, "relaunch", "reranker", None),
        (False, 2, "run_ddp.sh", "reranker", None),
        (False, 1, "relaunch", 2, 64),
    ],
    ids=[
        "projection-reranker-relaunch",
        "matryoshka-accumulating-reranker-run_ddp",
        "two-teachers-token-budget-relaunch",
    ],
)
def test_two_processes_match_one_process_with_twice_the_batch(
    tiny_models, tiny_data, tiny_reranker, tmp_path, use_projection, accumulation, form, teachers, budget
):
    """2 processes x batch 4 follow 1 process x batch 8 (losses, weights), both phases, every loss, both modes.

    Three cases cover every feature that crosses processes under both launch forms: each mode with the reranker's
    term (one relaunched, one through run_ddp.sh with accumulation), and two combined teachers under a token budget.

    Phase 2 gathers every process's vectors with their gradient and keeps a cross-batch passage memory; its label
    loss ranks each query's passage among the global batch's (and, with a reranker, their mined negatives); in
    Matryoshka mode the teacher basis computed on the main process reaches every process (two bases: phase 1 aligns
    to another model, `--phase1_teacher_model`, and phase 2 distils the teacher's similarities). The Matryoshka runs
    accumulate 2 batches a step, so DDP's skipped all-reduces, the gathers between them and the memory's one entry
    per step are covered too.

    The two processes start the ways distill starts them itself: `python -m distill.train --num_processes 2`
    (which must not run on one process) and `./run_ddp.sh 2 False` (without a GPU: CPU processes over gloo that
    say so, on tcmalloc when it is installed). With two teachers combined, each member is encoded, cached and scored
    through the collectives of its own cache, inside the combination's. With a reranker, its loss is each process's
    mean over its own queries' candidates, which DDP averages into the global mean. With a token budget, 2 processes
    x 64 tokens follow 1 process x 128: widths padded to 16 or 32 tokens make every batch's rows even, so the two
    cut the texts alike.
    """
    two, one = tmp_path / "two", tmp_path / "one"
    common = {
        "teacher_cache_dir": tmp_path / "cache",
        "save_to_artifacts": True,
        "kl_memory_steps": 2,
        "mnrl_weight": 1.0,
        "use_projection": use_projection,
        "gradient_accumulation_steps": accumulation,
    }
    if teachers == "reranker":  # phase 2 learns a cross-encoder's scores of each query's two candidates as well
        common["reranker_model"] = tiny_reranker
    elif teachers == 2:  # the tiny teacher and the 64-d model as one 112-d teacher
        common["teacher_model"] = f"{tiny_models['teacher']},{tiny_models['wide_student']}"
        common["teacher_weights"] = "1,2"
        common["efficiency_texts"] = 16  # and the cost stage on two processes: the main one measures
    elif not use_projection:  # phase 1 against another model: its vectors and basis reach every process too
        common["phase1_teacher_model"] = tiny_models["wide_student"]
    budgets: tuple[dict, dict] = ({}, {})
    if budget:
        common["pad_to_multiple_of"] = 16
        budgets = ({"max_tokens_per_batch": budget}, {"max_tokens_per_batch": 2 * budget})
    flags_two = tiny_run_flags(tiny_models, tiny_data, two, batch_size=4, **common, **budgets[0])
    if form == "relaunch":
        done = launch([sys.executable, "-m", "distill.train", "--num_processes", "2", *flags_two])
        assert "no CUDA GPU here" in done.stderr or torch.cuda.is_available()
    else:
        env = dict(os.environ, PYTHON=sys.executable, HF_HUB_OFFLINE="1", CUDA_VISIBLE_DEVICES="")
        env.pop("DISTILL_ALLOCATOR", None)
        env.pop("LD_PRELOAD", None)
        command = ["bash", str(REPO / "run_ddp.sh"), "2", str(use_projection), *flags_two]
        done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
        assert done.returncode == 0, done.stderr[-4000:]
        assert "no CUDA GPU found" in done.stderr
        # LD_PRELOAD reached the ranks through accelerate launch
        assert results_of(two)["heap_allocator"] == ("tcmalloc" if find_tcmalloc() else "glibc")
    assert main(tiny_run_flags(tiny_models, tiny_data, one, batch_size=8, **common, **budgets[1])) == 0
    assert results_of(two)["world_size"] == 2 and results_of(one)["world_size"] == 1
    assert (
        results_of(two)["phases"]["phase2"]["terms"]["mnrl"]
        == results_of(one)["phases"]["phase2"]["terms"]["mnrl"]
        == 1
    )
    assert results_of(two)["mode"] == results_of(one)["mode"] == ("projection" if use_projection else "matryoshka")
    members = teachers if teachers == 2 else 0  # a combined teacher's members are scored apart
    if teachers == 2:
        costs = [results_of(run)["efficiency"] for run in (two, one)]
        assert costs[0]["teacher"]["parameters"] == costs[1]["teacher"]["parameters"] > 0
        assert costs[0]["student"] == {**costs[1]["student"], **{k: costs[0]["student"][k] for k in TIMED}}
    assert len(results_of(two).get("teachers") or {}) == len(results_of(one).get("teachers") or {}) == members
    weights_two, weights_one = exported_weights(two), exported_weights(one)
    assert weights_two.keys() == weights_one.keys()
    start = load_file(str(Path(tiny_models["student"]) / "model.safetensors"))
    moved = max((weights_one[k] - start[k]).abs().max().item() for k in start if k in weights_one)
    assert moved > 1e-3  # training really changed the weights, so equality below is not trivial
    # Not bit-equal: per-process batches of 4 against 8 sum in another order in the kernels, and Adam, whose steps are
    # about lr whatever the gradient's size, carries those last bits into parameters with tiny gradients. So the
    # backbones must end within 1% of their training movement of each other: rounding stays far below that, and a
    # loss not scaled for the world size (a wrong gradient) lands an order of magnitude above it. The projection is
    # fitted on each run's own sharded encoding of the fitting texts, so it must end within 10% of its norm: a bound
    # for gross errors only.
    backbone = [k for k in start if k in weights_one]
    apart = sum((weights_two[k] - weights_one[k]).pow(2).sum().item() for k in backbone) ** 0.5
    movement = sum((weights_one[k] - start[k]).pow(2).sum().item() for k in backbone) ** 0.5
    assert apart <= 0.01 * movement, f"the backbones end {apart / movement:.2%} of their movement apart"
    for key in (k for k in weights_one if k not in start):  # the projection or the frozen rotation
        gap = (weights_two[key] - weights_one[key]).norm().item()
        assert gap <= 0.1 * weights_one[key].norm().item(), f"{key}: {gap}"
    for phase in ("phase1", "phase2"):
        losses_two, losses_one = (results_of(out)["phases"][phase]["losses"] for out in (two, one))
        assert len(losses_two) == len(losses_one) > 0
        assert losses_two == pytest.approx(losses_one, abs=1e-4), phase
    if teachers == "reranker":  # every pair scored once, whatever the number of processes
        assert results_of(two)["reranker"]["pairs"] == results_of(one)["reranker"]["pairs"] == 2 * 144
    if budget:  # batches of 2 to 8 texts, not 8: the budget made them
        phase1 = [results_of(out)["phases"]["phase1"] for out in (two, one)]
        assert phase1[0]["train_samples"] == phase1[1]["train_samples"] and phase1[1]["optimizer_steps"] > 256 // 8


def test_eval_steps_log_mid_phase_and_keep_the_best_model(tiny_models, tiny_data, tmp_path):
    out = tmp_path / "evals"
    assert main(tiny_run_flags(tiny_models, tiny_data, out, eval_steps=4, keep_best=True, phase2_epochs=2)) == 0
    results = results_of(out)
    for phase, stats in results["phases"].items():
        history = results["evaluations"][phase]
        assert [h["step"] for h in history] == list(range(4, stats["optimizer_steps"] + 1, 4))
        best = max(h["ndcg@10"] for h in history)
        kept = SentenceTransformer(str(out / "best" / phase / "model"), device="cpu")
        assert kept.encode(["a river"]).shape == (1, 48)
        assert f"{best}" in (out / "best" / phase / "model" / "README.md").read_text()
    logged = (out / "metrics.jsonl").read_text()
    assert "phase1/eval/ndcg@10" in logged and "phase2/eval/ndcg@10" in logged
    report = (out / "report.md").read_text()  # the report lists the mid-phase evaluations of both phases
    assert "| phase1 | 4 |" in report and "| phase2 | 4 |" in report


def short_evaluated_flags(tiny_models, tiny_data, out: Path, **options) -> list[str]:
    """A short run: 6 optimizer steps a phase (48 texts, 48 pairs; batch 8)."""
    return tiny_run_flags(tiny_models, tiny_data, out, max_samples_phase1=48, max_samples_phase2=48, **options)


def rising_ndcg(monkeypatch: pytest.MonkeyPatch) -> list[dict]:
    """Each student evaluation scores a higher nDCG@10 than the last (the real metrics otherwise); returns them all."""
    import distill.pipeline
    import distill.stages.scoring

    made = []
    evaluate = distill.stages.scoring.evaluate_student

    def rising(*args, **kwargs):
        metrics = {**evaluate(*args, **kwargs), "ndcg@10": float(len(made))}
        made.append(metrics)
        return metrics

    monkeypatch.setattr(distill.pipeline, "evaluate_student", rising)  # the untrained student
    monkeypatch.setattr(distill.stages.scoring, "evaluate_student", rising)  # the phases' evaluations
    return made


def test_keep_best_weighs_the_end_of_phase_model_too(tiny_models, tiny_data, tmp_path, monkeypatch):
    """6 steps a phase, evaluated every 4: the model each phase ends (and is exported) with is compared as well; with
    every 3, the end of the phase is step 6's evaluation, which is not made twice."""
    made = rising_ndcg(monkeypatch)
    out = tmp_path / "every4"
    assert main(short_evaluated_flags(tiny_models, tiny_data, out, eval_steps=4, keep_best=True)) == 0
    results = results_of(out)
    assert [results["phases"][p]["optimizer_steps"] for p in ("phase1", "phase2")] == [6, 6]
    assert results["capped"] == {"max_samples_phase1": 48, "max_samples_phase2": 48}  # 256 texts, 160 pairs given
    assert len(made) == 5  # before, then per phase: step 4 and the end
    assert results["after_phase1"]["ndcg@10"] == 2.0 and results["student_after"]["ndcg@10"] == 4.0
    for phase in ("phase1", "phase2"):
        card = (out / "best" / phase / "model" / "README.md").read_text()
        assert f"best of {phase}: its end, optimizer step 6" in card
        assert "/student/st` (32-d, projected to the teacher's 48-d)." in card  # its dimensions, not "None-d"
    made.clear()
    reset_accelerate()
    out = tmp_path / "every3"
    assert main(short_evaluated_flags(tiny_models, tiny_data, out, eval_steps=3, keep_best=True, skip_phase2=True)) == 0
    results = results_of(out)
    assert len(made) == 3  # before, step 3, step 6 (the end)
    assert results["student_after"]["ndcg@10"] == results["evaluations"]["phase1"][-1]["ndcg@10"] == 2.0
    assert "best of phase1 at optimizer step 6" in (out / "best" / "phase1" / "model" / "README.md").read_text()


def test_trackers_get_the_runs_optimizer_step_and_the_final_metrics(tiny_models, tiny_data, tmp_path):
    """Every line of metrics.jsonl has the run's optimizer step, counted on from phase 1 into phase 2; the evaluation
    rows of results.json come last, once, at the last step."""
    out = tmp_path / "tracked"
    assert main(short_evaluated_flags(tiny_models, tiny_data, out, eval_steps=4, log_with="jsonl")) == 0
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert "config" in lines[0] and all("config" not in line for line in lines[1:])
    steps = {
        key: [line["step"] for line in lines[1:] if key in line["values"]]
        for key in ("phase1/loss", "phase2/loss", "phase1/eval/ndcg@10", "phase2/eval/ndcg@10", "student_after/ndcg@10")
    }
    assert steps == {
        "phase1/loss": [1, 2, 3, 4, 5, 6],
        "phase2/loss": [7, 8, 9, 10, 11, 12],
        "phase1/eval/ndcg@10": [4],
        "phase2/eval/ndcg@10": [10],
        "student_after/ndcg@10": [12],
    }
    results, final = results_of(out), lines[-1]["values"]
    for row in ("teacher", "student_before", "after_phase1", "student_after"):
        assert final[f"{row}/ndcg@10"] == results[row]["ndcg@10"]


def test_train_seconds_leave_out_evaluations_and_checkpoints(tiny_models, tiny_data, tmp_path, monkeypatch):
    """An evaluation and a checkpoint every 2 of 6 steps, each made 1 s slower: that time is not training time.

    (The 6 steps themselves take about 0.1 s; a step after a pause is slower, its threads cold, so the bound is
    half the pauses rather than nothing.)
    """
    import time

    import distill.loop
    import distill.pipeline
    import distill.stages.scoring

    pauses = []

    def slower(real):
        def slow(*args, **kwargs):
            time.sleep(1.0)
            pauses.append(1.0)
            return real(*args, **kwargs)

        return slow

    slow_evaluation = slower(distill.stages.scoring.evaluate_student)
    monkeypatch.setattr(distill.pipeline, "evaluate_student", slow_evaluation)
    monkeypatch.setattr(distill.stages.scoring, "evaluate_student", slow_evaluation)
    monkeypatch.setattr(distill.loop, "save_checkpoint", slower(distill.loop.save_checkpoint))
    out = tmp_path / "timed"
    flags = short_evaluated_flags(tiny_models, tiny_data, out, eval_steps=2, checkpoint_steps=2, skip_phase2=True)
    assert main(flags) == 0
    stats = results_of(out)["phases"]["phase1"]
    in_training = sum(pauses) - 1.0  # less the evaluation before training (step 6's is the end-of-phase one)
    assert stats["optimizer_steps"] == 6 and in_training == 6.0  # steps 2, 4, 6: 3 evaluations, 3 checkpoints
    assert stats["train_seconds"] < in_training / 2, stats["train_seconds"]


def test_mined_hard_negatives_join_phase_two_without_re_encoding(tiny_models, tiny_data, tmp_path, monkeypatch):
    import distill.stages.negatives as negatives_module
    import distill.stages.targets as teacher_module

    devices, events = [], []

    def mine(*args, real=negatives_module.mine_rows, **kwargs):
        devices.append(kwargs.get("device"))
        events.append("mine")
        return real(*args, **kwargs)

    def release(cache, real=teacher_module.TeacherCache.release):
        events.append("release teacher")
        return real(cache)

    monkeypatch.setattr(negatives_module, "mine_rows", mine)
    monkeypatch.setattr(teacher_module.TeacherCache, "release", release)
    out = tmp_path / "mined"
    pairs = tmp_path / "pairs.jsonl"  # the tiny pairs without their negative column
    rows = [json.loads(line) for line in Path(tiny_data["pairs"]).read_text().splitlines()]
    pairs.write_text("".join(json.dumps({"query": r["query"], "passage": r["passage"]}) + "\n" for r in rows))
    flags = tiny_run_flags(tiny_models, tiny_data, out, phase2_data=pairs, mine_hard_negatives=2, skip_phase1=True)
    assert main(flags) == 0
    cache_entries = [p for p in (out / "cache").iterdir() if (p / "manifest.json").is_file()]
    counts = [json.loads((p / "manifest.json").read_text())["count"] for p in cache_entries]
    train_pairs = len(rows) - 16  # 16 pairs are held out for evaluation
    assert train_pairs in counts and 3 * train_pairs not in counts  # negatives reuse passages: nothing re-encoded
    phase2 = results_of(out)["phases"]["phase2"]
    assert phase2["optimizer_steps"] > 0
    assert phase2["negatives"] == {"per_query": 2, "from": "mined by the teacher"}  # results.json says so
    # on the accelerator's device: a launcher leaves each GPU process one CPU thread, too few for O(n^2 d)
    assert devices == [torch.device("cpu")]
    assert events == ["release teacher", "mine"]  # on a GPU the search takes the memory the teacher held


def test_mining_that_runs_out_of_device_memory_goes_on_on_the_cpu(monkeypatch):
    import distill.stages.negatives as teacher_module

    devices = []

    def mine(*args, real=teacher_module.mine_rows, **kwargs):
        devices.append(str(kwargs["device"]))
        if kwargs["device"] != "cpu":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 3.81 GiB")
        return real(*args, **kwargs)

    monkeypatch.setattr(teacher_module, "mine_rows", mine)
    state = PartialState(cpu=True)  # the warning goes through Accelerate's logger
    vectors = torch.nn.functional.normalize(torch.randn(12, 8), dim=1).numpy().astype(np.float16)
    texts = [f"passage {i}" for i in range(12)]
    gpu = SimpleNamespace(device="cuda:0", num_processes=1, split_between_processes=state.split_between_processes)
    mined = teacher_module.mined_negatives(gpu, 3, texts, vectors, vectors)
    assert devices == ["cuda:0", "cpu"]
    assert mined.shape == (12, 3) and not (mined == np.arange(12)[:, None]).any()  # never the own positive


def test_teacher_batch_size_sets_the_teachers_batches_only(tiny_models, tiny_data, tmp_path, monkeypatch):
    import distill.stages.initialise as student_module
    import distill.stages.targets as teacher_module

    sizes: dict[str, set[int]] = {"teacher": set(), "student": set()}
    for name, module in (("teacher", teacher_module), ("student", student_module)):

        def spy(accelerator, lengths, batch_size, encode, real=module.map_sharded, seen=sizes[name], **kwargs):
            seen.add(batch_size)
            return real(accelerator, lengths, batch_size, encode, **kwargs)

        monkeypatch.setattr(module, "map_sharded", spy)
    out = tmp_path / "teacher_batch"
    assert main(tiny_run_flags(tiny_models, tiny_data, out, teacher_batch_size=5, skip_phase2=True)) == 0
    assert sizes == {"teacher": {5}, "student": {16}}  # the student's evaluation keeps 2 x batch_size


def test_optimizer_fuses_the_update_where_torch_can_and_matches_the_plain_loop(tiny_models):
    """The fused AdamW of a CPU run takes the same steps as torch's per-parameter loop (foreach off)."""
    from distill.optimizer import make_optimizer
    from distill.students.head import DistillationModel
    from distill.students.transformer import load_student

    models = [DistillationModel(load_student(str(tiny_models["student"]))).eval() for _ in range(2)]  # no dropout
    start = [p.detach().clone() for p in models[0].parameters()]
    fused = make_optimizer(models[0], lr=1e-3, weight_decay=0.01, device_type="cpu")
    plain = make_optimizer(models[1], lr=1e-3, weight_decay=0.01, device_type="tpu")
    assert fused.defaults["fused"] and not plain.defaults["fused"]  # no fused kernel listed for 'tpu'
    for group in plain.param_groups:
        group["foreach"] = False
    batch = models[0].student.tokenize(["one text", "and a longer second text"])
    direction = torch.randn(models[0].student_dim, generator=torch.Generator().manual_seed(0))
    for model, optimizer in zip(models, (fused, plain)):
        for _ in range(3):
            (model(batch)[0][1] @ direction).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
    assert any(not torch.equal(a, b) for a, b in zip(models[0].parameters(), start))  # the steps moved weights
    for a, b in zip(models[0].parameters(), models[1].parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)  # a hundredth of one step (lr 1e-3)


def optimizer_step_gradients(
    tiny_models, tiny_data, out: Path, monkeypatch: pytest.MonkeyPatch, accumulation: int
) -> list[torch.Tensor]:
    """The gradient each optimizer step of a phase 1 of 5 batches is taken with; the steps update nothing, so every
    gradient is taken at the starting weights and runs with other accumulation windows can be compared."""
    import distill.loop

    gradients: list[torch.Tensor] = []

    class Recording(torch.optim.SGD):
        def step(self, closure=None):
            grads = [p.grad.flatten() for group in self.param_groups for p in group["params"] if p.grad is not None]
            gradients.append(torch.cat(grads).clone())

    monkeypatch.setattr(distill.loop, "make_optimizer", lambda model, *args: Recording(model.parameters(), lr=0.1))
    flags = tiny_run_flags(tiny_models, tiny_data, out, eval_data="none", max_samples_phase1=40, max_grad_norm=0)
    assert main([*flags, "--skip_phase2", "--gradient_accumulation_steps", str(accumulation)]) == 0
    return gradients


def test_a_short_last_accumulation_window_averages_its_own_batches(tiny_models, tiny_data, tmp_path, monkeypatch):
    """5 batches in windows of 2: the epoch's last step has one batch, and its gradient is that batch's, not half of
    it (Accelerate divides every micro-batch loss by the window length it was configured with)."""
    single = optimizer_step_gradients(tiny_models, tiny_data, tmp_path / "one", monkeypatch, accumulation=1)
    reset_accelerate()
    windows = optimizer_step_gradients(tiny_models, tiny_data, tmp_path / "two", monkeypatch, accumulation=2)
    assert len(single) == 5 and len(windows) == 3
    for step, (window, batches) in enumerate(zip(windows, (single[0:2], single[2:4], single[4:5]))):
        expected = torch.stack(batches).mean(dim=0)
        torch.testing.assert_close(window, expected, rtol=1e-4, atol=1e-7, msg=lambda m, step=step: f"step {step}: {m}")


def test_passage_memory_adds_earlier_steps_as_detached_candidates():
    from distill.phases import PassageMemory

    memory = PassageMemory(2)
    batches = [(torch.randn(3, 4, requires_grad=True), torch.randn(3, 4)) for _ in range(4)]
    student, teacher = memory.extend(*batches[0])
    assert student is batches[0][0] and teacher is batches[0][1]  # empty: the batch alone
    for pair in batches[:3]:
        memory.stage(*pair)
        memory.commit()
    memory.stage(*batches[3])  # staged, its step not taken: not a candidate, not in a checkpoint
    student, teacher = memory.extend(*batches[0])
    # the batch first (its rows keep their gradient), then the last two committed steps, oldest first
    assert torch.equal(student, torch.cat([batches[0][0], batches[1][0], batches[2][0]]))
    assert torch.equal(teacher, torch.cat([batches[0][1], batches[1][1], batches[2][1]]))
    student.sum().backward()
    assert torch.equal(batches[0][0].grad, torch.ones(3, 4))
    assert batches[1][0].grad is None and batches[2][0].grad is None  # remembered rows are detached
    restored = PassageMemory(2)
    restored.load_state_dict(memory.state_dict(), torch.device("cpu"))
    again = restored.extend(*batches[0])
    assert torch.equal(again[0], student) and torch.equal(again[1], teacher)
    # an accumulation window: its micro-batches make one entry, so N counts optimizer steps
    window = PassageMemory(1)
    window.stage(*batches[1])
    window.stage(*batches[2])
    window.commit()
    assert torch.equal(window.extend(*batches[0])[0], student)
    off = PassageMemory(0)
    off.stage(*batches[0])
    off.commit()
    assert off.extend(*batches[1])[0] is batches[1][0] and off.state_dict() == {}


def test_projection_init_is_orthogonal_unless_the_student_is_wider(tiny_models, tiny_data, tmp_path):
    """auto: a bias-free orthonormal start for the 32-d student; least squares (with bias) for the 64-d one."""
    for student, expect_bias in (("student", False), ("wide_student", True)):
        out = tmp_path / student
        flags = {"student_model": tiny_models[student], "skip_phase2": True, "save_to_artifacts": True}
        assert main(tiny_run_flags(tiny_models, tiny_data, out, **flags)) == 0
        weights = exported_weights(out)
        assert weights["dense.linear.weight"].shape[0] == 48
        assert ("dense.linear.bias" in weights) == expect_bias, student


def option_run_flags(tiny_models, tiny_data, out: Path, cache: Path, **options) -> list[str]:
    """A short exported run (6 + 4 optimizer steps, a checkpoint every 3) to hold a training option to.

    The projection starts as the orthogonal fit (the 32-d student is narrower than the 48-d teacher).
    """
    settings = {
        "max_samples_phase1": 48,
        "max_samples_phase2": 32,
        "checkpoint_steps": 3,
        "checkpoints_total_limit": 9,
        "teacher_cache_dir": cache,
        "save_to_artifacts": True,
    }
    return tiny_run_flags(tiny_models, tiny_data, out, **settings, **options)


@pytest.fixture(scope="session")
def eager_run(tiny_models, tiny_data, tmp_path_factory) -> Path:
    """The short run without options; its teacher cache (next to it) is shared by the runs compared with it."""

    def make(root: Path) -> None:
        assert main(option_run_flags(tiny_models, tiny_data, root / "eager", root / "cache")) == 0
        reset_accelerate()

    return shared_folder(tmp_path_factory, "options", make) / "eager"


def assert_same_losses(run: Path, reference: Path, atol: float = 0.0, rtol: float = 0.0) -> None:
    for phase in ("phase1", "phase2"):
        losses, expected = results_of(run)["phases"][phase]["losses"], results_of(reference)["phases"][phase]["losses"]
        assert len(losses) == len(expected) > 0
        np.testing.assert_allclose(losses, expected, atol=atol, rtol=rtol, err_msg=phase)


def max_weight_difference(run: Path, reference: Path) -> float:
    weights, expected = exported_weights(run), exported_weights(reference)
    assert weights.keys() == expected.keys()
    return max((weights[k] - expected[k]).abs().max().item() for k in weights)


def test_make_accelerator_wires_compile_and_gradient_compression(tmp_path, monkeypatch):
    from accelerate.utils import DDPCommunicationHookType, DynamoBackend

    from distill.config import build_config
    from distill.distributed import make_accelerator

    monkeypatch.setenv("ACCELERATE_DYNAMO_BACKEND", "AOT_EAGER")  # as `accelerate launch --dynamo_backend` sets it
    values = {"torch_compile": True, "ddp_comm_hook": "fp16"}
    accelerator = make_accelerator(build_config({**values, "log_with": "none", "output_dir": str(tmp_path)}))
    plugin = accelerator.state.dynamo_plugin
    assert plugin.backend == DynamoBackend.AOT_EAGER and plugin.use_regional_compilation and plugin.dynamic
    assert accelerator.ddp_handler.comm_hook == DDPCommunicationHookType.FP16  # one process: no DDP, hook unused
    reset_accelerate()
    plain = make_accelerator(build_config({"log_with": "none", "output_dir": str(tmp_path)}))
    assert plain.ddp_handler is None


def test_bf16_gradient_compression_is_refused_on_cpu_processes(tmp_path, monkeypatch):
    """PyTorch registers the bf16 hook only with CUDA and NCCL >= 2.10: say so at start-up, not in a DDP traceback."""
    from distill.config import build_config
    from distill.distributed import make_accelerator

    monkeypatch.setenv("WORLD_SIZE", "2")  # as accelerate launch sets it; restored after the test
    monkeypatch.setenv("ACCELERATE_USE_CPU", "false")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    config = build_config({"ddp_comm_hook": "bf16", "log_with": "none", "output_dir": str(tmp_path)})
    with pytest.raises(DistillError, match=r"^ddp_comm_hook bf16 needs CUDA GPUs \(NCCL\).*drop --ddp_comm_hook"):
        make_accelerator(config)


def test_fp16_is_refused_on_a_cpu_whether_from_the_flag_or_from_accelerate_launch(tmp_path, monkeypatch):
    """Accelerate takes fp16 on a CPU and trains in float32 without a word (measured: bit-equal weights to `no`)."""
    from distill.config import build_config
    from distill.distributed import make_accelerator

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    base = {"log_with": "none", "output_dir": str(tmp_path)}
    with pytest.raises(DistillError, match=r"^mixed_precision fp16 needs a CUDA GPU; use bf16 or no on a CPU$"):
        make_accelerator(build_config({**base, "mixed_precision": "fp16"}))
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp16")  # what `accelerate launch --mixed_precision fp16` sets
    with pytest.raises(DistillError, match=r"^mixed_precision fp16 \(from accelerate launch.*--mixed_precision bf16"):
        make_accelerator(build_config(base))
    accelerator = make_accelerator(build_config({**base, "mixed_precision": "no"}))  # the flag wins over the launcher
    assert accelerator.mixed_precision == "no"


def test_the_evaluation_encodes_in_float32_under_a_bf16_run(tiny_models):
    """A prepared model's forward runs in the run's bf16 autocast (Accelerate wraps it); the evaluation scores the
    float32 vectors the exported model's `encode` gives, and the fitting encodes under the run's precision."""
    from accelerate import Accelerator

    from distill.stages.initialise import encode_student
    from distill.students.head import DistillationModel
    from distill.students.transformer import load_student
    from distill.tokens import TokenizedTexts

    accelerator = Accelerator(cpu=True, mixed_precision="bf16")
    model = accelerator.prepare(DistillationModel(load_student(str(tiny_models["student"]))))
    texts = ["a first text", "the second text is a little longer", "three"]
    tokens = TokenizedTexts(model.student.tokenizer, texts, model.student.max_seq_length)
    expected = model.student.encode(texts, batch_size=2)  # sentence-transformers' own encode, in float32
    evaluated = encode_student(accelerator, model, tokens, batch_size=2, float32=True)[1]
    np.testing.assert_allclose(evaluated, expected, atol=1e-6)
    fitted = encode_student(accelerator, model, tokens, batch_size=2)[1]
    assert np.abs(fitted - expected).max() > 1e-5  # bf16 rounds the inputs of every matrix product


def test_torch_compile_resumes_an_eager_checkpoint_and_trains_as_eager(
    tiny_models, tiny_data, eager_run, tmp_path, monkeypatch
):
    """Regional compilation (aot_eager: no C++ compiler needed) from an eager checkpoint in mid phase 1, compiled
    again for phase 2: the eager run's losses and weights, and checkpoints with the eager run's keys."""
    import accelerate.accelerator

    compiled = []
    compile_regions = accelerate.accelerator.compile_regions

    def recording_compile_regions(module, **kwargs):
        compiled.append(kwargs["backend"])
        return compile_regions(module, **kwargs)

    monkeypatch.setattr(accelerate.accelerator, "compile_regions", recording_compile_regions)
    monkeypatch.setenv("ACCELERATE_DYNAMO_USE_DYNAMIC", "False")  # what `accelerate launch` sets by default
    monkeypatch.setattr(torch._dynamo.config, "fail_on_recompile_limit_hit", True)  # not silently eager
    monkeypatch.setenv("ACCELERATE_DYNAMO_BACKEND", "aot_eager")  # `accelerate launch --dynamo_backend aot_eager`
    out = tmp_path / "compiled"
    flags = option_run_flags(tiny_models, tiny_data, out, eager_run.parent / "cache", torch_compile=True)
    checkpoint = eager_run / "checkpoints" / "checkpoint-phase1-0000003"
    torch._dynamo.utils.counters.clear()
    assert main([*flags, "--resume_from_checkpoint", str(checkpoint)]) == 0
    assert compiled == ["aot_eager", "aot_eager"]  # phase 1, then phase 2's prepare compiles the plain model again
    frames = torch._dynamo.utils.counters["frames"]
    assert frames["ok"] == frames["total"] > 0  # the layers did run compiled, none fell back to eager
    assert_same_losses(out, eager_run, atol=1e-4)
    assert max_weight_difference(out, eager_run) <= 1e-4
    for name in ("checkpoint-phase1-0000006", "checkpoint-phase2-0000003"):
        saved = load_file(str(out / "checkpoints" / name / "model.safetensors"))
        assert saved.keys() == load_file(str(eager_run / "checkpoints" / name / "model.safetensors")).keys()
    assert SentenceTransformer(str(out / "artifacts" / "model"), device="cpu").encode(["a river"]).shape == (1, 48)


def test_gradient_checkpointing_changes_no_loss_and_stays_out_of_the_export(
    tiny_models, tiny_data, eager_run, tmp_path, monkeypatch
):
    import distill.students.transformer

    enabled = []
    enable = distill.students.transformer.enable_gradient_checkpointing
    monkeypatch.setattr(
        distill.students.transformer, "enable_gradient_checkpointing", lambda s: enabled.extend(enable(s))
    )
    out = tmp_path / "checkpointed"
    flags = option_run_flags(tiny_models, tiny_data, out, eager_run.parent / "cache", gradient_checkpointing=True)
    assert main(flags) == 0
    assert [type(m).__name__ for m in enabled] == ["BertModel"]
    assert_same_losses(out, eager_run, atol=1e-5)
    exported = out / "artifacts" / "model"
    assert "checkpointing" not in (exported / "config.json").read_text()
    backbone = SentenceTransformer(str(exported), device="cpu")[0].auto_model
    assert not any(getattr(m, "gradient_checkpointing", False) for m in backbone.modules())


def test_rounded_batch_widths_change_no_loss(tiny_models, tiny_data, eager_run, tmp_path, monkeypatch):
    from distill.tokens import TokenizedTexts

    widths = []
    features = TokenizedTexts.features

    def recorded(self, indices):
        out = features(self, indices)
        widths.append((self.pad_to_multiple_of, out["input_ids"].shape[1], int(self.lengths[indices].max())))
        return out

    monkeypatch.setattr(TokenizedTexts, "features", recorded)
    out = tmp_path / "rounded"
    assert main(option_run_flags(tiny_models, tiny_data, out, eager_run.parent / "cache", pad_to_multiple_of=8)) == 0
    training = [(width, longest) for multiple, width, longest in widths if multiple == 8]
    assert training and all(width % 8 == 0 or width == longest for width, longest in training)
    assert any(width > longest for width, longest in training)  # the option did pad some batches further
    others = [(width, longest) for multiple, width, longest in widths if multiple != 8]
    assert others and all(width == longest for width, longest in others)  # evaluation batches stay unrounded
    assert_same_losses(out, eager_run, atol=1e-5)


def test_forward_chunks_change_no_loss(tiny_models, tiny_data, eager_run, tmp_path, monkeypatch):
    """Phase 2 in length chunks trains as one padded batch does (to float rounding); 1 chunk is that batch."""
    from distill.tokens import TokenizedTexts

    chunk_counts = []
    chunked_features = TokenizedTexts.chunked_features

    def recorded(self, indices, max_chunks):
        out = chunked_features(self, indices, max_chunks)
        chunk_counts.append((max_chunks, len(out["chunks"])))
        return out

    monkeypatch.setattr(TokenizedTexts, "chunked_features", recorded)
    out = tmp_path / "one_chunk"
    assert main(option_run_flags(tiny_models, tiny_data, out, eager_run.parent / "cache", forward_chunks=1)) == 0
    assert chunk_counts and all(count == 1 for _, count in chunk_counts)
    assert {allowed for allowed, _ in chunk_counts} == {1}
    # the default run (eager_run, 4 chunks allowed) split some of its batches: same data, so record them too
    chunk_counts.clear()
    reset_accelerate()
    again = tmp_path / "default"
    assert main(option_run_flags(tiny_models, tiny_data, again, eager_run.parent / "cache")) == 0
    assert any(count > 1 for _, count in chunk_counts) and all(allowed == 4 for allowed, _ in chunk_counts)
    assert_same_losses(again, eager_run)  # deterministic
    assert_same_losses(out, eager_run, atol=1e-5)


GRADIENT_COMPRESSION_RUN = """
import os
import sys

import torch

from distill.train import main

register = torch.nn.parallel.DistributedDataParallel.register_comm_hook


def recording_register(ddp, state, hook):  # notes each hook DDP is given, then registers it
    with open(os.path.join(sys.argv[1], f"hooks-rank{os.environ['RANK']}.txt"), "a") as log:
        log.write(hook.__name__ + "\\n")
    return register(ddp, state, hook)


torch.nn.parallel.DistributedDataParallel.register_comm_hook = recording_register
sys.exit(main(sys.argv[2:]))
"""


@pytest.mark.multiprocess
def test_fp16_gradient_compression_on_two_cpu_processes(tiny_models, tiny_data, eager_run, tmp_path):
    """gloo all-reduces fp16: the hook is registered for each phase on both ranks, and 2 x 4 with compressed
    gradients trains close to the uncompressed 1 x 8 run.

    The hook names recorded on each rank show the compression in use. Every step's loss stays within 5e-5 of the
    uncompressed 1 x 8 run's (1.04e-5 measured on a 2-core CPU): a hook that lost or mis-scaled the gradients would
    leave the weights where they started, or move them elsewhere, and the losses with them by far more. The bound
    does not tell fp16 rounding from none; torch owns that arithmetic, and distill only registers the hook.
    """
    script = tmp_path / "compressed_run.py"
    script.write_text(GRADIENT_COMPRESSION_RUN)
    out = tmp_path / "compressed"
    flags = option_run_flags(
        tiny_models, tiny_data, out, eager_run.parent / "cache", batch_size=4, ddp_comm_hook="fp16"
    )
    command = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "2", "--multi_gpu"]
    launch([*command, "--num_machines", "1", "--main_process_port", "0", str(script), str(tmp_path), *flags])
    assert results_of(out)["world_size"] == 2
    for rank in (0, 1):
        assert (tmp_path / f"hooks-rank{rank}.txt").read_text().split() == ["fp16_compress_hook"] * 2
    assert_same_losses(out, eager_run, atol=5e-5, rtol=5e-4)


def test_a_failed_report_does_not_fail_the_trained_run(tiny_models, tiny_data, tmp_path, monkeypatch, caplog):
    """matplotlib missing (say): the run still exports, writes results.json, report.md and ends its trackers."""
    import distill.report

    def no_matplotlib(*args: object) -> None:
        raise ModuleNotFoundError("No module named 'matplotlib'")

    monkeypatch.setattr(distill.report, "report_figure", no_matplotlib)
    out = tmp_path / "no_report"
    flags = short_evaluated_flags(tiny_models, tiny_data, out, skip_phase2=True, save_to_artifacts=True)
    assert main(flags) == 0
    assert "student_after" in results_of(out) and (out / "artifacts" / "model" / "model.safetensors").is_file()
    assert "report.png not drawn (ModuleNotFoundError: No module named 'matplotlib')" in caplog.text
    report = (out / "report.md").read_text()
    assert "| ndcg@10 |" in report and "student_after" in report
    assert "report.png" not in report and not (out / "report.png").exists()
    assert '"student_after/ndcg@10"' in (out / "metrics.jsonl").read_text()


def test_nanobeir_scores_every_model_as_sentence_transformers_evaluator_does(
    tiny_models, tiny_data, nanobeir_stand_in, tmp_path
):
    """--eval_data nanobeir:FOLDER (NanoBEIR-en's format): teacher and students scored per dataset, the mean as
    nDCG@10; the exported model's figures are what sentence-transformers' NanoBEIREvaluator reports for it."""
    from sentence_transformers.sentence_transformer.evaluation import NanoBEIREvaluator

    out = tmp_path / "nano"
    names = "scifact,nfcorpus"
    flags = tiny_run_flags(
        tiny_models, tiny_data, out, eval_data=f"nanobeir:{nanobeir_stand_in}", nanobeir_datasets=names
    )
    assert main([*flags, "--skip_phase2", "--use_projection", "False", "--save_to_artifacts"]) == 0
    results = results_of(out)
    for row in ("teacher", "student_before", "student_after"):
        assert set(results[row]["datasets_ndcg@10"]) == {"NanoSciFact", "NanoNFCorpus"}, row
    after = results["student_after"]
    model = SentenceTransformer(str(out / "artifacts" / "model"), device="cpu")
    reference = NanoBEIREvaluator(dataset_names=names.split(","), dataset_id=str(nanobeir_stand_in), write_csv=False)
    scores = reference(model)
    assert after["ndcg@10"] == pytest.approx(scores["NanoBEIR_mean_cosine_ndcg@10"], abs=1e-6)
    assert after["mrr@10"] == pytest.approx(scores["NanoBEIR_mean_cosine_mrr@10"], abs=1e-6)
    for dataset, value in after["datasets_ndcg@10"].items():
        assert value == pytest.approx(scores[f"{dataset}_cosine_ndcg@10"], abs=1e-6), dataset
    assert len(after["ranks@10"]) == 14  # 7 judged queries per dataset
    card = (out / "artifacts" / "model" / "README.md").read_text()
    assert "type: NanoBEIR_mean" in card and "type: NanoSciFact" in card
    assert "| NanoNFCorpus |" in (out / "report.md").read_text()


def test_nanobeir_from_the_hub_offline_is_one_line_before_any_model(tiny_models, tiny_data, tmp_path, capsys):
    flags = tiny_run_flags(tiny_models, tiny_data, tmp_path / "x", eval_data="nanobeir")
    assert main(flags) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(
        "error: eval_data nanobeir: cannot read 'sentence-transformers/NanoBEIR-en'"
    )
    assert err[0].endswith("NanoBEIR needs the Hub, or a local copy in the same format: --eval_data nanobeir:FOLDER")


def test_training_under_bf16_autocast_computes_in_bfloat16_and_keeps_float32_weights(
    tiny_models, tiny_data, tmp_path, monkeypatch
):
    """--mixed_precision bf16 (what the GPU configs use; a CPU autocasts too): the student's linear layers compute in
    bfloat16 in every training step, the losses stay finite and within 5% of float32's, and the weights, the
    checkpoints and the export stay float32."""
    from safetensors.torch import load_file

    import distill.loop

    seen: set[torch.dtype] = set()
    stepping, train_step = [False], distill.loop.train_step

    def record(module, inputs, output):
        if stepping[0] and isinstance(module, torch.nn.Linear):
            seen.add(output.dtype)

    def recorded_step(*args, **kwargs):  # what the loop's steps compute, not the student stage's probe forward
        stepping[0] = True
        try:
            return train_step(*args, **kwargs)
        finally:
            stepping[0] = False

    monkeypatch.setattr(distill.loop, "train_step", recorded_step)

    flags = dict(skip_phase2=True, eval_data="none", checkpoint_steps=8, save_to_artifacts=True)
    runs = {}
    for precision in ("no", "bf16"):
        out = tmp_path / precision
        seen.clear()
        reset_accelerate()  # a second Accelerator in this process, with another precision
        hook = torch.nn.modules.module.register_module_forward_hook(record)
        try:
            assert main(tiny_run_flags(tiny_models, tiny_data, out, mixed_precision=precision, **flags)) == 0
        finally:
            hook.remove()
        runs[precision] = (set(seen), results_of(out)["phases"]["phase1"]["losses"], out)
    assert runs["no"][0] == {torch.float32} and runs["bf16"][0] == {torch.bfloat16}
    fp32_losses, bf16_losses = np.array(runs["no"][1]), np.array(runs["bf16"][1])
    assert np.isfinite(bf16_losses).all() and not np.array_equal(fp32_losses, bf16_losses)
    np.testing.assert_allclose(bf16_losses, fp32_losses, rtol=0.05)
    out = runs["bf16"][2]
    checkpoint = sorted((out / "checkpoints").glob("checkpoint-phase1-*"))[-1]
    for weights in (checkpoint / "model.safetensors", out / "artifacts" / "model" / "model.safetensors"):
        assert {t.dtype for t in load_file(str(weights)).values()} == {torch.float32}, weights
