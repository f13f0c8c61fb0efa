"""The reranker teacher: a cross-encoder's scores of each phase-2 query's candidates, loaded here or served.

The served reranker is a real HTTP server on a free port (tests/embeddings_server.py's `RerankServer`), answering
the rerank protocol with a tiny cross-encoder's logits; a proxy in front of it injects faults.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from embeddings_server import FaultProxy, RerankServer
from sentence_transformers import SentenceTransformer
from sentence_transformers.cross_encoder import CrossEncoder

import distill.stages.targets as teacher_module
import distill.teachers.endpoint as endpoint_module
from conftest import sentences, tiny_run_flags
from distill.config import load_config
from distill.errors import DistillError
from distill.losses import LossWeights, reranker_loss
from distill.stages.targets import TeacherCache
from distill.teachers import TeacherContext
from distill.teachers.rerank_endpoint import RerankEndpoint
from distill.teachers.reranker import CrossEncoderTeacher, candidate_pairs, split_pair
from distill.train import main

KEY = "sk-distill-rerank-test-0123456789"  # what the tests' server requires; it must never reach a file


@pytest.fixture(scope="module")
def rerank_server(tiny_reranker):
    with RerankServer(tiny_reranker, "tiny-reranker", key=KEY) as server:
        yield server


@pytest.fixture
def key(monkeypatch):
    monkeypatch.setenv("DISTILL_RERANK_KEY", KEY)
    monkeypatch.setattr("distill.teachers.endpoint.TIMEOUT_S", 2.0)
    return "DISTILL_RERANK_KEY"


def some_pairs(count: int, seed: int) -> list[str]:
    """`count` queries x 3 candidates, as the reranker stage builds them."""
    queries, passages = sentences(count, seed), sentences(2 * count, seed + 1)
    rows = np.random.default_rng(seed).integers(0, len(passages), size=(count, 3))
    return candidate_pairs(queries, passages, rows)


def logits(model: Path, pairs: list[str]) -> np.ndarray:
    """The cross-encoder's own raw scores of the pairs."""
    return CrossEncoder(str(model), device="cpu").predict(
        [split_pair(p) for p in pairs], activation_fn=torch.nn.Identity()
    )


def scores(accelerator, source, pairs: list[str], cache: Path) -> np.ndarray:
    return np.asarray(TeacherCache(accelerator, source, cache, 8).embeddings(pairs, "pair"), dtype=np.float32)[:, 0]


def test_a_pair_is_keyed_unambiguously() -> None:
    assert split_pair(candidate_pairs(['a "b', "c"], ["d\\", "e"], np.array([[0], [1]]))[0]) == ('a "b', "d\\")
    assert candidate_pairs(["ab"], ["c"], np.array([[0]])) != candidate_pairs(["a"], ["bc"], np.array([[0]]))


def test_a_local_cross_encoder_gives_its_own_logits(accelerator, tiny_reranker, tmp_path) -> None:
    pairs = some_pairs(10, seed=3)
    source = CrossEncoderTeacher(str(tiny_reranker), TeacherContext("cpu"))
    got = scores(accelerator, source, pairs, tmp_path / "cache")
    np.testing.assert_allclose(got, logits(tiny_reranker, pairs), atol=2e-3)  # float16 in the cache
    assert got.std() > 0  # real scores, not a constant
    again = CrossEncoderTeacher(str(tiny_reranker), TeacherContext("cpu"))
    np.testing.assert_array_equal(scores(accelerator, again, pairs, tmp_path / "cache"), got)
    assert again.model is None  # found in the cache: not loaded


def test_a_served_reranker_gives_the_scores_of_the_model_it_serves(
    accelerator, tiny_reranker, rerank_server, key, tmp_path
) -> None:
    pairs = some_pairs(12, seed=4)
    asked = len(rerank_server.requests)
    got = scores(accelerator, RerankEndpoint("tiny-reranker", rerank_server.url, key), pairs, tmp_path / "cache")
    np.testing.assert_allclose(got, logits(tiny_reranker, pairs), atol=2e-3)
    requests = rerank_server.requests[asked:]
    assert all(r["authorization"] == f"Bearer {KEY}" for r in requests)  # the key came from the environment
    # one request per query: its candidates go together
    assert len(requests) == 12 and all(len(r["body"]["documents"]) == 3 for r in requests)


def test_transient_faults_are_retried_and_give_the_same_scores(accelerator, rerank_server, key, tmp_path) -> None:
    pairs = some_pairs(8, seed=5)
    clean = scores(accelerator, RerankEndpoint("tiny-reranker", rerank_server.url, key), pairs, tmp_path / "clean")
    with FaultProxy(rerank_server.url) as proxy:
        proxy.plan.extend([("status", 429, {"Retry-After": "0.2"}), ("status", 500), ("drop",), ("status", 503)])
        faulty = scores(accelerator, RerankEndpoint("tiny-reranker", proxy.url, key), pairs, tmp_path / "faulty")
        assert not proxy.plan and proxy.seen > proxy.forwarded  # every fault met, then retried
    np.testing.assert_array_equal(faulty, clean)


@pytest.mark.parametrize(
    ("fault", "message"),
    [(("status", 401), r"answered 401 \("), (("malformed",), r"answered what is not a rerank response")],
)
def test_a_permanent_fault_stops_with_one_line_naming_the_endpoint(
    accelerator, rerank_server, key, tmp_path, fault, message
) -> None:
    with FaultProxy(rerank_server.url) as proxy:
        proxy.plan.append(fault)
        source = RerankEndpoint("tiny-reranker", proxy.url, key)
        with pytest.raises(
            DistillError, match=rf"^reranker endpoint {proxy.url} \(model 'tiny-reranker'\) .*{message}"
        ):
            scores(accelerator, source, some_pairs(4, seed=6), tmp_path / "cache")


def test_a_stopped_scoring_resumes_from_its_cached_blocks_without_asking_again(
    accelerator, rerank_server, key, tmp_path, monkeypatch
) -> None:
    """Stopped after some blocks (the endpoint starts refusing), the next run asks for no pair of a finished block."""
    monkeypatch.setattr(teacher_module, "BLOCK_ROWS_PER_PROCESS", 6)  # a mark every 2 queries' pairs
    monkeypatch.setattr(endpoint_module, "IN_FLIGHT", 1)
    monkeypatch.setattr("distill.teachers.rerank_endpoint.IN_FLIGHT", 1)  # one request at a time: the count is exact
    pairs = some_pairs(10, seed=7)  # 30 pairs, one request of 3 per query
    with FaultProxy(rerank_server.url) as proxy:
        proxy.fail_after = 5  # 5 queries' requests get through, then every request is refused
        with pytest.raises(DistillError, match="answered 401"):
            scores(accelerator, RerankEndpoint("tiny-reranker", proxy.url, key), pairs, tmp_path / "cache")
        assert proxy.forwarded == 5
        proxy.fail_after = None
        resumed = scores(accelerator, RerankEndpoint("tiny-reranker", proxy.url, key), pairs, tmp_path / "cache")
        # blocks of 6 pairs: two finished blocks (4 queries) were marked; the 5th query's pairs are asked again
        assert proxy.forwarded - 5 == 10 - 4
    clean = scores(accelerator, RerankEndpoint("tiny-reranker", rerank_server.url, key), pairs, tmp_path / "clean")
    np.testing.assert_array_equal(resumed, clean)


def test_the_ranking_losses_are_sentence_transformers_own_on_cosines_over_the_temperature() -> None:
    torch.manual_seed(0)
    batch, ways, dim = 4, 3, 8
    queries = torch.randn(batch, dim, requires_grad=True)
    passages = torch.randn(batch * ways, dim)
    teacher = torch.randn(batch, ways) * 3
    candidates = torch.stack([passages[:batch], *passages[batch:].reshape(batch, ways - 1, dim).unbind(1)], 1)
    student = torch.nn.functional.cosine_similarity(queries[:, None], candidates, dim=-1) / 0.05
    weights = LossWeights(temperature=0.05, reranker_temperature=2.0, reranker=1.0)
    kl = torch.nn.functional.kl_div(
        student.log_softmax(-1), (teacher / 2.0).softmax(-1), reduction="batchmean", log_target=False
    )
    assert reranker_loss(queries, passages, teacher, weights).item() == pytest.approx(kl.item(), rel=1e-5)
    margin = weights.__class__(temperature=0.05, reranker_temperature=2.0, reranker_loss="margin_mse")
    expected = ((student[:, :1] - student[:, 1:]) - (teacher[:, :1] - teacher[:, 1:]) / 2.0).pow(2).mean()
    loss = reranker_loss(queries, passages, teacher, margin)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    loss.backward()
    assert queries.grad is not None and queries.grad.abs().sum() > 0
    # Matryoshka: the mean over the dims, each truncated and re-normalised
    at = [reranker_loss(queries[:, :d], passages[:, :d], teacher, weights).item() for d in (8, 4)]
    assert reranker_loss(queries, passages, teacher, weights, dims=[8, 4]).item() == pytest.approx(np.mean(at))


def test_reranker_options_need_a_reranker_and_phase_2() -> None:
    with pytest.raises(DistillError, match=r"reranker_loss: applies only to a reranker teacher; pass --reranker_model"):
        load_config(["--reranker_loss", "margin_mse"])
    with pytest.raises(DistillError, match=r"reranker_model: .* --skip_phase2 skips phase 2"):
        load_config(["--reranker_model", "x", "--skip_phase2"])


@pytest.mark.e2e
def test_a_run_without_negatives_says_how_to_get_candidates(tiny_models, tiny_reranker, tmp_path, capsys) -> None:
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(
        "".join(json.dumps({"query": q, "passage": p}) + "\n" for q, p in zip(sentences(64, 1), sentences(64, 2)))
    )
    flags = tiny_run_flags(tiny_models, {"texts": pairs, "pairs": pairs}, tmp_path / "run", skip_phase1=True)
    assert main([*flags, "--reranker_model", str(tiny_reranker)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "error: reranker_model: each query needs candidates beside its positive, and the phase-2 data has no "
        "negatives; pass --mine_hard_negatives N (or data with negatives)"
    ]


@pytest.mark.e2e
def test_a_run_with_a_served_reranker_trains_exports_and_names_both_teachers(
    tiny_models, tiny_data, tiny_reranker, rerank_server, key, tmp_path
) -> None:
    """Phase 2 learns the reranker's scores of each query's positive and negative (the data's); the exported student
    loads in plain sentence-transformers, its card names both teachers, and no file holds the key."""
    out = tmp_path / "run"
    reranker = ["--reranker_model", "tiny-reranker", "--reranker_base_url", rerank_server.url]
    flags = tiny_run_flags(tiny_models, tiny_data, out, save_to_artifacts=True)
    assert main([*flags, *reranker, "--reranker_api_key_env", key]) == 0
    results = json.loads((out / "results.json").read_text())
    queries = results["phases"]["phase2"]["examples"]
    assert results["reranker"] == {
        "model": "tiny-reranker",
        "pairs": 2 * queries,
        "seconds": pytest.approx(results["reranker"]["seconds"]),
        "loss": "kl_div",
    }
    model = SentenceTransformer(str(out / "artifacts" / "model"), device="cpu")
    assert model.encode(["a river"]).shape == (1, 48)
    card = (out / "artifacts" / "model" / "README.md").read_text()
    assert f"teacher `{tiny_models['teacher']}`" in card and "reranker `tiny-reranker`" in card
    written = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert written and not any(KEY.encode() in p.read_bytes() for p in written)
