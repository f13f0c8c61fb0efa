"""Bad input: one clear `error:` line, exit code 2, and nothing written to the output folder."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import reset_accelerate, tiny_run_flags
from distill.train import main

REPO = Path(__file__).resolve().parents[1]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def remote_code_model(tiny_models, tmp_path: Path) -> Path:
    """A copy of the tiny student whose config asks for custom modelling code."""
    folder = tmp_path / "remote"
    shutil.copytree(tiny_models["student"], folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(
        model_type="tiny_custom",
        auto_map={"AutoConfig": "configuration_tiny.TinyConfig", "AutoModel": "modeling_tiny.TinyModel"},
    )
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "configuration_tiny.py").write_text(
        "from transformers import BertConfig\n\nclass TinyConfig(BertConfig):\n    model_type = 'tiny_custom'\n"
    )
    (folder / "modeling_tiny.py").write_text(
        "from transformers import BertModel\nfrom .configuration_tiny import TinyConfig\n\n"
        "class TinyModel(BertModel):\n    config_class = TinyConfig\n"
    )
    return folder


CASES = {
    "missing data file": (
        lambda m, d, t: {"phase1_data": t / "missing.jsonl"},
        r"data file '.*missing.jsonl' does not exist",
    ),
    "wrong extension": (
        lambda m, d, t: {"phase1_data": shutil.copy(d["texts"], t / "texts.docx")},
        r"unsupported extension '.docx'; use one of",
    ),
    "missing passage column": (
        lambda m, d, t: {"phase2_data": write_jsonl(t / "p.jsonl", [{"query": "q", "foo": "x"}] * 20)},
        r"no phase-2 passage column: expected one of passage, .* found query, foo; rename the column",
    ),
    "only empty or non-string texts": (
        lambda m, d, t: {"phase1_data": write_jsonl(t / "e.jsonl", [{"text": "  "}, {"text": 3}, {"text": None}])},
        r"phase-1 data .* has no usable text after dropping empty and non-string rows",
    ),
    "too few samples for one batch": (
        lambda m, d, t: {"phase1_data": write_jsonl(t / "few.jsonl", [{"text": f"text {i}"} for i in range(5)])},
        r"phase1 has 5 samples, fewer than one global batch of 8 .* lower --batch_size",
    ),
    "teacher narrower than student in MRL mode": (
        lambda m, d, t: {"student_model": m["wide_student"], "use_projection": False},
        r"teacher's 48-d embeddings to the student's 64 dimensions, but the teacher is narrower",
    ),
    "unknown offline model": (
        lambda m, d, t: {"teacher_model": "someone/no-such-model"},
        r"model 'someone/no-such-model' cannot be found .* models usable offline: a local SentenceTransformer folder",
    ),
    "model that needs remote code": (
        lambda m, d, t: {"student_model": remote_code_model(m, t)},
        r"ships its own code, which runs only if you allow it: pass --trust_remote_code",
    ),
    "output folder that is not writable": (
        lambda m, d, t: {"output_dir": d["texts"] / "inside-a-file"},
        r"output_dir '.*inside-a-file' is not writable .* pass a writable --output_dir",
    ),
    "teacher cache folder that is not writable": (
        lambda m, d, t: {"teacher_cache_dir": d["texts"] / "inside-a-file"},
        r"cannot write the teacher cache under .*inside-a-file .* pass --teacher_cache_dir elsewhere",
    ),
    "zero learning rate": (lambda m, d, t: {"phase2_lr": 0}, r"phase2_lr: expected a number greater than 0, got 0"),
    "negative epochs and batch": (
        lambda m, d, t: {"phase1_epochs": -1, "batch_size": 0},
        r"phase1_epochs: expected a number greater than 0, got -1; batch_size: expected a number greater than 0, got 0",
    ),
    "zero teacher batch": (
        lambda m, d, t: {"teacher_batch_size": 0},
        r"teacher_batch_size: expected a positive integer or nothing, got 0",
    ),
    "missing accelerate config": (
        lambda m, d, t: {"accelerate_config": t / "nope.yaml"},
        r"accelerate_config: '.*nope.yaml' does not exist; pass one of accelerate_configs/",
    ),
    "resume from something that is not a checkpoint": (
        lambda m, d, t: {"resume_from_checkpoint": t},
        r"resume_from_checkpoint: '.*' is not a checkpoint folder",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_one_line_exit_2_and_nothing_written(case, tiny_models, tiny_data, tmp_path, capsys):
    make_overrides, pattern = CASES[case]
    out = tmp_path / "out"
    overrides = {
        "output_dir": out,
        "teacher_cache_dir": tmp_path / "cache",
        **make_overrides(tiny_models, tiny_data, tmp_path),
    }
    assert main(tiny_run_flags(tiny_models, tiny_data, **{"out": out, **overrides})) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    errors = [line for line in lines if line.startswith("error: ")]
    assert len(errors) == 1, lines
    assert "Traceback" not in "\n".join(lines)
    assert re.search(pattern, errors[0]), errors[0]
    assert not out.exists() or not any(out.iterdir()), sorted(out.rglob("*"))


def test_matryoshka_dims_wider_than_the_student_fail_before_the_teacher_encodes(
    tiny_models, tiny_data, tmp_path, capsys
):
    """A dimension the 32-d student does not have is known from its folder: no teacher time is spent first."""
    cache = tmp_path / "cache"
    flags = tiny_run_flags(
        tiny_models, tiny_data, tmp_path / "out", use_projection=False, matryoshka_dims="64,16", teacher_cache_dir=cache
    )
    assert main(flags) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert errors == ["error: matryoshka_dims [64] exceed the student's 32 dimensions; pass dims up to 32"]
    assert not cache.exists() or not any(cache.iterdir()), sorted(cache.rglob("*"))  # the teacher never ran


def test_unknown_offline_teacher_prints_only_its_error(tiny_models, tiny_data, tmp_path):
    """The README's `--teacher_model org/unknown` offline: the one error line, no warning about its prompts first."""
    out = tmp_path / "out"
    flags = tiny_run_flags(tiny_models, tiny_data, out, teacher_model="org/unknown", teacher_cache_dir=tmp_path / "c")
    env = dict(os.environ, HF_HUB_OFFLINE="1")  # a subprocess: pytest's log capture would hide a warning
    done = subprocess.run(
        [sys.executable, "-m", "distill.train", *flags], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    lines = done.stderr.strip().splitlines()
    # the stages' info lines may come first; the error is the last line and the only one that is not info
    assert done.returncode == 2 and lines[-1].startswith("error: model 'org/unknown' cannot be found"), lines
    assert [line for line in lines[:-1] if not re.fullmatch(r"[a-z0-9 ]+( \.\.\.|: done in [\d.]+ s)", line)] == []


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", ["output folder that is not writable", "only empty or non-string texts"])
def test_bad_input_on_two_processes_prints_one_error_line(case, tiny_models, tiny_data, tmp_path):
    """Under a launch the user typed, every rank meets the bad input: all stop (none hangs in a collective) and one
    prints the error. Bad data is met by the machine's first process reading it for all, then by the others."""
    make_overrides, pattern = CASES[case]
    out = tmp_path / "out"
    flags = tiny_run_flags(tiny_models, tiny_data, out, **make_overrides(tiny_models, tiny_data, tmp_path))
    launcher = ["-m", "accelerate.commands.launch", "--num_machines", "1", "--num_processes", "2", "--multi_gpu"]
    launcher += ["--main_process_port", "0"]
    env = dict(os.environ, HF_HUB_OFFLINE="1", ACCELERATE_USE_CPU="true", PYTHONPATH=str(REPO))
    done = subprocess.run(
        [sys.executable, *launcher, "-m", "distill.train", *flags],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode != 0
    ours = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert len(ours) == 1 and re.search(pattern, ours[0]), done.stderr[-3000:]
    assert not out.exists() or not any(out.iterdir())


@pytest.mark.parametrize(
    ("form", "case"),
    [
        ("relaunch", "missing data file"),
        ("relaunch", "output folder that is not writable"),
        ("run_ddp.sh", "zero learning rate"),
        ("run_ddp.sh", "wrong extension"),
    ],
)
def test_the_launcher_checks_the_inputs_before_any_process_starts(form, case, tiny_models, tiny_data, tmp_path):
    """What needs no model stops the run in the process that would start the others: one line, exit 2."""
    make_overrides, pattern = CASES[case]
    out = tmp_path / "out"
    flags = tiny_run_flags(tiny_models, tiny_data, out, **make_overrides(tiny_models, tiny_data, tmp_path))
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(REPO), PYTHON=sys.executable, CUDA_VISIBLE_DEVICES="")
    if form == "relaunch":
        command = [sys.executable, "-m", "distill.train", "--num_processes", "2", *flags]
    else:
        command = ["bash", str(REPO / "run_ddp.sh"), "2", "True", *flags]
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-3000:]
    lines = done.stderr.strip().splitlines()
    assert lines[-1].startswith("error: ") and re.search(pattern, lines[-1]), done.stderr[-3000:]
    assert [line for line in lines if line.startswith("error: ")] == [lines[-1]]
    assert "Traceback" not in done.stderr and "torch.distributed" not in done.stderr  # no launcher, no rank
    assert not out.exists() or not any(out.iterdir())


def test_resume_loads_no_pickle(tiny_models, tiny_data, tmp_path, monkeypatch):
    """Every torch.load while resuming is weights_only: a checkpoint cannot run code."""
    out = tmp_path / "run"
    flags = tiny_run_flags(
        tiny_models,
        tiny_data,
        out,
        checkpoint_steps=5,
        skip_phase2=True,
        eval_data="none",
        teacher_cache_dir=tmp_path / "cache",
    )
    assert main(flags) == 0
    reset_accelerate()
    calls = []
    real_load = torch.load

    def checked_load(*args, **kwargs):
        calls.append(kwargs.get("weights_only"))
        return real_load(*args, **kwargs)

    monkeypatch.setattr(torch, "load", checked_load)
    assert main([*flags, "--resume_from_checkpoint", "latest"]) == 0
    assert calls and all(flag is True for flag in calls), calls


OUT_OF_MEMORY = (
    "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.10 GiB of which 1.05 GiB is "
    "free. Including non-PyTorch memory, this process has 78.04 GiB memory in use."
)


def test_a_training_step_out_of_device_memory_says_what_to_change(
    tiny_models, tiny_data, tmp_path, capsys, monkeypatch
):
    from distill.phases import AlignmentPhase

    def no_room(*args: object, **kwargs: object) -> None:
        raise torch.OutOfMemoryError(OUT_OF_MEMORY)

    monkeypatch.setattr(AlignmentPhase, "loss", no_room)
    out = tmp_path / "out"
    assert main(tiny_run_flags(tiny_models, tiny_data, out)) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert [line for line in lines if line.startswith("error: ")] == [
        "error: phase1: the student ran out of device memory at optimizer step 1 (CUDA out of memory. Tried to "
        "allocate 2.00 GiB. GPU 0 has a total capacity of 79.10 GiB of which 1.05 GiB is free); lower --batch_size "
        "(now 8 per process) and raise --gradient_accumulation_steps (now 1) to keep the samples per optimizer step, "
        "or pass --gradient_checkpointing True, or use --mixed_precision bf16"
    ], lines
    assert "Traceback" not in "\n".join(lines)
    assert not (out / "results.json").exists() and not (out / "artifacts").exists()


@pytest.mark.multiprocess
def test_out_of_device_memory_on_one_rank_is_reported_by_that_rank(tiny_models, tiny_data, tmp_path):
    """Rank 1 alone runs out of memory: it says so with its rank, and rank 0 does not wait for it forever."""
    driver = tmp_path / "driver.py"
    driver.write_text(
        "import sys\nimport torch\nfrom distill.phases import AlignmentPhase\nfrom distill.train import main\n"
        "real = AlignmentPhase.loss\n\n"
        "def phase_loss(self, accelerator, *args, **kwargs):\n"
        "    if accelerator.process_index == 1:\n"
        f"        raise torch.OutOfMemoryError({OUT_OF_MEMORY!r})\n"
        "    return real(self, accelerator, *args, **kwargs)\n\n"
        "AlignmentPhase.loss = phase_loss\nsys.exit(main())\n"
    )
    out = tmp_path / "out"
    flags = tiny_run_flags(tiny_models, tiny_data, out, skip_phase2=True)
    env = dict(os.environ, HF_HUB_OFFLINE="1", ACCELERATE_USE_CPU="true", PYTHONPATH=str(REPO))
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", str(driver), *flags],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode != 0
    ours = sorted(line for line in done.stderr.splitlines() if line.startswith("error: "))
    assert len(ours) == 2, done.stderr[-3000:]
    assert ours[0] == (  # rank 0, which was waiting for rank 1 in a gradient all-reduce: one line, no traceback
        "error: [rank 0] stopped: another process of this job failed (Connection closed by peer "
        f"{ours[0].split('peer ')[1].split(')')[0]}); its own error line (or traceback) above, or in its machine's "
        "log, says why"
    )
    assert ours[1].startswith(
        "error: [rank 1] phase1: the student ran out of device memory at optimizer step 1 (CUDA out of memory."
    )
    assert (
        "[rank0]: Traceback" not in done.stderr and "[rank1]: Traceback" not in done.stderr
    )  # (the launcher's is its own)
    assert not (out / "results.json").exists()


def test_only_a_lost_peer_is_reported_as_one(monkeypatch):
    from distill.distributed import lost_a_peer

    gloo = RuntimeError(
        "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
        "[127.0.0.1]:13192. This is typically caused by a remote worker crashing."
    )
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert lost_a_peer(gloo) is None  # alone there is no peer to lose
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert lost_a_peer(gloo) == "Connection closed by peer [127.0.0.1]:13192"
    assert lost_a_peer(torch.distributed.DistBackendError("NCCL communicator was aborted. More")) == (
        "NCCL communicator was aborted"
    )
    assert lost_a_peer(RuntimeError("mat1 and mat2 shapes cannot be multiplied")) is None  # a bug keeps its traceback
    assert lost_a_peer(torch.OutOfMemoryError("CUDA out of memory")) is None


@pytest.mark.multiprocess
def test_bad_input_under_the_relaunch_ends_on_its_error_line(tiny_models, tiny_data, tmp_path):
    """A bad input only the ranks find (the data's rows): one error line, no launcher traceback, exit 2."""
    make_overrides, pattern = CASES["only empty or non-string texts"]
    overrides = make_overrides(tiny_models, tiny_data, tmp_path)
    flags = tiny_run_flags(tiny_models, tiny_data, tmp_path / "out", **overrides)
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(REPO))
    done = subprocess.run(
        [sys.executable, "-m", "distill.train", "--num_processes", "2", *flags],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2, done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and re.search(pattern, errors[0]), done.stderr[-3000:]
    assert "Traceback" not in done.stderr and "ChildFailedError" not in done.stderr
    out = tmp_path / "out"
    assert not out.exists() or not any(out.iterdir())  # a rank stopped mid-probe may leave the empty folder
