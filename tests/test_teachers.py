"""The teachers users have besides a model loaded here: an OpenAI-compatible endpoint and vectors computed before.

The endpoint is a real HTTP server started by the test on a free port (tests/embeddings_server.py), serving the
shipped all-MiniLM-L6-v2 or a tiny model with OpenAI's request and response schema; faults are injected by a
proxy in front of it.
"""

from __future__ import annotations

import base64
import json
import os
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch
from accelerate import Accelerator
from embeddings_server import EmbeddingsServer, FaultProxy
from safetensors.torch import load_file

import distill.stages.targets as teacher_module
import distill.teachers.endpoint as endpoint_module
import distill.teachers.vectors as vectors_module
from conftest import sentences, teacher_spec, tiny_run_flags
from distill.config import load_config
from distill.errors import DistillError
from distill.files import drop_pages
from distill.hub import resolve_model
from distill.pipeline import teacher_context
from distill.stages.targets import TeacherCache
from distill.teachers.endpoint import EndpointTeacher
from distill.teachers.local import LocalTeacher, TeacherSpec
from distill.teachers.vectors import VectorsTeacher, read_vectors
from distill.train import main

KEY = "sk-distill-test-0123456789abcdef"  # what the tests' server requires; it must never reach a file


@pytest.fixture(scope="module")
def tiny_server(tiny_models):
    with EmbeddingsServer(tiny_models["teacher"], "tiny-teacher", key=KEY) as server:
        yield server


@pytest.fixture
def key(monkeypatch):
    monkeypatch.setenv("DISTILL_TEST_KEY", KEY)
    monkeypatch.setattr(endpoint_module, "TIMEOUT_S", 2.0)  # the timeout fault waits longer than this
    return "DISTILL_TEST_KEY"


def endpoint_cache(accelerator: Accelerator, url: str, key_env: str, cache_dir: Path, **kwargs) -> TeacherCache:
    teacher = EndpointTeacher("tiny-teacher", url, key_env, **kwargs)
    return TeacherCache(accelerator, teacher, cache_dir, batch_size=8)


def local_vectors(accelerator: Accelerator, model: Path, texts: list[str], cache_dir: Path) -> np.ndarray:
    spec = teacher_spec(accelerator.device, teacher_model=str(model))
    return np.asarray(TeacherCache(accelerator, LocalTeacher(spec), cache_dir, 8).embeddings(texts, "document"))


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(
        f"{url}/embeddings",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"},
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


def test_the_test_server_answers_with_openais_own_schema(tiny_server) -> None:
    """The stand-in is held to the `openai` package's own types, for float and base64 vectors alike."""
    from openai.types import CreateEmbeddingResponse, EmbeddingCreateParams

    body: EmbeddingCreateParams = {"model": "tiny-teacher", "input": ["a river.", "the old stone"]}
    floats = CreateEmbeddingResponse.model_validate(post(tiny_server.url, dict(body, encoding_format="float")))
    packed = post(tiny_server.url, dict(body, encoding_format="base64"))
    CreateEmbeddingResponse.model_validate({**packed, "data": [{**d, "embedding": [0.0]} for d in packed["data"]]})
    decoded = [np.frombuffer(base64.b64decode(d["embedding"]), dtype=np.float32) for d in packed["data"]]
    assert [d.index for d in floats.data] == [0, 1] and floats.usage.total_tokens > 0
    np.testing.assert_allclose(np.array([d.embedding for d in floats.data]), np.array(decoded), atol=1e-7)


def test_an_endpoint_teacher_gives_the_vectors_of_the_model_it_serves(
    accelerator, tiny_models, tiny_server, key, tmp_path
) -> None:
    texts = sentences(45, seed=21)
    served = endpoint_cache(accelerator, tiny_server.url, key, tmp_path / "cache").embeddings(texts, "document")
    local = local_vectors(accelerator, tiny_models["teacher"], texts, tmp_path / "local")
    np.testing.assert_allclose(np.asarray(served, np.float32), local.astype(np.float32), atol=1e-3)  # float16 apart
    assert all(r["authorization"] == f"Bearer {KEY}" for r in tiny_server.requests)  # the key came from the env


def test_requests_keep_to_the_texts_and_tokens_per_request(key) -> None:
    teacher = EndpointTeacher("m", "http://127.0.0.1:9/v1", key, request_texts=4)
    lengths = np.array([10] * 10 + [3 * endpoint_module.REQUEST_TOKENS] * 2)  # two texts each over the token budget
    requests = teacher.requests(list(range(12)), lengths)
    assert [len(r) for r in requests] == [4, 4, 2, 1, 1] and sum(requests, []) == list(range(12))


def test_transient_faults_are_retried_and_give_the_same_vectors(
    accelerator, tiny_server, key, tmp_path, monkeypatch
) -> None:
    texts = sentences(20, seed=5)
    clean = endpoint_cache(accelerator, tiny_server.url, key, tmp_path / "clean").embeddings(texts, "document")
    with FaultProxy(tiny_server.url) as proxy:
        proxy.plan.extend(
            [("status", 429, {"Retry-After": "0.2"}), ("status", 500), ("drop",), ("sleep", 3.0), ("status", 503)]
        )
        faulty = endpoint_cache(accelerator, proxy.url, key, tmp_path / "faulty").embeddings(texts, "document")
        assert not proxy.plan and proxy.seen > proxy.forwarded  # every fault met, then retried
    np.testing.assert_array_equal(np.asarray(faulty), np.asarray(clean))


@pytest.mark.parametrize("status", [400, 413, 422])  # what docs/usage.md promises
def test_a_request_refused_as_too_large_is_sent_again_in_halves(
    accelerator, tiny_models, key, tmp_path, monkeypatch, status
) -> None:
    """A server taking at most 3 texts a request: 8 texts are refused, their halves of 4 too, the quarters of 2 go
    through; the vectors are those of requests the server took whole."""
    monkeypatch.setattr(endpoint_module, "IN_FLIGHT", 1)  # one request at a time: the order is exact
    texts = sentences(16, seed=8)
    with EmbeddingsServer(tiny_models["teacher"], "tiny-teacher", max_inputs=3, too_large=status) as server:
        cache = endpoint_cache(accelerator, server.url, key, tmp_path / "small", request_texts=8)
        halved = cache.embeddings(texts, "document")
        sizes = [len(r["body"]["input"]) for r in server.requests]
    with EmbeddingsServer(tiny_models["teacher"], "tiny-teacher") as server:
        expected = endpoint_cache(accelerator, server.url, key, tmp_path / "whole", request_texts=2).embeddings(
            texts, "document"
        )
    assert sizes == [8, 4, 2, 2, 4, 2, 2] * 2  # each request of 8: refused, its halves refused, its quarters taken
    np.testing.assert_array_equal(np.asarray(halved), np.asarray(expected))


def test_a_refused_single_text_is_not_halved_but_stops_with_one_line(accelerator, tiny_models, key, tmp_path) -> None:
    with EmbeddingsServer(tiny_models["teacher"], "tiny-teacher", max_inputs=0, too_large=413) as server:
        cache = endpoint_cache(accelerator, server.url, key, tmp_path / "cache", request_texts=2)
        with pytest.raises(DistillError, match=r"answered 413 \(.*at most 0 inputs a request"):
            cache.embeddings(sentences(4, seed=8), "document")


def test_teacher_dimensions_are_asked_for_and_key_the_cache(accelerator, tiny_server, key, tmp_path) -> None:
    """--teacher_dimensions reaches the request as `dimensions`, sets the vectors' width, and keys the cache: the same
    texts at another width are a cache entry of their own."""
    texts = sentences(12, seed=4)
    config = load_config(
        ["--teacher_model", "openai/tiny-teacher", "--teacher_base_url", tiny_server.url, "--teacher_api_key_env", key]
        + ["--student_model", "s", "--use_projection", "True", "--teacher_dimensions", "16"]
    ).teacher
    teacher = EndpointTeacher.from_config("openai/tiny-teacher", config)
    assert teacher.dimensions == 16
    narrow = TeacherCache(accelerator, teacher, tmp_path / "cache", 8)
    asked = len(tiny_server.requests)  # the module's server: earlier tests' requests come first
    vectors = np.asarray(narrow.embeddings(texts, "document"), dtype=np.float32)
    assert vectors.shape == (12, 16)
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-3)  # the first 16, normalised again
    assert {r["body"].get("dimensions") for r in tiny_server.requests[asked:]} == {16}
    full = endpoint_cache(accelerator, tiny_server.url, key, tmp_path / "cache")
    assert full.key(texts, "document") != narrow.key(texts, "document")
    assert np.asarray(full.embeddings(texts, "document")).shape == (12, 48)  # not the 16-d entry read back
    again = endpoint_cache(accelerator, tiny_server.url, key, tmp_path / "cache", dimensions=16)
    assert again.key(texts, "document") == narrow.key(texts, "document")


@pytest.mark.parametrize(
    ("fault", "message"),
    [
        (("status", 401), r"answered 401 \("),
        (("status", 404), r"answered 404 \("),
        (("wrong_dim",), r"answered vectors of 4[78] dimensions \(earlier answers had 4[78]\)"),
        (("wrong_count",), r"answered 3 vectors for 4 texts"),
        (("malformed",), r"answered what is not an embeddings response"),
    ],
)
def test_a_permanent_fault_stops_with_one_line_naming_the_endpoint(
    accelerator, tiny_server, key, tmp_path, fault, message
) -> None:
    with FaultProxy(tiny_server.url) as proxy:
        if fault[0] == "wrong_dim":
            proxy.plan.append(("forward",))  # a first answer sets the width
        proxy.plan.append(fault)
        cache = endpoint_cache(accelerator, proxy.url, key, tmp_path / "cache", request_texts=4)
        with pytest.raises(DistillError, match=rf"^teacher endpoint {proxy.url} \(model 'tiny-teacher'\) .*{message}"):
            cache.embeddings(sentences(16, seed=6), "document")


def test_a_stopped_encoding_resumes_from_its_cached_blocks_without_asking_again(
    accelerator, tiny_server, key, tmp_path, monkeypatch
) -> None:
    """Killed after some blocks (here: the endpoint starts refusing), the next run asks only for the rest."""
    monkeypatch.setattr(teacher_module, "BLOCK_ROWS_PER_PROCESS", 8)  # a mark every 8 texts
    monkeypatch.setattr(endpoint_module, "IN_FLIGHT", 1)  # one request at a time: the count is exact
    texts = sentences(40, seed=9)
    with FaultProxy(tiny_server.url) as proxy:
        proxy.fail_after = 3  # 3 requests of 4 texts get through, then every request is refused
        teacher = EndpointTeacher("tiny-teacher", proxy.url, key, request_texts=4)
        with pytest.raises(DistillError, match="answered 401"):
            TeacherCache(accelerator, teacher, tmp_path / "cache", 8).embeddings(texts, "document")
        done = proxy.forwarded
        assert done == 3
        proxy.fail_after = None
        teacher = EndpointTeacher("tiny-teacher", proxy.url, key, request_texts=4)
        resumed = TeacherCache(accelerator, teacher, tmp_path / "cache", 8).embeddings(texts, "document")
        # the first block (8 texts, 2 requests) was marked done: only the texts after it are asked for
        assert proxy.forwarded - done == (40 - 8) // 4
    clean = endpoint_cache(accelerator, tiny_server.url, key, tmp_path / "clean").embeddings(texts, "document")
    np.testing.assert_array_equal(np.asarray(resumed), np.asarray(clean))


@pytest.mark.slow
def test_a_run_whose_teacher_is_an_endpoint_trains_the_student_the_model_itself_trains(
    tiny_models, tiny_data, key, tmp_path
) -> None:
    """all-MiniLM-L6-v2 served over HTTP and loaded here give the same student; the key is in no file written.

    Both encode one text at a time (--teacher_batch_size 1, and the server likewise): a matmul's last bits depend on
    its batch's shape, and 0.3% of the float16 vectors' values then differ by one step, which Adam's normalised
    updates carry into the weights (7.5e-5 apart after these steps, measured). With the same shapes the vectors are
    the same bits.
    """
    minilm = resolve_model("sentence-transformers/all-MiniLM-L6-v2")
    common = {
        "max_samples_phase1": 64,
        "max_samples_phase2": 48,
        "save_to_artifacts": True,
        "max_seq_length": 32,
        "teacher_batch_size": 1,
    }
    local_out, served_out = tmp_path / "local", tmp_path / "served"
    assert main(tiny_run_flags(tiny_models, tiny_data, local_out, teacher_model=minilm, **common)) == 0
    with EmbeddingsServer(Path(minilm), "all-MiniLM-L6-v2", max_seq_length=32, key=KEY, batch_size=1) as server:
        flags = tiny_run_flags(
            tiny_models,
            tiny_data,
            served_out,
            teacher_model="openai/all-MiniLM-L6-v2",
            teacher_base_url=server.url,
            teacher_api_key_env=key,
            **common,
        )
        assert main(flags) == 0
    local_entries, served_entries = (cache_entries_in_order(out / "cache") for out in (local_out, served_out))
    assert len(local_entries) == len(served_entries) > 0
    for local, served in zip(local_entries, served_entries):
        np.testing.assert_array_equal(np.load(served), np.load(local))
    local_weights = load_file(str(local_out / "artifacts" / "model" / "model.safetensors"))
    served_weights = load_file(str(served_out / "artifacts" / "model" / "model.safetensors"))
    assert max((local_weights[k] - served_weights[k]).abs().max().item() for k in local_weights) <= 1e-5
    results = json.loads((served_out / "results.json").read_text())
    assert results["config"]["teacher_model"] == "openai/all-MiniLM-L6-v2" and not results["teacher_loaded"]
    for path in [p for p in served_out.rglob("*") if p.is_file()]:
        assert KEY.encode() not in path.read_bytes(), path


def cache_entries_in_order(cache_dir: Path) -> list[Path]:
    """A run's cache entries in the order it wrote them (both runs encode the same lists in the same order)."""
    return sorted(cache_dir.glob("*/embeddings.npy"), key=lambda path: path.stat().st_mtime_ns)


def write_vectors(folder: Path, texts: list[str], vectors: np.ndarray, kind: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    if kind == "jsonl":
        path = folder / "vectors.jsonl"
        path.write_text(
            "".join(json.dumps({"text": t, "embedding": v.tolist()}) + "\n" for t, v in zip(texts, vectors))
        )
    elif kind == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        path = folder / "vectors.parquet"
        pq.write_table(pa.table({"text": texts, "embedding": [v.tolist() for v in vectors]}), path)
    elif kind == "npy":
        path = folder / "vectors.npy"
        np.save(path, vectors.astype(np.float32))
        path.with_suffix(".txt").write_text("\n".join(texts) + "\n")
    else:  # a folder
        np.save(folder / "embeddings.npy", vectors)
        (folder / "texts.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
        path = folder
    return path


@pytest.mark.parametrize("kind", ["jsonl", "parquet", "npy", "folder"])
def test_every_vectors_format_reads_back_its_texts_and_vectors(tmp_path, kind, monkeypatch) -> None:
    """A .parquet or .jsonl file goes through its streamed copy, 3 rows at a time here: every chunk lands in its
    place, and the copy is memory-mapped."""
    monkeypatch.setattr(vectors_module, "CHUNK_ROWS", 3)
    broken = "\n" if kind != "npy" else " "  # a .txt beside an .npy holds a text per line
    texts = [*sentences(6, seed=2), f'a text with a "quote"{broken}and a line break']
    vectors = np.random.default_rng(0).standard_normal((7, 5)).astype(np.float32)
    read_texts, read = read_vectors(write_vectors(tmp_path / "in", texts, vectors, kind), tmp_path / "files")
    assert read_texts == texts
    np.testing.assert_array_equal(np.asarray(read, dtype=np.float32), vectors)
    streamed = kind in ("jsonl", "parquet")
    assert isinstance(read, np.memmap) and (list((tmp_path / "files").glob("*/embeddings.npy")) != []) == streamed


@pytest.mark.parametrize("kind", ["jsonl", "parquet"])
def test_a_streamed_vectors_file_of_uneven_widths_is_one_line(tmp_path, kind, monkeypatch) -> None:
    """Uneven widths, in one chunk or across two, are one error line, and no half-written copy stays behind."""
    monkeypatch.setattr(vectors_module, "CHUNK_ROWS", 2)
    folder = tmp_path / "in"
    folder.mkdir()
    rows = [{"text": f"text {i}", "embedding": [0.5] * (4 if i < 3 else 5)} for i in range(5)]
    if kind == "jsonl":
        path = folder / "v.jsonl"
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        path = folder / "v.parquet"
        pq.write_table(pa.Table.from_pylist(rows), path)
    with pytest.raises(DistillError, match=r"^teacher_vectors: .* not all of one width|holds no list of numbers"):
        read_vectors(path, tmp_path / "files")
    assert list((tmp_path / "files").iterdir()) == []


def test_a_texts_file_is_read_a_chunk_at_a_time_as_splitlines_cuts_it(tmp_path, monkeypatch) -> None:
    """Chunks of 3 characters end inside lines, between a CR and its LF, and on a line break: the lines are
    `read_text().splitlines()`'s, and a vectors teacher finds each run text's row by its digest (the first of
    repeats, whitespace collapsed), -1 where the file lacks it."""
    monkeypatch.setattr(vectors_module, "LINE_CHUNK_CHARS", 3)
    path = tmp_path / "texts.txt"
    path.write_bytes("one\r\ntwo  words\n\nthree\rfour\u2028five\r\nsix\nfour\n seven ".encode())
    assert list(vectors_module.file_texts(path)) == path.read_text(encoding="utf8").splitlines()
    np.save(tmp_path / "texts.npy", np.eye(9, dtype=np.float32))
    teacher = VectorsTeacher(str(tmp_path / "texts.npy"), caches=None)
    rows = teacher.rows(["four", "two words", "seven", "missing", "one", ""])
    np.testing.assert_array_equal(rows, [4, 1, 8, -1, 0, 2])
    (tmp_path / "texts.jsonl").write_text('{"text": "a"}\n\n{"text": "b\\nc"}\n')
    assert list(vectors_module.file_texts(tmp_path / "texts.jsonl")) == ["a", "b\nc"]


def test_dropping_a_maps_pages_keeps_what_was_written(tmp_path) -> None:
    """A written shared map's pages leave the process and its data stays (in the file); a private copy-on-write
    map, whose changes live only in the process, is left alone."""
    written = np.lib.format.open_memmap(tmp_path / "a.npy", mode="w+", dtype=np.float32, shape=(4096, 64))
    written[:] = np.arange(64, dtype=np.float32)
    drop_pages(written[10:20])  # a view finds its map
    assert float(written[4095, 63]) == 63.0
    written.flush()
    del written
    np.testing.assert_array_equal(np.load(tmp_path / "a.npy")[-1], np.arange(64, dtype=np.float32))
    private = np.load(tmp_path / "a.npy", mmap_mode="c")
    private[0, 0] = -1.0
    drop_pages(private)
    assert float(private[0, 0]) == -1.0
    drop_pages(np.zeros(3))  # not a map: nothing to do


def test_a_vectors_file_is_streamed_once_and_read_back_by_a_later_run(tmp_path, monkeypatch) -> None:
    """The streamed copy is keyed by the file: a second read streams nothing; a changed file is streamed again."""
    texts = sentences(5, seed=4)
    vectors = np.random.default_rng(1).standard_normal((5, 3)).astype(np.float32)
    path = write_vectors(tmp_path / "in", texts, vectors, "parquet")
    streamed = []
    real = vectors_module._stream_parquet
    monkeypatch.setattr(vectors_module, "_stream_parquet", lambda *a: streamed.append(1) or real(*a))
    read_vectors(path, tmp_path / "files")
    read_vectors(path, tmp_path / "files")
    assert streamed == [1]
    write_vectors(tmp_path / "in", texts, 2 * vectors, "parquet")
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))
    np.testing.assert_array_equal(read_vectors(path, tmp_path / "files")[1], 2 * vectors)
    assert streamed == [1, 1]


def test_a_vectors_teacher_serves_its_file_and_names_what_it_lacks(accelerator, tiny_models, tmp_path) -> None:
    texts = sentences(30, seed=3)
    local = local_vectors(accelerator, tiny_models["teacher"], texts, tmp_path / "local").astype(np.float32)
    path = write_vectors(tmp_path / "file", texts[:25], local[:25], "parquet")

    def caches(source):
        return TeacherCache(accelerator, source, tmp_path / "cache", batch_size=8)

    served = caches(VectorsTeacher(str(path), caches)).embeddings(texts[:25], "document")
    np.testing.assert_allclose(np.asarray(served, np.float32), local[:25], atol=1e-3)
    with pytest.raises(DistillError, match=rf"^teacher_vectors: 5 query texts of this run are not in {path}"):
        caches(VectorsTeacher(str(path), caches)).embeddings(texts, "query")
    # with a model to fill them, the model encodes the 5 it lacks, cached under its own key
    spec = teacher_spec(accelerator.device, teacher_model=str(tiny_models["teacher"]))
    filled = caches(VectorsTeacher(str(path), caches, fill=LocalTeacher(spec))).embeddings(texts, "query")
    np.testing.assert_allclose(np.asarray(filled, np.float32), local, atol=1e-3)


def test_a_run_on_vectors_alone_trains_as_the_model_that_made_them(tiny_models, tiny_data, tmp_path) -> None:
    """Vectors of every text of the run, written by the teacher beforehand, stand in for it: no model is loaded."""
    model_out, vectors_out = tmp_path / "model", tmp_path / "vectors"
    common = {"max_samples_phase1": 48, "max_samples_phase2": 32, "save_to_artifacts": True, "efficiency_texts": 0}
    assert main(tiny_run_flags(tiny_models, tiny_data, model_out, **common)) == 0
    config = load_config(tiny_run_flags(tiny_models, tiny_data, model_out, **common))
    from distill.data import load_data
    from distill.data.containers import passage_texts

    data = load_data(config.data, config.training.seed)
    all_texts = data.phase1_texts + data.phase2.queries + passage_texts(data.phase2)[0]
    all_texts += data.evaluation.queries + data.evaluation.corpus
    spec = TeacherSpec.from_config(config.teacher, teacher_context(config, torch.device("cpu")))
    accelerator = Accelerator(cpu=True)
    unique = list(dict.fromkeys(all_texts))
    encoded = local_vectors(accelerator, tiny_models["teacher"], unique, tmp_path / "encode")
    assert spec.query_prompt == spec.document_prompt == ""  # one vector per text serves every role
    path = write_vectors(tmp_path / "file", unique, encoded.astype(np.float32), "npy")
    flags = tiny_run_flags(tiny_models, tiny_data, vectors_out, teacher_vectors=path, **common)
    flags[flags.index("--teacher_model") : flags.index("--teacher_model") + 2] = []
    assert main(flags) == 0
    results = json.loads((vectors_out / "results.json").read_text())
    assert not results["teacher_loaded"]
    model_results = json.loads((model_out / "results.json").read_text())
    assert results["teacher"]["ndcg@10"] == pytest.approx(model_results["teacher"]["ndcg@10"], abs=0.02)
    assert results["student_after"]["ndcg@10"] == pytest.approx(model_results["student_after"]["ndcg@10"], abs=0.05)


def test_two_teachers_combine_as_their_weighted_unit_vectors_each_cached_on_its_own(
    accelerator, tiny_models, tmp_path
) -> None:
    """sqrt(w)-scaled unit vectors concatenated: the combination's cosines are the weighted mean of the members'."""
    from distill.teachers.ensemble import EnsembleTeacher

    def caches(source):
        return TeacherCache(accelerator, source, tmp_path / "cache", batch_size=8)

    def local(name: str) -> LocalTeacher:
        return LocalTeacher(teacher_spec(accelerator.device, teacher_model=str(tiny_models[name])))

    texts = sentences(20, seed=4)
    first = local_vectors(accelerator, tiny_models["teacher"], texts, tmp_path / "a").astype(np.float32)
    second = local_vectors(accelerator, tiny_models["wide_student"], texts, tmp_path / "b").astype(np.float32)
    ensemble = EnsembleTeacher([local("teacher"), local("wide_student")], [1.0, 3.0], caches)
    combined = np.asarray(caches(ensemble).embeddings(texts, "document"), dtype=np.float32)
    assert combined.shape == (20, 48 + 64)
    expected = 0.25 * first @ first.T + 0.75 * second @ second.T
    np.testing.assert_allclose(combined @ combined.T, expected, atol=3e-3)
    entries = len(list((tmp_path / "cache").glob("*/embeddings.npy")))
    assert entries == 3  # each member's entry, and the combination's
    # a third member encodes only itself: the two cached ones are read back
    more = EnsembleTeacher([local("teacher"), local("wide_student"), local("student")], [1.0, 1.0, 1.0], caches)
    caches(more).embeddings(texts, "document")
    assert not more.members[0].loaded and not more.members[1].loaded and more.members[2].loaded


def test_a_run_with_two_teachers_scores_each_and_the_combination(tiny_models, tiny_data, tmp_path) -> None:
    out = tmp_path / "ensemble"
    teachers = f"{tiny_models['teacher']},{tiny_models['wide_student']}"
    flags = tiny_run_flags(
        tiny_models,
        tiny_data,
        out,
        teacher_model=teachers,
        teacher_weights="0.3,0.7",
        use_projection=False,
        max_samples_phase1=64,
        max_samples_phase2=48,
        efficiency_texts=16,
    )
    assert main(flags) == 0
    results = json.loads((out / "results.json").read_text())
    assert set(results["teachers"]) == {str(tiny_models["teacher"]), str(tiny_models["wide_student"])}
    assert all("ndcg@10" in metrics for metrics in results["teachers"].values())
    assert results["efficiency"]["teacher"]["dim"] == 48 + 64
    assert results["efficiency"]["teacher"]["parameters"] > results["efficiency"]["student"]["parameters"]
    with pytest.raises(DistillError, match=r"teacher_weights: gives 3 weights for 2 teachers"):
        load_config([*flags, "--teacher_weights", "1,1,1"])


def test_a_run_without_a_teacher_stops_with_one_line(tiny_models, tiny_data, tmp_path, capsys) -> None:
    flags = tiny_run_flags(tiny_models, tiny_data, tmp_path / "none")
    flags[flags.index("--teacher_model") : flags.index("--teacher_model") + 2] = []
    assert main(flags) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "error: teacher_model: expected a Hub name, a model folder or openai/<model>, got nothing; pass "
        "--teacher_model (or --teacher_vectors with vectors computed before)"
    ]
    assert not (tmp_path / "none" / "results.json").exists()
