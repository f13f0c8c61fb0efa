"""Topology: relaunching through accelerate, and run_ddp.sh's argument checks and CPU fallback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import tiny_run_flags
from distill.errors import DistillError
from distill.launch import RELAUNCHED, maybe_relaunch, relaunch_command, strip_flag

REPO = Path(__file__).resolve().parents[1]


def test_strip_flag_removes_both_spellings():
    argv = ["--num_processes", "8", "--batch_size", "4", "--num_processes=2", "--seed", "1"]
    assert strip_flag(argv, "num_processes") == ["--batch_size", "4", "--seed", "1"]


def test_relaunch_command_runs_this_module_on_n_processes_without_the_flag(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    command, env = relaunch_command(4, ["--num_processes", "4", "--batch_size", "2"])
    assert command[1:3] == ["-m", "accelerate.commands.launch"]
    assert command[command.index("--num_processes") + 1] == "4"
    assert command[-4:] == ["-m", "distill.train", "--batch_size", "2"]
    assert env["ACCELERATE_USE_CPU"] == "true" and env[RELAUNCHED] == "1"


def test_no_relaunch_when_already_at_the_asked_size(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert maybe_relaunch(2, []) is None
    assert maybe_relaunch(None, []) is None


def test_num_processes_disagreeing_with_the_launch_is_an_error(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(DistillError, match="disagrees with the 2 processes"):
        maybe_relaunch(8, [])


def test_more_processes_than_gpus_is_an_error(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(DistillError, match="more processes than the 2 visible GPUs"):
        maybe_relaunch(8, [])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([], "usage:"),
        (["eight", "True"], "NUM_GPUS must be a positive integer, got 'eight'"),
        (["0", "True"], "NUM_GPUS must be a positive integer, got '0'"),
        (["2", "maybe"], "USE_PROJECTION must be True or False, got 'maybe'"),
        (["2; rm -rf /", "True"], "NUM_GPUS must be a positive integer"),
    ],
)
def test_run_ddp_validates_its_positional_arguments(args, message):
    done = subprocess.run(["bash", str(REPO / "run_ddp.sh"), *args], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert message in done.stderr


@pytest.mark.multiprocess
def test_run_ddp_without_gpus_runs_cpu_processes(tiny_models, tiny_data, tmp_path):
    out = tmp_path / "run_ddp"
    flags = tiny_run_flags(tiny_models, tiny_data, out, skip_phase2=True, eval_data="none")
    env = dict(os.environ, PYTHON=sys.executable, HF_HUB_OFFLINE="1", CUDA_VISIBLE_DEVICES="")
    done = subprocess.run(
        ["bash", str(REPO / "run_ddp.sh"), "2", "False", *flags],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert "no CUDA GPU found" in done.stderr
    results = json.loads((out / "results.json").read_text())
    assert results["world_size"] == 2 and results["mode"] == "matryoshka"
