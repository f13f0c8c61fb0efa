"""`python -m distill.evaluate`: NanoBEIR and MTEB on an exported model, against local stand-ins; one line offline."""

from __future__ import annotations

import json
from pathlib import Path

import mteb
import pytest

from conftest import write_mteb_retrieval_stand_in
from distill.evaluate import main


def test_nanobeir_on_a_local_copy(tiny_models, nanobeir_stand_in, tmp_path, capsys):
    output = tmp_path / "scores.json"
    argv = [
        str(tiny_models["student"]),
        "--nanobeir",
        str(nanobeir_stand_in),
        "--nanobeir_datasets",
        "scifact,nfcorpus",
    ]
    assert main([*argv, "--output", str(output)]) == 0
    scores = json.loads(output.read_text())["nanobeir"]
    assert {"NanoBEIR_mean_cosine_ndcg@10", "NanoSciFact_cosine_ndcg@10", "NanoNFCorpus_cosine_mrr@10"} <= set(scores)
    mean = (scores["NanoSciFact_cosine_ndcg@10"] + scores["NanoNFCorpus_cosine_ndcg@10"]) / 2
    assert scores["NanoBEIR_mean_cosine_ndcg@10"] == pytest.approx(mean)
    assert "| nanobeir | NanoBEIR_mean_cosine_ndcg@10 |" in capsys.readouterr().out


def test_an_mteb_task_runs_on_the_model(tiny_models, tmp_path, monkeypatch, capsys):
    """The task as MTEB defines it (SciFact's metadata, evaluator and main score), its data a local stand-in."""
    task = mteb.get_task("SciFact")
    folder = write_mteb_retrieval_stand_in(tmp_path / "scifact")
    task.metadata = task.metadata.model_copy(update={"dataset": {"path": str(folder), "revision": "local"}})
    monkeypatch.setattr(mteb, "get_tasks", lambda tasks: [task] if tasks == ["SciFact"] else [])
    output = tmp_path / "scores.json"
    assert main([str(tiny_models["student"]), "--mteb", "SciFact", "--output", str(output)]) == 0
    score = json.loads(output.read_text())["mteb"]["SciFact"]
    assert score == pytest.approx(reference_ndcg_at_10(tiny_models["student"], folder), abs=1e-4)
    assert "| mteb | SciFact |" in capsys.readouterr().out


def reference_ndcg_at_10(model: Path, folder: Path) -> float:
    """nDCG@10 of the stand-in's queries over its corpus, by sentence-transformers' own retrieval evaluator."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.evaluation import InformationRetrievalEvaluator

    def rows(subset: str) -> list[dict]:
        return [json.loads(line) for line in (folder / subset / "test.jsonl").read_text().splitlines()]

    relevant: dict[str, set[str]] = {}
    for row in rows("default"):
        relevant.setdefault(row["query-id"], set()).add(row["corpus-id"])
    evaluator = InformationRetrievalEvaluator(
        queries={row["_id"]: row["text"] for row in rows("queries")},
        corpus={row["_id"]: row["text"] for row in rows("corpus")},
        relevant_docs=relevant,
        ndcg_at_k=[10],
        write_csv=False,
    )
    return evaluator(SentenceTransformer(str(model), device="cpu"))[f"{evaluator.primary_metric}"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--mteb", "SciFact"], "error: MTEB task SciFact could not run (ConnectionError: "),
        (["--nanobeir"], "error: --nanobeir: Could not load subset"),
        (["--mteb", "NoSuchTask"], "error: --mteb: 'NoSuchTask' not found"),
        ([], "error: nothing to evaluate; pass --nanobeir, --mteb TASKS, or both"),
    ],
    ids=["mteb-offline", "nanobeir-offline", "unknown-task", "nothing"],
)
def test_what_cannot_run_here_is_one_line(tiny_models, capsys, argv: list[str], message: str):
    assert main([str(tiny_models["student"]), *argv]) == 2  # HF_HUB_OFFLINE=1 (conftest)
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(err) == 1 and err[0].startswith(message), err


def test_a_missing_model_is_one_line(tmp_path: Path, capsys):
    assert main([str(tmp_path / "no-model"), "--nanobeir"]) == 2
    assert "does not exist" in capsys.readouterr().err
