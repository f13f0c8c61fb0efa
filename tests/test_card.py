"""The model card: sentence-transformers' header and sections, filled from the run offline, with distill's section."""

from __future__ import annotations

from pathlib import Path

import yaml
from sentence_transformers import SentenceTransformer

from distill.card import (
    card_scores,
    distill_section,
    model_card,
    phases_sentence,
    student_card_header,
    train_datasets,
)
from distill.data.reading import lenient
from distill.students.kinds import StudentDescription

RESULTS = {
    "student_after": {
        "ndcg@10": 0.55,
        "mrr@10": 0.48,
        "ranks@10": [0, 1, -1],
        "sts_spearman": 0.61,
        "matryoshka_ndcg@10": {"32": 0.55, "16": 0.53, "8": 0.5},
    },
    "phases": {"phase1": {"examples": 1200}, "phase2": {"examples": 300}},
}
SETTINGS = {
    "teacher_model": "big-org/teacher",
    "student_model": "sentence-transformers/all-MiniLM-L6-v2",
    "student_num_layers": 3,
    "phase1_data": "embedded",
    "phase2_data": "some-org/pairs:triplet",
    "kl_weight": 1.0,
    "temperature": 0.05,
    "batch_size": 8,
}


def header(card: str) -> dict:
    assert card.startswith("---\n")
    return yaml.safe_load(card.split("---\n")[1])


def test_the_card_carries_sentence_transformers_header_and_distills_section(tiny_models: dict[str, Path]) -> None:
    """base_model, datasets, language, license, scores in the header; distill's section above Training Details."""
    student = SentenceTransformer(str(tiny_models["student"]), device="cpu")
    student.train()
    card = model_card(
        student, SETTINGS, "| metric | student_after |", {"student": 32}, matryoshka=[32, 16, 8], figures=RESULTS
    )
    meta = header(card)
    assert meta["base_model"] == "sentence-transformers/all-MiniLM-L6-v2"
    assert meta["datasets"] == ["some-org/pairs"]  # the Hub dataset; the embedded data has no Hub id
    assert meta["license"] == "apache-2.0" and meta["language"] == ["en"]  # the shipped student's own card says so
    assert meta["library_name"] == "sentence-transformers" and "distillation" in meta["tags"]
    assert {"cosine_ndcg@10", "cosine_mrr@10", "spearman_cosine"} <= set(meta["metrics"])
    results = meta["model-index"][0]["results"]
    scores = {(r["dataset"]["type"], m["type"]): m["value"] for r in results for m in r["metrics"]}
    assert scores[("held-out", "cosine_ndcg@10")] == 0.55 and scores[("held-out-dim_16", "cosine_ndcg@10")] == 0.53
    assert scores[("lee-sts", "spearman_cosine")] == 0.61
    assert ("held-out-dim_32", "cosine_ndcg@10") not in scores  # the full width is the held-out row itself
    assert meta["model-index"][0]["name"] == "all-MiniLM-L6-v2 distilled from teacher"
    assert card.index("## Distillation") < card.index("## Training Details") < card.index("1,200 training samples")
    assert "| metric | student_after |" in card and '"batch_size": 8' in card
    assert "distill.losses.similarity_kl_loss" in card and '"temperature": 0.05' in card
    assert student.training  # the usage example encodes in eval mode; a mid-phase export gets training back


def test_the_push_repo_names_the_model(tiny_models: dict[str, Path]) -> None:
    student = SentenceTransformer(str(tiny_models["student"]), device="cpu")
    card = model_card(student, {**SETTINGS, "push_to_hub": "me/small"}, "", {"student": 32}, figures=RESULTS)
    assert 'SentenceTransformer("me/small")' in card


def test_a_local_student_has_no_base_model_and_no_scores_without_an_evaluation(tiny_models: dict[str, Path]) -> None:
    student = SentenceTransformer(str(tiny_models["student"]), device="cpu")
    settings = {"teacher_model": str(tiny_models["teacher"]), "student_model": str(tiny_models["student"])}
    meta = header(model_card(student, settings, "(no evaluation set)", {"student": 32}))
    assert "base_model" not in meta and "metrics" not in meta and "license" not in meta
    assert student_card_header(str(tiny_models["student"])) == {}  # a folder without a README.md


def test_scores_and_sources() -> None:
    assert card_scores({}) == {}
    only_retrieval = card_scores({"student_after": {"ndcg@10": 0.5, "mrr@10": 0.4}})
    assert [s.name for s in only_retrieval] == ["held-out"]
    assert lenient("embedded").hub_id is None and lenient("org/data:subset").hub_id == "org/data"
    assert lenient(__file__.replace(".py", ".jsonl")).hub_id is None  # a local path that is gone: no Hub id
    assert (
        lenient("org/data:subset").label("phase2") == "org/data"
        and lenient(__file__).label("phase1") == Path(__file__).name
    )


def test_distill_section_says_what_the_folder_holds() -> None:
    settings = {"teacher_model": "big/teacher", "student_model": "small/student"}
    assert "`small/student` (32-d)." in distill_section(settings, "", {"student": 32})
    cut = StudentDescription("small/student", None, done="cut to 3 evenly spaced layers")  # as its kind says it
    pruned = distill_section({**settings, "student_num_layers": 3}, "", {"student": 32}, student=cut)
    assert "`small/student` cut to 3 evenly spaced layers (32-d)" in pruned  # not the whole model it started from
    # a projection to the student's own width still maps into the teacher's space
    assert "(48-d, projected to the teacher's 48-d)." in distill_section(settings, "", {"student": 48, "output": 48})
    assert "projected" not in distill_section(settings, "", {"student": 32})


def test_the_card_says_what_trained_each_phase_and_what_it_added() -> None:
    figures = {
        "phases": {
            "phase1": {"terms": {"cosine": 1.0, "mse": 1.0}, "added": {"ndcg@10": 0.0607}},
            "phase2": {"terms": {"similarity_kl": 1.0, "mnrl": 1.0}, "added": {"ndcg@10": 0.0251}},
        }
    }
    assert phases_sentence(figures) == (
        "Phase 1 trained on cosine, squared distance (+0.0607 nDCG@10); phase 2 trained on the teacher's in-batch "
        "similarities (KL), the pairs' own labels (MultipleNegativesRankingLoss) (+0.0251 nDCG@10)."
    )
    assert phases_sentence({}) == ""
    # phase 2's hard negatives: the sentence and the dataset's columns name them
    figures["phases"]["phase2"]["negatives"] = {"per_query": 1, "from": "mined by the teacher"}
    assert phases_sentence(figures).endswith(
        "the pairs' own labels (MultipleNegativesRankingLoss), with 1 hard negative per query (mined by the teacher) "
        "(+0.0251 nDCG@10)."
    )
    mined = train_datasets(SETTINGS, {**RESULTS, "phases": figures["phases"]})
    assert mined[1]["columns"] == ["query", "passage", "negative_1"]
    entries = train_datasets({**SETTINGS, "mnrl_weight": 1.0, "mnrl_margin": 0.0}, RESULTS)
    assert entries[1]["loss"]["fullname"] == "distill.losses.similarity_kl_loss + MultipleNegativesRankingLoss"
    assert '"mnrl_margin": 0.0' in entries[1]["loss"]["config_code"]
    assert train_datasets({**SETTINGS, "mnrl_weight": 0.0}, RESULTS)[1]["loss"]["fullname"] == (
        "distill.losses.similarity_kl_loss"
    )
