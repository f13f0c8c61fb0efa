"""The planner: its counts match what a run does, it loads no weights, and it fails in one line."""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from sentence_transformers import SentenceTransformer

from conftest import reset_accelerate, tiny_run_flags
from distill import plan
from distill.config import load_config
from distill.files import folder_bytes
from distill.hub import model_shape
from distill.plan import command as plan_command
from distill.plan import devices as plan_devices
from distill.plan import figures as plan_figures
from distill.plan import make_plan
from distill.plan import render as plan_render
from distill.plan import texts as plan_texts
from distill.plan.devices import device_for


@pytest.fixture(autouse=True)
def idle_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """The suite's other worker keeps the load average up, and rates timed under load are not kept: here the CPU
    reads idle, unless a test says otherwise."""
    monkeypatch.setattr(os, "getloadavg", lambda: (0.0, 0.0, 0.0))


def no_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    """Loading any model's weights fails the test."""
    from transformers import AutoModel, PreTrainedModel

    def refuse(*args, **kwargs):
        raise AssertionError("the planner loaded a model's weights")

    monkeypatch.setattr(SentenceTransformer, "__init__", refuse)
    monkeypatch.setattr(AutoModel, "from_pretrained", refuse)
    monkeypatch.setattr(PreTrainedModel, "from_pretrained", refuse)


def test_the_plan_counts_what_the_run_does(tiny_models, tiny_data, tmp_path, monkeypatch):
    """Texts, optimizer steps, parameters and the cache's bytes, against a real run with the same flags."""
    from distill.train import main

    flags = tiny_run_flags(tiny_models, tiny_data, tmp_path / "run", student_num_layers=1, efficiency_texts=0)
    assert main(flags) == 0
    reset_accelerate()
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    no_weights(monkeypatch)
    figures = make_plan(load_config(flags), device_for("h100", None, None))
    assert figures.optimizer_steps == {p: f["optimizer_steps"] for p, f in results["phases"].items()}
    assert figures.texts["phase1 texts"] == results["phases"]["phase1"]["examples"]
    assert figures.texts["phase2 queries"] == results["phases"]["phase2"]["examples"]
    cache = sum(folder_bytes(e) for e in (tmp_path / "run" / "cache").iterdir() if (e / "manifest.json").is_file())
    assert abs(figures.cache_bytes - cache) <= 0.10 * cache
    monkeypatch.undo()
    student = SentenceTransformer(str(tiny_models["student"]), device="cpu")
    teacher = SentenceTransformer(str(tiny_models["teacher"]), device="cpu")
    assert figures.parameters["teacher"] == sum(p.numel() for p in teacher.parameters())
    one_layer = sum(p.numel() for p in student.parameters()) - sum(
        p.numel() for p in student[0].auto_model.encoder.layer[1:].parameters()
    )
    assert figures.parameters["student"] == one_layer  # cut to one layer, as the run cuts it
    assert figures.allreduce_bytes_per_step == 0  # one process


def counted_flops(folder: Path, texts: list[str], backward: bool) -> float:
    """torch's own count of the model's FLOPs over `texts`, each alone (no padding), with eager attention so that the
    counter sees attention's products as the planner counts them."""
    from torch.utils.flop_counter import FlopCounterMode

    model = SentenceTransformer(str(folder), device="cpu")
    model.max_seq_length = 32
    model[0].auto_model.set_attn_implementation("eager")
    total = 0
    with torch.set_grad_enabled(backward):
        for text in texts:
            with FlopCounterMode(display=False) as counter:
                embedding = model(model.tokenize([text]))["sentence_embedding"]
                if backward:
                    embedding.sum().backward()
            total += counter.get_total_flops()
    return total


def test_the_planned_flops_are_what_torch_counts(tiny_models, tiny_data, tmp_path):
    """The planner's formulas (2 x dense parameters per token, attention's 4 x layers x width x length per token,
    training 3x a forward) against torch's FlopCounterMode over the same texts: within 3% for the teacher's encoding,
    5% for phase 1's training."""
    flags = tiny_run_flags(tiny_models, tiny_data, tmp_path, skip_phase2=True, eval_data="none")
    figures = make_plan(load_config(flags), device_for("h100", None, None))
    texts = Path(tiny_data["texts"]).read_text().splitlines()
    assert figures.teacher_flops == pytest.approx(counted_flops(tiny_models["teacher"], texts, False), rel=0.03)
    assert figures.train_flops["phase1"] == pytest.approx(counted_flops(tiny_models["student"], texts, True), rel=0.05)


def test_phase_1s_own_target_encodes_phase_1s_texts_in_the_plan(tiny_models, tiny_data, tmp_path, monkeypatch):
    no_weights(monkeypatch)
    device = device_for("h100", None, None)
    flags = tiny_run_flags(tiny_models, tiny_data, tmp_path, use_projection=False, efficiency_texts=0)
    alone = make_plan(load_config(flags), device)
    source = tiny_models["wide_student"]  # 64-d, 2 layers: another shape and cache width than the 48-d teacher
    both = make_plan(load_config([*flags, "--phase1_teacher_model", str(source)]), device)
    shapes = {name: model_shape(tiny_models[name]) for name in ("teacher", "wide_student")}
    assert both.parameters["phase1_teacher"] == shapes["wide_student"].parameters
    assert "phase1_teacher" not in alone.parameters
    phase1 = both.texts["phase1 texts"]
    assert both.cache_bytes - alone.cache_bytes == phase1 * 2 * (64 - 48)  # float16 vectors of the other width
    assert shapes["wide_student"].dense_parameters > shapes["teacher"].dense_parameters
    assert both.teacher_flops > alone.teacher_flops  # phase 1's texts through the larger model
    assert f"phase 1's target: {shapes['wide_student'].parameters / 1e6:,.1f}M" in plan_render.plan_text(both)


def test_more_processes_share_the_work_and_all_reduce_the_gradients(tiny_models, tiny_data, tmp_path):
    one = make_plan(load_config(tiny_run_flags(tiny_models, tiny_data, tmp_path)), device_for("a100", None, None))
    flags = [*tiny_run_flags(tiny_models, tiny_data, tmp_path, batch_size=4), "--num_processes", "2"]
    two = make_plan(load_config(flags), device_for("a100", None, None), machines=2)
    assert two.teacher_seconds == pytest.approx(one.teacher_seconds / 2)
    assert two.optimizer_steps == one.optimizer_steps  # 2 x 4 per step against 1 x 8
    projection = 32 * 48 + 48  # the tiny run trains a 32 -> 48 projection
    trainable = one.parameters["student"] - model_shape(tiny_models["student"]).frozen_parameters + projection
    assert two.allreduce_bytes_per_step == trainable * 4  # a ring moves 2 (n - 1) / n x the fp32 gradients
    assert two.assumptions["interconnect_bytes_per_second"] == plan_devices.INTER_MACHINE_BYTES_PER_S


def test_measured_rates_replace_the_assumed_ones(tiny_models, tiny_data, tmp_path):
    config = load_config(tiny_run_flags(tiny_models, tiny_data, tmp_path))
    assumed = make_plan(config, device_for("h100", None, None))
    measured = make_plan(config, device_for("h100", 20.0, 5.0))  # TFLOP/s measured by the user
    assert measured.teacher_seconds == pytest.approx(measured.teacher_flops / 20e12)
    assert measured.train_seconds == pytest.approx(sum(measured.train_flops.values()) / 5e12)
    assert assumed.teacher_flops == measured.teacher_flops and assumed.train_flops == measured.train_flops
    assert measured.assumptions["rates"].startswith("measured")


def test_scaled_counts_keep_the_lengths(tiny_models, tiny_data, tmp_path):
    config = load_config(tiny_run_flags(tiny_models, tiny_data, tmp_path))
    base = make_plan(config, device_for("h100", None, None))
    scaled = make_plan(config, device_for("h100", None, None), phase2_pairs=10 * base.texts["phase2 queries"])
    assert scaled.texts["phase2 passages"] == 10 * base.texts["phase2 passages"]
    assert scaled.tokens["phase2"]["teacher"] == pytest.approx(10 * base.tokens["phase2"]["teacher"], rel=1e-6)
    assert scaled.texts["phase1 texts"] == base.texts["phase1 texts"]


def test_json_has_the_totals_and_bad_input_is_one_line(tiny_models, tiny_data, tmp_path, capsys):
    flags = tiny_run_flags(tiny_models, tiny_data, tmp_path)
    assert plan_command.main([*flags, "--device", "h100", "--json"]) == 0
    figures = json.loads(capsys.readouterr().out)
    assert {"teacher_seconds", "train_seconds", "cache_bytes"} <= set(figures)
    assert plan_command.main([*flags, "--device", "h100"]) == 0
    text = capsys.readouterr().out
    assert "the bill: " in text and "dominates" in text and "assumed: 40% / 8% of the bf16 dense peak" in text
    assert plan_command.main([*flags, "--device", "tpu"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: --device: expected cpu or one of h100, h200, a100, l4, got 'tpu'"
    ]
    assert plan_command.main([*flags, "--batch_size", "0", "--device", "h100"]) == 2
    assert "batch_size: expected a number greater than 0" in capsys.readouterr().err


def test_a_teacher_folder_with_a_config_only_is_counted_with_the_students_tokenizer(tiny_models, tiny_data, tmp_path):
    """A 7B teacher's config.json alone is enough to plan for it (its tokenizer counts when it is there)."""
    from transformers import AutoConfig

    config_only = tmp_path / "teacher-config"
    AutoConfig.from_pretrained(tiny_models["teacher"]).save_pretrained(config_only)
    flags = tiny_run_flags(tiny_models, tiny_data, tmp_path / "out", teacher_model=config_only)
    figures = make_plan(load_config(flags), device_for("h100", None, None))
    assert figures.assumptions["teacher_tokenizer"].startswith("the student's")
    shape = model_shape(config_only)
    assert shape.dim == shape.width and figures.parameters["teacher"] == shape.parameters


def test_the_cpu_rate_is_timed_here():
    device = device_for("cpu", None, None)
    assert device.teacher_rate > 0 and "of this CPU's float32 matmul rate" in device.rates
    assert device.base_bytes > 0 and torch.get_num_threads() >= 1


def test_a_cpu_plan_times_the_runs_own_work_and_keeps_it_per_processor(tiny_models, tiny_data, tmp_path, monkeypatch):
    """The student's steps of each phase and the teacher's batches are timed on this CPU, and their rates drive the
    seconds; the next plan of the same work on the same processor reads them back; another processor, or
    --recalibrate, times them again."""
    from distill.plan import calibration

    timed = []
    for name in ("time_teacher", "time_student"):
        real = getattr(calibration, name)
        monkeypatch.setattr(calibration, name, lambda work, real=real: timed.append(work["kind"]) or real(work))
    config = load_config(tiny_run_flags(tiny_models, tiny_data, tmp_path / "out"))
    first = make_plan(config, device_for("cpu", None, None))
    assert sorted(timed) == ["student", "student", "teacher"]  # phase 1's step, phase 2's, the teacher's batch
    line = first.assumptions["rates"]
    assert line.startswith("timed now on this CPU") and "phase2 steps of the student at 8 x" in line
    kept = json.loads((tmp_path / "out" / "cache" / "cpu-rates.json").read_text())
    rates = {json.loads(key)["kind"]: entry["flops_per_second"] for key, entry in kept.items()}
    assert first.teacher_seconds == pytest.approx(first.teacher_flops / rates["teacher"])
    for phase, seconds in first.train_seconds_by_phase.items():  # each phase at its own timed rate
        assert seconds == pytest.approx(first.train_flops[phase] / first.assumptions["student_flops_per_phase"][phase])
    assert set(first.assumptions["student_flops_per_phase"].values()) <= {e["flops_per_second"] for e in kept.values()}

    timed.clear()
    second = make_plan(config, device_for("cpu", None, None))
    assert timed == [] and second.assumptions["rates"].startswith("kept for this CPU")
    assert (second.teacher_seconds, second.train_seconds) == (first.teacher_seconds, first.train_seconds)
    make_plan(config, device_for("cpu", None, None, recalibrate=True))
    assert sorted(timed) == ["student", "student", "teacher"]
    timed.clear()
    monkeypatch.setattr(calibration, "processor", lambda: "Another CPU")
    make_plan(config, device_for("cpu", None, None))
    assert sorted(timed) == ["student", "student", "teacher"]
    assert len(json.loads((tmp_path / "out" / "cache" / "cpu-rates.json").read_text())) == 6  # both processors'
    timed.clear()  # other work holds the cores: the rates serve this plan, and are not kept
    monkeypatch.setattr(calibration, "processor", lambda: "A busy CPU")
    monkeypatch.setattr(os, "getloadavg", lambda: (2.0 * (os.cpu_count() or 1), 0.0, 0.0))
    busy = make_plan(config, device_for("cpu", None, None))
    assert sorted(timed) == ["student", "student", "teacher"]
    assert "not kept: other work ran (load average" in busy.assumptions["rates"]
    assert len(json.loads((tmp_path / "out" / "cache" / "cpu-rates.json").read_text())) == 6


def test_a_run_in_bf16_is_timed_in_bf16_and_kept_apart(tiny_models, tiny_data, tmp_path, monkeypatch):
    """`--mixed_precision auto` on a CPU with native bf16 trains in bf16, so the planner times the student's steps
    under bf16 autocast, under keys of their own; the teacher encodes in float32 either way."""
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True, raising=False)
    autocast = []
    real_autocast = torch.autocast
    monkeypatch.setattr(torch, "autocast", lambda *a, **k: autocast.append(k["enabled"]) or real_autocast(*a, **k))
    plans = {}
    for precision in ("no", "auto"):
        autocast.clear()
        config = load_config(tiny_run_flags(tiny_models, tiny_data, tmp_path / "out", mixed_precision=precision))
        plans[precision] = make_plan(config, device_for("cpu", None, None)).assumptions["rates"]
        assert set(autocast) == {precision == "auto"}  # every timed forward of the student
    assert "tokens in bf16" not in plans["no"] and plans["auto"].count("tokens in bf16") == 2  # phase 1 and 2
    assert "teacher batches" in plans["auto"]  # read back: the float32 teacher's rate is the same work
    kept = [json.loads(key) for key in json.loads((tmp_path / "out" / "cache" / "cpu-rates.json").read_text())]
    assert sorted(key.get("precision", "no") for key in kept if key["kind"] == "student") == ["bf16"] * 2 + ["no"] * 2


def test_a_torn_rates_file_is_timed_again_and_a_gpu_plan_times_nothing(tiny_models, tiny_data, tmp_path, monkeypatch):
    config = load_config(tiny_run_flags(tiny_models, tiny_data, tmp_path / "out"))
    (tmp_path / "out" / "cache").mkdir(parents=True)
    (tmp_path / "out" / "cache" / "cpu-rates.json").write_text('{"torn')
    assert make_plan(config, device_for("cpu", None, None)).assumptions["rates"].startswith("timed now")
    assert json.loads((tmp_path / "out" / "cache" / "cpu-rates.json").read_text())  # written whole again
    monkeypatch.setattr(plan, "calibrate", lambda *a, **k: pytest.fail("a GPU plan timed this CPU"))
    assert make_plan(config, device_for("h100", None, None)).assumptions["rates"].startswith("40% / 8%")
    measured = make_plan(config, device_for("cpu", 1.0, 1.0))  # measured rates on a CPU: nothing to time
    assert measured.assumptions["rates"].startswith("measured") and measured.teacher_seconds == pytest.approx(
        measured.teacher_flops / 1e12
    )


def test_a_cpu_process_base_is_read_with_the_data_loaded(tiny_models, tiny_data, tmp_path, monkeypatch):
    """A run holds its data and tokenizers beside its models, so a CPU's base RSS is read after the planner has them;
    a GPU's memory holds neither, and its base stays 0."""
    import distill.data

    read = []
    load_data = distill.data.load_data
    monkeypatch.setattr(distill.data, "load_data", lambda *a, **k: read.append(1) or load_data(*a, **k))
    for module in (plan, plan_devices):
        monkeypatch.setattr(module, "process_base_bytes", lambda: 2000 if read else 1000)
    monkeypatch.setattr("distill.stages.cost.cpu_matmul_flops", lambda: 1e11)
    config = load_config(tiny_run_flags(tiny_models, tiny_data, tmp_path / "out"))
    cpu = device_for("cpu", None, None)
    assert cpu.base_bytes == 1000  # before the data
    figures = make_plan(config, cpu)
    assert figures.assumptions["process_base_bytes"] == 2000
    gpu = make_plan(config, device_for("h100", None, None))
    assert gpu.assumptions["process_base_bytes"] == 0
    assert figures.student_memory_bytes > figures.teacher_memory_bytes > 2000  # the stages sit on that base


def test_an_endpoint_teacher_is_planned_as_the_tokens_it_will_be_sent(tiny_models, tiny_data, tmp_path):
    """Nothing of it runs here: no FLOPs, no memory; the tokens it is sent, counted with the student's tokenizer."""
    device = device_for("h100", None, None)
    flags = tiny_run_flags(tiny_models, tiny_data, tmp_path / "plan", max_samples_phase1=64, max_samples_phase2=48)
    local = make_plan(load_config(flags), device)
    served = make_plan(load_config([*flags, "--teacher_model", "openai/big-model"]), device)
    assert served.teacher == "openai/big-model at https://api.openai.com/v1" and served.teacher_flops == 0
    assert served.texts == local.texts and served.parameters["teacher"] == 0
    text = plan_render.plan_text(served)
    sent = sum(tokens["teacher"] for tokens in served.tokens.values())
    assert f"tokens sent to the endpoint: {sent:,.0f}" in text and sent > 0
    assert served.assumptions["teacher_tokenizer"].startswith("the student's tokenizer")


def test_a_reranker_is_planned_as_the_pairs_it_scores(tiny_models, tiny_data, tmp_path):
    """Each phase-2 query with its positive and its negatives: the data's (tiny_data has one), else the mined ones;
    as many as the run's results.json counts (tests/test_reranker.py)."""
    device = device_for("h100", None, None)
    flags = tiny_run_flags(tiny_models, tiny_data, tmp_path / "plan", max_samples_phase2=48)
    given = make_plan(load_config([*flags, "--reranker_model", "a-reranker"]), device)
    queries = given.texts["phase2 queries"]
    assert given.reranker_pairs == 2 * queries and given.reranker_tokens > 0
    assert f"reranker a-reranker: {2 * queries:,} (query, candidate) pairs" in plan_render.plan_text(given)
    none = make_plan(load_config(flags), device)
    assert none.reranker_pairs == 0 and "reranker" not in plan_render.plan_text(none)


def test_two_teachers_are_planned_as_the_sum_of_their_encodings(tiny_models, tiny_data, tmp_path):
    device = device_for("h100", None, None)
    flags = tiny_run_flags(tiny_models, tiny_data, tmp_path / "plan", max_samples_phase1=64, max_samples_phase2=48)
    one = make_plan(load_config([*flags, "--use_projection", "False"]), device)
    teachers = f"{tiny_models['teacher']},{tiny_models['teacher']}"
    two = make_plan(load_config([*flags, "--use_projection", "False", "--teacher_model", teachers]), device)
    assert two.teacher_flops == pytest.approx(2 * one.teacher_flops)
    assert two.parameters["teacher"] == 2 * one.parameters["teacher"]
    assert two.cache_bytes > 2 * one.cache_bytes  # each member's entries, and the combination's


def test_a_static_table_distilled_here_is_planned_as_one_pass_over_its_vocabulary(tiny_models, tiny_data, tmp_path):
    """Each vocabulary token through the model once on each machine, split over its processes; nothing for a
    transformer student or a table that starts from a folder."""
    device = device_for("h100", None, None)
    teacher = str(tiny_models["teacher"])
    static = {"student_model": f"static:{teacher}", "student_dim": 16, "use_projection": False}
    flags = tiny_run_flags(tiny_models, tiny_data, tmp_path / "plan", **static)
    one = make_plan(load_config(flags), device)
    from torch.utils.flop_counter import FlopCounterMode

    from distill.students.static import load_static_student

    with FlopCounterMode(display=False) as counter:  # model2vec's own distillation of the table, counted by torch
        table = load_static_student(f"static:{teacher}", None, 16, tmp_path / "distilled")
    # a row per vocabulary token: the plan counts the tokenizer's whole vocabulary, model2vec's cleaning drops a few
    # special tokens (144 against 141 here)
    assert one.table_tokens == pytest.approx(table[0].embedding.weight.shape[0], rel=0.05)
    # within 10% (4.6% measured: torch's counter does not see the CPU's fused attention, which the plan counts)
    assert one.table_flops == pytest.approx(counter.get_total_flops(), rel=0.10)
    assert one.table_seconds == pytest.approx(one.table_flops / device.teacher_rate)
    assert f"static table: {one.table_tokens:,} vocabulary tokens" in plan_render.plan_text(one)
    four = make_plan(load_config([*flags, "--num_processes", "4"]), device, machines=2)  # two a machine
    assert four.table_seconds == pytest.approx(one.table_seconds / 2)
    transformer = make_plan(load_config(tiny_run_flags(tiny_models, tiny_data, tmp_path / "t")), device)
    assert (transformer.table_tokens, transformer.table_flops) == (0, 0.0)
    assert "static table" not in plan_render.plan_text(transformer)
    folder = tmp_path / "table"  # a model2vec folder: its table is there already
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "model2vec", "hidden_dim": 16}))
    shutil.copy(Path(teacher) / "tokenizer.json", folder)
    kept_flags = tiny_run_flags(tiny_models, tiny_data, tmp_path / "k", student_model=str(folder), use_projection=False)
    kept = make_plan(load_config(kept_flags), device)
    assert (kept.table_tokens, kept.table_flops) == (0, 0.0) and kept.parameters["student"] > 0


def test_a_static_students_teacher_is_planned_at_its_own_limit_and_the_table_at_every_token(
    tiny_models, tiny_data, tmp_path
):
    """With no --max_seq_length the teacher reads up to its own 64 tokens, and its memory is that of its longest
    batch so read; the table reads every token of the long text."""
    from conftest import WORDS

    texts = tmp_path / "texts.txt"
    texts.write_text(Path(tiny_data["texts"]).read_text() + " ".join(WORDS * 3) + "\n")
    static = {"student_model": f"static:{tiny_models['teacher']}", "student_dim": 16, "use_projection": False}
    flags = tiny_run_flags(tiny_models, tiny_data, tmp_path / "plan", phase1_data=texts, **static)
    at = flags.index("--max_seq_length")
    config = load_config(flags[:at] + flags[at + 2 :])
    models = plan_figures.model_shapes(config)
    measured, _ = plan_texts.measure_texts(config, plan_texts.text_lists(config, True, False)[0], models)
    phase1 = next(t for t in measured if t.phase == "phase1")
    assert phase1.teacher_longest == 64 < phase1.student_longest  # [CLS] and [SEP] in the teacher's 64
    device = device_for("h100", None, None)
    teacher_bytes = plan_figures.memory(config, device, models.teachers[0], models.student, measured, 0)[0]
    at_64 = plan_figures.memory(
        config, device, models.teachers[0], models.student, [replace(phase1, student_longest=64)], 0
    )[0]
    assert teacher_bytes == at_64


def test_the_plan_says_what_does_not_fit_the_device_and_what_to_change(tiny_models, tiny_data, tmp_path):
    """A device smaller than the student's or the teacher's planned peak gets one 'does not fit' line each, with
    the sizes and the flag to change; a device with room for both gets none."""
    config = load_config(tiny_run_flags(tiny_models, tiny_data, tmp_path))
    figures = make_plan(config, device_for("h100", None, None))
    assert "does not fit" not in plan_render.plan_text(figures)  # a tiny run on 80 GB
    student, teacher = figures.student_memory_bytes, figures.teacher_memory_bytes
    small = min(student, teacher) - 1
    lines = plan_render.plan_text(replace(figures, device_memory_bytes=small)).splitlines()
    misfits = [line for line in lines if line.startswith("does not fit")]
    assert misfits == [
        f"does not fit: the student needs {student / 2**30:.0f} GiB of the device's {small / 2**30:.0f} GiB; "
        "lower --batch_size, or pass --gradient_checkpointing True",
        f"does not fit: the teacher needs {teacher / 2**30:.0f} GiB of the device's {small / 2**30:.0f} GiB; "
        "lower --teacher_batch_size",
    ]
    between = replace(figures, device_memory_bytes=(student + teacher) / 2)  # room for the smaller one only
    misfits = [line for line in plan_render.plan_text(between).splitlines() if line.startswith("does not fit")]
    assert len(misfits) == 1 and ("student" if student > teacher else "teacher") in misfits[0]
    assert not any(
        line.startswith("does not fit")
        for line in plan_render.plan_text(replace(figures, device_memory_bytes=0)).splitlines()
    )


def test_the_hosts_share_scales_with_the_texts_planned() -> None:
    """Memory and seconds measured on the data read, scaled to a planned count: each process holds the texts'
    bytes (memory-mapped), the first one cold the tokens it writes or the data as read; tokenizing, hashing and
    copying only cold; mining as an exhaustive search over the phase-2 passages."""
    from distill.plan.host import (
        COPY_BYTES_PER_SECOND,
        HASH_SECONDS_PER_TEXT,
        START_BYTES,
        START_SECONDS,
        TOKEN_BYTES,
        DataReading,
        host_figures,
    )

    def texts(name: str, phase: str, count: int) -> plan_figures.TextList:
        return plan_figures.TextList(name, phase, count, 10, 100, 10, 100, 20, 20, tokenize_seconds=1e-4)

    reading = DataReading(2.0, bytes_before=2**30, bytes_after=2**30 + 1000 * 300, texts=1000, text_bytes=50_000)
    read = [
        texts("phase1 texts", "phase1", 600),
        texts("phase2 queries", "phase2", 200),
        texts("phase2 passages", "phase2", 200),
    ]
    same = host_figures(read, reading, vectors_file_bytes=0, mining=(0, 8), teacher_rate=1e9)
    assert same.data_bytes == 50_000 and same.bytes_per_process == int(2**30 + START_BYTES) + 50_000
    assert same.cold_bytes == same.bytes_per_process + TOKEN_BYTES * 1000 * 10
    assert same.tokenize_seconds == pytest.approx(0.1) and same.copy_seconds == 0 and same.mining_flops == 0
    assert same.rerun_seconds == START_SECONDS
    assert same.cold_seconds == pytest.approx(START_SECONDS + 2.0 + 1000 * HASH_SECONDS_PER_TEXT + 0.1)
    tenfold = [replace(t, count=10 * t.count) for t in read]
    big = host_figures(tenfold, reading, vectors_file_bytes=10**6, mining=(2, 8), teacher_rate=1e9)
    assert big.data_bytes == 500_000 and big.read_seconds == pytest.approx(20.0)
    assert big.copy_seconds == pytest.approx(10 * 10**6 / COPY_BYTES_PER_SECOND)
    assert big.mining_flops == 2.0 * 2000 * 2000 * 8 and big.mining_seconds == pytest.approx(big.mining_flops / 1e9)
    # the data as read, held by the first process while it reads, is the cold peak where it is the larger
    heavy = DataReading(2.0, bytes_before=2**30, bytes_after=2**31, texts=1000, text_bytes=50_000)
    assert host_figures(read, heavy, 0, (0, 8), 1e9).cold_bytes == 2**31


def test_the_plan_says_the_hosts_share(tiny_models, tiny_data, tmp_path):
    flags = tiny_run_flags(tiny_models, tiny_data, tmp_path / "plan", mine_hard_negatives=2)
    figures = make_plan(load_config(flags), device_for("cpu", None, None))
    assert figures.host is not None and figures.host.mining_flops > 0 and figures.host.data_bytes >= 0
    assert figures.host.tokenize_seconds > 0 and figures.host.cold_seconds > figures.host.rerun_seconds
    text = plan_render.plan_text(figures)
    assert "host memory per process to the first step" in text and "mining 2 negatives a query" in text
