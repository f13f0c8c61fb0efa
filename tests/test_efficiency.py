"""The cost stage: sizes and encoding speed measured, the teacher's figures kept, the trade-off line and table."""

from __future__ import annotations

import json
import logging
import os
import time

import numpy as np
import pytest
import torch
from sentence_transformers import SentenceTransformer

from conftest import sentences
from distill.data.containers import DistillData, EvalSet, Pairs
from distill.report import report_figure, report_markdown
from distill.stages import cost as efficiency
from distill.stages.cost import (
    CostTexts,
    Efficiency,
    ModelCost,
    TeacherCosts,
    device_label,
    machine_gflops,
    measure,
    same_load,
    weights_bytes,
)
from distill.stages.tradeoff import cost_table, trade_off_line

GPU = torch.device("cuda")  # a device off the CPU: no load probe (nothing runs on it)


def cost(parameters: int, speed: float, latency: float, dim: int = 32, gflops: float | None = None) -> ModelCost:
    return ModelCost(parameters, dim, 4 * parameters, speed, latency, gflops)


def results_with_costs() -> dict:
    efficiency = Efficiency("Test CPU (CPU, 2 threads)", 256, 32, 50, cost(10, 300.0, 10.0), cost(40, 100.0, 20.0))
    return {
        "mode": "matryoshka",
        "teacher": {"ndcg@10": 0.60},
        "student_before": {"ndcg@10": 0.40},
        "student_after": {"ndcg@10": 0.57, "matryoshka_ndcg@10": {"32": 0.57, "16": 0.55, "8": 0.50}},
        "efficiency": efficiency.to_dict(),
    }


def test_measure_counts_what_the_model_holds(tiny_models):
    model = SentenceTransformer(str(tiny_models["student"]), device="cpu")
    texts = CostTexts(sentences(20, seed=5), sentences(7, seed=6), batch_size=8)
    found = measure(model, texts, tiny_models["student"])
    assert found.parameters == sum(p.numel() for p in model.parameters())
    assert found.dim == 32
    assert found.texts_per_second > 0 and found.latency_ms > 0
    # the folder's weight file where there is one, else the tensors' bytes (float32 here: 4 per number)
    weight_files = list(tiny_models["student"].rglob("*.safetensors"))
    assert weight_files and found.weights_bytes == sum(f.stat().st_size for f in weight_files)
    assert weights_bytes(model) == 4 * sum(t.numel() for t in model.state_dict().values())


def test_measure_times_with_the_tokenizers_on_every_core_and_puts_the_setting_back(tiny_models, monkeypatch):
    """TOKENIZERS_PARALLELISM is "true" for every timed encode (its default where a model serves), as it was after."""
    model = SentenceTransformer(str(tiny_models["student"]), device="cpu")
    seen, encode = [], model.encode

    def recording(*args, **kwargs):
        seen.append(os.environ.get("TOKENIZERS_PARALLELISM"))
        return encode(*args, **kwargs)

    monkeypatch.setattr(model, "encode", recording)
    monkeypatch.setattr(efficiency, "MIN_TIMED_SECONDS", 0.0)  # one pass over the passages
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    measure(model, CostTexts(sentences(20, seed=5), sentences(3, seed=6), batch_size=8))
    assert seen == ["true"] * 5 and os.environ["TOKENIZERS_PARALLELISM"] == "false"  # warm-up, passages, 3 queries
    monkeypatch.delenv("TOKENIZERS_PARALLELISM")
    measure(model, CostTexts(sentences(20, seed=5), sentences(1, seed=6), batch_size=8))
    assert "TOKENIZERS_PARALLELISM" not in os.environ


def test_a_fast_encoder_is_timed_over_passes_for_at_least_the_minimum(monkeypatch) -> None:
    """A pass that takes 10 ms is repeated until the timing has run MIN_TIMED_SECONDS; the rate counts every pass."""
    monkeypatch.setattr(efficiency, "MIN_TIMED_SECONDS", 0.2)
    passes = []

    def encode(batch: list[str]) -> np.ndarray:
        time.sleep(0.01)
        passes.append(len(batch))
        return np.zeros((len(batch), 4))

    texts = CostTexts(sentences(20, seed=5), sentences(3, seed=6), batch_size=8)
    dim, speed, latency, rate = efficiency.timed(encode, lambda text: encode([text]), texts, GPU)
    timed = [n for n in passes[1:] if n == 20]  # after the warm-up batch of 8, before the 3 queries
    assert dim == 4 and rate is None and 15 <= len(timed) <= 21
    assert 20 / 0.0125 < speed < 20 / 0.01  # 20 texts per pass of a bit over 10 ms
    assert 10 <= latency < 12.5


def test_a_static_students_model2vec_timing_is_its_own_row_and_ratio(tiny_models, tmp_path) -> None:
    from distill.stages.cost import measure_model2vec
    from distill.students.static import as_model2vec, load_static_student

    student = load_static_student(f"static:{tiny_models['teacher']}", None, 16, tmp_path)
    model = as_model2vec(student)
    texts = CostTexts(sentences(20, seed=5), sentences(3, seed=6), batch_size=8)
    found = measure_model2vec(model, texts)
    assert (found.dim, found.parameters) == (16, student[0].embedding.weight.numel())
    assert found.weights_bytes == 4 * found.parameters and found.texts_per_second > 0 and found.latency_ms > 0
    assert as_model2vec(SentenceTransformer(str(tiny_models["student"]), device="cpu")) is None  # a transformer

    results = results_with_costs()
    efficiency = Efficiency(
        "Test CPU (CPU, 2 threads)",
        256,
        32,
        50,
        cost(10, 300.0, 10.0),
        cost(40, 100.0, 20.0),
        student_model2vec=cost(10, 450.0, 4.0),
    )
    results["efficiency"] = efficiency.to_dict()
    ratios = results["efficiency"]["ratios"]
    assert (ratios["throughput"], ratios["throughput_model2vec"], ratios["latency_model2vec"]) == (3.0, 4.5, 0.2)
    assert "at 3.0x its throughput (4.5x through model2vec) and 0.25x its parameters" in trade_off_line(results)
    assert "| student, model2vec | 32 | 0.5700 | 450.0 | 4.0 |" in cost_table(results)


def test_measure_on_a_folder_without_weight_files_counts_the_tensors(tiny_models, tmp_path):
    model = SentenceTransformer(str(tiny_models["student"]), device="cpu")
    assert weights_bytes(model, tmp_path) == weights_bytes(model)


def test_cost_texts_sample_the_evaluation_set_and_are_seeded():
    evaluation = EvalSet(queries=sentences(80, 1), corpus=sentences(300, 2), relevant=list(range(80)))
    data = DistillData(sentences(500, 3), Pairs([], []), evaluation)
    texts = CostTexts.from_data(data, 256, 32, seed=7)
    assert texts is not None
    assert len(texts.passages) == 256 and set(texts.passages) <= set(evaluation.corpus)
    assert len(texts.queries) == 50 and set(texts.queries) <= set(evaluation.queries)
    assert texts == CostTexts.from_data(data, 256, 32, seed=7)
    assert texts.fingerprint() != CostTexts.from_data(data, 256, 32, seed=8).fingerprint()
    assert CostTexts.from_data(data, 0, 32, seed=7) is None  # --efficiency_texts 0: not measured
    # no evaluation set: the training texts
    alone = CostTexts.from_data(DistillData(sentences(40, 3), Pairs([], []), None), 256, 32, seed=7)
    assert alone is not None and len(alone.passages) == 40 and set(alone.passages) <= set(sentences(40, 3))


def test_teacher_costs_are_kept_per_device_and_texts(tmp_path):
    texts = CostTexts(["a passage"], ["a query"], 8)
    kept = TeacherCosts(tmp_path, "teacher-key", "GPU A", texts)
    assert kept.get(GPU) is None
    kept.put(cost(40, 100.0, 20.0))
    assert TeacherCosts(tmp_path, "teacher-key", "GPU A", texts).get(GPU) == cost(40, 100.0, 20.0)
    assert TeacherCosts(tmp_path, "teacher-key", "GPU B", texts).get(GPU) is None  # another device measures again
    assert TeacherCosts(tmp_path, "other-teacher", "GPU A", texts).get(GPU) is None
    assert TeacherCosts(tmp_path, "teacher-key", "GPU A", CostTexts(["b"], ["a query"], 8)).get(GPU) is None
    TeacherCosts(tmp_path, "teacher-key", "GPU B", texts).put(cost(40, 200.0, 10.0))
    assert len(json.loads((tmp_path / "costs.json").read_text())) == 2  # both records kept


def test_unreadable_or_unwritable_teacher_costs_do_not_stop_a_run(tmp_path, caplog):
    texts = CostTexts(["a passage"], ["a query"], 8)
    (tmp_path / "costs.json").write_text("{not json")
    assert TeacherCosts(tmp_path, "k", "GPU", texts).get(GPU) is None
    blocked = tmp_path / "file"
    blocked.write_text("")  # a file where the cache folder should be
    with caplog.at_level(logging.WARNING):
        TeacherCosts(blocked, "k", "GPU", texts).put(cost(1, 1.0, 1.0))
    assert "not kept" in caplog.text


def test_same_load_compares_the_cpu_matmul_rates():
    assert same_load(100.0, 124.0) and same_load(124.0, 100.0)
    assert not same_load(100.0, 126.0) and not same_load(40.0, 100.0)
    assert same_load(None, None)  # both on a GPU: no probe
    assert not same_load(None, 100.0)  # a CPU figure kept without its rate: not known to compare


def test_a_teacher_figure_kept_under_another_cpu_load_is_timed_again(tmp_path, monkeypatch, caplog):
    texts = CostTexts(["a passage"], ["a query"], 8)
    kept = TeacherCosts(tmp_path, "teacher-key", "Test CPU (CPU, 2 threads)", texts)
    kept.put(cost(40, 14.1, 50.0, gflops=40.0))  # timed while other work held the machine
    cpu = torch.device("cpu")
    monkeypatch.setattr("distill.stages.cost.machine_gflops", machine_gflops)  # the real one, over a stubbed probe
    monkeypatch.setattr("distill.stages.cost.cpu_matmul_flops", lambda seconds: 45e9)
    assert kept.get(cpu) == cost(40, 14.1, 50.0, gflops=40.0)  # within the tolerance: kept
    monkeypatch.setattr("distill.stages.cost.cpu_matmul_flops", lambda seconds: 110e9)
    with caplog.at_level(logging.INFO):
        assert kept.get(cpu) is None  # the machine is idle now: the teacher is timed again
    assert "40.0 GFLOP/s" in caplog.text and "110.0 now" in caplog.text


def test_measure_records_the_cpu_rate_it_timed_under(tiny_models, monkeypatch):
    monkeypatch.setattr("distill.stages.cost.machine_gflops", machine_gflops)  # the real probe
    model = SentenceTransformer(str(tiny_models["student"]), device="cpu")
    found = measure(model, CostTexts(sentences(8, seed=5), sentences(3, seed=6), batch_size=8))
    assert found.machine_gflops is not None and found.machine_gflops > 0


def test_ratios_and_the_trade_off_line():
    results = results_with_costs()
    assert results["efficiency"]["ratios"] == {"throughput": 3.0, "latency": 0.5, "parameters": 0.25, "weights": 0.25}
    assert trade_off_line(results) == (
        "The student keeps 95.0% of the teacher's nDCG@10 at 3.0x its throughput and 0.25x its parameters, "
        "on Test CPU (CPU, 2 threads)."
    )
    loaded = results_with_costs()
    loaded["efficiency"]["teacher"]["machine_gflops"] = 40.0
    loaded["efficiency"]["student"]["machine_gflops"] = 110.0
    line = trade_off_line(loaded)
    assert line is not None and line.startswith(trade_off_line(results) or "")
    assert "timed under different loads (the CPU's matmul at 40.0 and 110.0 GFLOP/s)" in line
    del results["efficiency"]["teacher"], results["efficiency"]["ratios"]
    assert trade_off_line(results) is None  # nothing to compare with
    assert trade_off_line({"teacher": {"ndcg@10": 0.6}, "student_after": {"ndcg@10": 0.5}}) is None


def test_cost_table_lists_the_teacher_the_student_and_each_width():
    table = cost_table(results_with_costs())
    rows = [line for line in table.splitlines() if line.startswith("| ")][1:]
    assert [row.split(" | ")[0] for row in rows] == [
        "| teacher",
        "| student",
        "| student, first 16 dims",
        "| student, first 8 dims",
    ]
    assert "| 0.6000 | 100.0 | 20.0 |" in rows[0] and "| 0.5700 | 300.0 | 10.0 |" in rows[1]
    assert "Test CPU (CPU, 2 threads)" in table
    assert cost_table({"teacher": {"ndcg@10": 0.6}}) == ""


def test_report_shows_the_cost_section_and_the_trade_off_panel():
    results = results_with_costs()
    markdown = report_markdown(results)
    assert "## Cost" in markdown and trade_off_line(results) in markdown
    figure = report_figure(results)
    panel = figure.axes[3]
    assert panel.get_title() == "(d) quality against encoding speed"
    labels = [text.get_text() for text in panel.texts]
    assert labels == [
        "teacher (0.600)",
        "student before (0.400)",
        "student after (0.570)",
        "first 16 dims (0.550)",
        "first 8 dims (0.500)",
    ]
    offsets = [tuple(c.get_offsets()[0]) for c in panel.collections]
    assert offsets[0] == (100.0, 0.6) and offsets[2] == (300.0, 0.57)
    no_costs = report_figure({k: v for k, v in results.items() if k != "efficiency"}).axes[3]
    assert "no cost measured" in no_costs.texts[0].get_text()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="names the GPU")
def test_device_label_names_the_gpu():
    assert torch.cuda.get_device_name(0) in device_label(torch.device("cuda:0"))


def test_device_label_names_the_cpu_and_its_threads():
    label = device_label(torch.device("cpu"))
    assert label.endswith(f"(CPU, {torch.get_num_threads()} threads)") and len(label) > len("(CPU, 1 threads)")


def test_the_student_is_timed_in_the_teachers_dtype_and_left_as_it_was(accelerator, tiny_models):
    from distill.stages.cost import measure_student

    student = SentenceTransformer(str(tiny_models["student"]), device="cpu")
    texts = CostTexts(sentences(12, seed=5), sentences(5, seed=6), batch_size=4)
    found = measure_student(accelerator, student, None, texts, dtype="bfloat16")
    assert found.dtype == "bfloat16" and found.to_dict()["dtype"] == "bfloat16"
    assert found.student.weights_bytes == weights_bytes(student)  # the exported float32 weights, not the copy's
    assert all(p.dtype == torch.float32 for p in student.parameters())  # timed on a copy
    assert "in bfloat16" in cost_table({"efficiency": found.to_dict()})


def test_timing_the_cpu_draws_nothing_from_torchs_global_generator() -> None:
    """A run that times its teacher (cold cache) and one that reads the kept figures train the same student."""
    from distill.stages.cost import cpu_matmul_flops

    torch.manual_seed(3)
    expected = torch.rand(4)
    torch.manual_seed(3)
    cpu_matmul_flops(seconds=0.01, repeats=1)
    assert torch.equal(torch.rand(4), expected)
