"""bench/gpu.py's measuring pieces on the CPU: CI never has a GPU, and the script must work when one is lent."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from sentence_transformers import SentenceTransformer

from conftest import sentences

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import gpu


@pytest.fixture
def tokens(tiny_models):
    from distill.tokens import TokenizedTexts

    student = gpu.make_student(tiny_models["student"])
    return TokenizedTexts(student.tokenizer, sentences(96, seed=5), gpu.MAX_LENGTH)


def test_flops_counted_a_chunk_at_a_time_equal_the_whole_batch_count(tiny_models, tokens) -> None:
    from torch.utils.flop_counter import FlopCounterMode

    student = gpu.make_student(tiny_models["student"])
    collated = gpu.collate(tokens, gpu.grouped_batches(tokens, 16)[:3], dim=32)
    whole = 0
    for features, target in collated:
        with FlopCounterMode(display=False) as counter:
            ((student(dict(features))["sentence_embedding"] - target) ** 2).sum().backward()
        whole += counter.get_total_flops()
    assert whole > 0
    assert gpu.count_flops(student, collated, chunk=4) == whole
    assert all(p.grad is None for p in student.parameters())  # counting leaves no gradient behind
    with pytest.raises(SystemExit, match="not a multiple"):
        gpu.count_flops(student, collated, chunk=5)


def test_a_floor_variant_times_its_steps_and_splits_them(tiny_models, tokens) -> None:
    flops: dict = {}
    result = gpu.floor_variant(
        tiny_models["student"], tokens, 32, batch_size=8, warmup=2, steps=5, split=True, flops_cache=flops
    )
    assert (result["warmup_steps"], result["timed_steps"], result["batch_size"]) == (2, 5, 8)
    assert result["samples_per_second"] == pytest.approx(40 / result["seconds"], rel=0.01)
    assert set(result["split_ms_per_step"]) == {"forward", "backward", "optimizer"}
    assert all(v > 0 for v in result["split_ms_per_step"].values())
    assert result["timed_flops"] == gpu.count_flops(
        gpu.make_student(tiny_models["student"]), gpu.collate(tokens, gpu.grouped_batches(tokens, 8)[2:7], dim=32)
    )  # the timed batches' FLOPs, not the warm-up ones'
    assert result["achieved_tflops"] == pytest.approx(result["timed_flops"] / result["seconds"] / 1e12, rel=1e-3)
    assert 0 <= result["padding_fraction"] < 0.5  # length-grouped batches
    checkpointed = gpu.floor_variant(
        tiny_models["student"], tokens, 32, batch_size=8, warmup=2, steps=5, checkpointing=True, flops_cache={}
    )
    assert checkpointed["timed_flops"] == result["timed_flops"]  # recomputation is not counted
    assert checkpointed["final_loss"] == pytest.approx(result["final_loss"], rel=1e-5)  # same steps, same model


def test_random_copy_keeps_the_tokenizer_and_draws_new_weights(tiny_models, tmp_path) -> None:
    source = tiny_models["student"]
    copy = gpu.random_copy(source, tmp_path / "copy", seed=7)
    assert (copy / "tokenizer.json").read_bytes() == (source / "tokenizer.json").read_bytes()
    weights, original = load_file(str(copy / "model.safetensors")), load_file(str(source / "model.safetensors"))
    assert weights.keys() == original.keys()
    drawn = [k for k in weights if k.endswith(".weight") and "LayerNorm" not in k]  # biases start at 0 in both
    assert len(drawn) > 10 and not any(torch.equal(weights[k], original[k]) for k in drawn)
    assert SentenceTransformer(str(copy), device="cpu").encode(["a river"]).shape == (1, 32)


def step_bench(tiny_models, tmp_path) -> tuple[int, dict]:
    """bench/gpu_step.py --quick over 200 texts, the tiny student as both students: its exit code and its rows."""
    import json

    import gpu_step

    texts = tmp_path / "texts.txt"
    texts.write_text("\n".join(sentences(200, seed=5)) + "\n")
    student = str(tiny_models["student"])
    argv = ["--mpnet", student, "--bert", student, "--texts", str(texts), "--quick", "--out", str(tmp_path / "out")]
    code = gpu_step.main([*argv, "--workdir", str(tmp_path / "work")])
    return code, json.loads((tmp_path / "out" / "gpu-step.json").read_text())["results"]


def test_the_step_benchmark_runs_every_row_on_a_cpu(tiny_models, tmp_path) -> None:
    """bench/gpu_step.py --quick: each row trains (or encodes) and reports its step figures; a CPU has no kernels."""
    import gpu_step

    code, rows = step_bench(tiny_models, tmp_path)
    assert code == 0
    assert set(rows) == {
        "mpnet-b256-eager",
        "mpnet-b256-fused",
        "bert-base-32k-tokens-padded",
        "bert-base-32k-tokens-unpadded",
        "decoder-7b-encode",
    }
    for name, row in rows.items():
        assert "error" not in row, (name, row)
        assert row["steps"] == gpu_step.PROFILED_STEPS and row["ms_per_step"] > 0 and row["tflops_per_step"] > 0
        assert 0 < row["host_busy_ms_per_step"] <= row["ms_per_step"] and row["cpu_ops_per_step"] > 0
        assert row["kernels_per_step"] is None and row["share_of_matmul_percent"] is None  # no GPU, no matmul rate
    assert rows["bert-base-32k-tokens-padded"]["real_tokens_per_step"] >= 96  # 32,768 on a GPU
    padded, unpadded = rows["bert-base-32k-tokens-padded"], rows["bert-base-32k-tokens-unpadded"]
    assert unpadded["real_tokens_per_step"] == padded["real_tokens_per_step"]  # the same texts a step
    assert unpadded["tflops_per_step"] == padded["tflops_per_step"]  # the same real tokens' work
    assert rows["decoder-7b-encode"]["tokens_per_step"] == 64
    assert unpadded["attention"] == {
        "unpadded": False,
        "reason": "the variable-length kernel runs on CUDA GPUs, not on cpu",
    }


def test_the_step_benchmark_exits_non_zero_when_a_row_fails(tiny_models, tmp_path, monkeypatch, capsys) -> None:
    """A failed row keeps its error in the JSON beside the rows measured, and the command fails."""
    import gpu_step

    def out_of_memory(*args):
        raise torch.OutOfMemoryError("CUDA out of memory (stand-in)")

    monkeypatch.setattr(gpu_step, "decoder_row", out_of_memory)
    monkeypatch.setattr(gpu_step, "student_row", lambda *args, **options: {"ms_per_step": 1.0})  # measured above
    code, rows = step_bench(tiny_models, tmp_path)
    assert code == 1
    assert rows["decoder-7b-encode"] == {"error": "OutOfMemoryError: CUDA out of memory (stand-in)"}
    assert "error" not in rows["mpnet-b256-fused"]
    assert "1 row(s) failed: decoder-7b-encode" in capsys.readouterr().err
