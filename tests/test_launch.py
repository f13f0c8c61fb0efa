"""Topology: relaunching through accelerate, and run_ddp.sh's argument checks and CPU fallback."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import tiny_run_flags
from distill.distributed import RELAUNCHED, maybe_relaunch, relaunch_command, strip_flag
from distill.errors import DistillError
from distill.launch import launch

REPO = Path(__file__).resolve().parents[1]


def test_strip_flag_removes_both_spellings():
    argv = ["--num_processes", "8", "--batch_size", "4", "--num_processes=2", "--seed", "1"]
    assert strip_flag(argv, "num_processes") == ["--batch_size", "4", "--seed", "1"]


def test_relaunch_command_runs_this_module_on_n_processes_without_the_flag(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    command, env = relaunch_command(4, ["--num_processes", "4", "--batch_size", "2"])
    assert command[1:3] == ["-m", "distill.launch"]  # checks the inputs, then accelerate launch
    assert command[command.index("--num_processes") + 1] == "4"
    assert command[-4:] == ["-m", "distill.train", "--batch_size", "2"]
    assert env["ACCELERATE_USE_CPU"] == "true" and env[RELAUNCHED] == "1"


def test_an_accelerate_config_sets_the_topology_of_the_relaunch(monkeypatch):
    """The file's machine count is not overridden, its process count is used unless --num_processes is given."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv(RELAUNCHED, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    calls = []
    monkeypatch.setattr(subprocess, "call", lambda command, **kwargs: calls.append(command) or 0)
    config_dir = REPO / "accelerate_configs"
    assert maybe_relaunch(None, ["--seed", "3"], str(config_dir / "cpu_2proc.yaml")) == 0
    command = calls[-1]
    assert command[command.index("--num_processes") + 1] == "2" and "--multi_gpu" in command
    assert "--num_machines" not in command  # the file's, not a flag that overrides it
    assert command[-4:] == ["-m", "distill.train", "--seed", "3"]
    assert maybe_relaunch(None, [], str(config_dir / "single_gpu.yaml")) == 0  # one process: the file still applies
    assert "--multi_gpu" not in calls[-1]
    assert calls[-1][calls[-1].index("--config_file") + 1].endswith("single_gpu.yaml")
    assert maybe_relaunch(3, [], str(config_dir / "cpu_2proc.yaml")) == 0
    assert calls[-1][calls[-1].index("--num_processes") + 1] == "3"
    with pytest.raises(DistillError, match=r"multi_node\.yaml names 2 machines, but distill relaunches itself on this"):
        maybe_relaunch(16, [], str(config_dir / "multi_node.yaml"))
    assert len(calls) == 3
    monkeypatch.setenv(RELAUNCHED, "1")  # the relaunched process trains itself
    assert maybe_relaunch(None, [], str(config_dir / "cpu_2proc.yaml")) is None


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


def test_run_ddp_refuses_a_config_of_several_machines():
    """Its --num_machines 1 would silently override the file's two machines."""
    config = REPO / "accelerate_configs" / "multi_node.yaml"
    env = dict(os.environ, PYTHON=sys.executable, ACCELERATE_CONFIG=str(config))
    done = subprocess.run(
        ["bash", str(REPO / "run_ddp.sh"), "2", "True"], capture_output=True, text=True, timeout=120, env=env
    )
    assert done.returncode == 2
    assert "multi_node.yaml' names 2 machines, but run_ddp.sh runs NUM_GPUS processes on this machine" in done.stderr


FAKE_PYTHON = """#!/usr/bin/env bash
# stands in for the venv's python: reports FAKE_CUDA as (GPUs, compute capability) and prints the launch
if [[ "$1" == "-c" && "$2" == *get_device_capability* ]]; then echo "$FAKE_CUDA"; exit 0; fi
if [[ "$1" == "-c" && "$2" == *device_count* ]]; then echo "${{FAKE_CUDA%% *}}"; exit 0; fi  # the count alone
if [[ "$1" == "-m" && "$2" == "distill.launch" ]]; then shift 2; echo "LAUNCH $*"; exit 0; fi
exec {python} "$@"
"""


@pytest.mark.parametrize(
    ("cuda", "config", "precision", "note"),
    [
        ("8 9", None, "--mixed_precision bf16", False),  # H100
        ("8 8", None, "--mixed_precision bf16", False),  # A100
        ("8 7", None, "--mixed_precision fp16", True),  # V100 / T4: bf16 would run emulated
        ("8 9", "single_gpu.yaml", None, False),  # the file's precision holds
    ],
)
def test_run_ddp_picks_the_mixed_precision_the_gpus_have(tmp_path, cuda, config, precision, note):
    fake = tmp_path / "python"
    fake.write_text(FAKE_PYTHON.format(python=sys.executable))
    fake.chmod(0o755)
    env = dict(os.environ, PYTHON=str(fake), FAKE_CUDA=cuda)
    env.pop("ACCELERATE_CONFIG", None)
    if config:
        env["ACCELERATE_CONFIG"] = str(REPO / "accelerate_configs" / config)
    done = subprocess.run(
        ["bash", str(REPO / "run_ddp.sh"), "2", "True"], capture_output=True, text=True, timeout=120, env=env
    )
    assert done.returncode == 0, done.stderr
    launch = done.stdout.strip()
    assert launch.startswith("LAUNCH ") and "--num_processes 2" in launch and "--multi_gpu -m distill.train" in launch
    if precision:
        assert precision in launch
    else:
        assert "--mixed_precision" not in launch and "--config_file" in launch
    assert ("no native bf16: training in fp16" in done.stderr) == note


RESTARTED_WORKER = """
import os, torch, torch.distributed as dist
from datetime import timedelta
from distill.distributed import join_group_of_this_attempt
assert join_group_of_this_attempt(timedelta(seconds=30))
total = torch.tensor([float(os.environ["RANK"]) + 1])
dist.all_reduce(total)
print(total.item())
dist.destroy_process_group()
"""


@pytest.mark.multiprocess
def test_a_restarted_group_does_not_read_the_addresses_of_the_attempt_before(tmp_path):
    """torchelastic's shared store keeps attempt 0's keys; a restarted rank 0 that arrives first must not use them.

    Without the per-attempt prefix, attempt 1's rank 0 reads rank 1's stale gloo address and fails to connect
    (reproduced here with a plain `init_process_group`: 'Connection refused').
    """
    store = torch.distributed.TCPStore("127.0.0.1", 0, None, is_master=True, wait_for_workers=False)

    def worker(rank: int, attempt: int) -> subprocess.Popen:
        env = dict(
            os.environ,
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(store.port),
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE="2",
            TORCHELASTIC_USE_AGENT_STORE="True",
            TORCHELASTIC_MAX_RESTARTS="3",
            TORCHELASTIC_RESTART_COUNT=str(attempt),
        )
        return subprocess.Popen(
            [sys.executable, "-c", RESTARTED_WORKER],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    for attempt in (0, 1):
        first = worker(0, attempt)
        if attempt:
            time.sleep(3)  # rank 0 of the restart reads the store while rank 1's key is still attempt 0's
        workers = [first, worker(1, attempt)]
        for process in workers:
            out, err = process.communicate(timeout=120)
            assert process.returncode == 0, err[-3000:]
            assert out.strip() == "3.0"  # 1 + 2: both ranks in one group


@pytest.mark.parametrize(
    ("codes", "quiet"),
    [((2, 2), True), ((143, 143), True), ((3,), True), ((-15, 2), True), ((2, 1), False), ((-15,), False)],
)
def test_the_relaunch_leaves_out_the_launchers_report_of_stops_that_say_why(monkeypatch, tmp_path, codes, quiet):
    """Ranks that stopped on bad input (2), a NaN (3) or a signal (130, 143) printed why; a crash keeps the report."""
    import accelerate.commands.launch as accelerate_launch
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    def failing(args):
        failures = {
            rank: ProcessFailure(rank, 1000 + rank, code, str(tmp_path / "none")) for rank, code in enumerate(codes)
        }
        raise ChildFailedError("distill.train", failures)

    monkeypatch.setattr(accelerate_launch, "launch_command", failing)
    argv = ["--num_processes", str(len(codes)), "-m", "distill.train"]
    if quiet:  # a rank the launcher stopped with SIGTERM (-15) after the first failure is not what failed
        assert launch(argv) == next(code for code in codes if code > 0)
    else:
        with pytest.raises(ChildFailedError):
            launch(argv)


def test_the_launcher_stops_a_bad_input_and_launches_a_good_one(tiny_models, tiny_data, tmp_path, monkeypatch, capsys):
    """`python -m distill.launch`: the training flags are checked before `accelerate launch` runs, and only then."""
    import distill.launch
    from distill.launch import main as launch_main

    launched = []
    monkeypatch.setattr(distill.launch, "launch", lambda argv: launched.append(argv) or 0)
    launcher = ["--num_machines", "1", "--num_processes", "2", "-m", "distill.train"]
    good = tiny_run_flags(tiny_models, tiny_data, tmp_path / "out")
    assert launch_main([*launcher, *good]) == 0 and launched == [[*launcher, *good]]
    assert not (tmp_path / "out").exists()  # the probe leaves nothing behind
    missing = tiny_run_flags(tiny_models, tiny_data, tmp_path / "out", phase2_data=tmp_path / "nope.jsonl")
    assert launch_main([*launcher, *missing]) == 2 and len(launched) == 1
    assert capsys.readouterr().err.startswith(f"error: data file '{tmp_path / 'nope.jsonl'}' does not exist")
    skipped = [*missing, "--skip_phase2", "True", "--eval_data", "none"]  # a source the run does not read
    assert launch_main([*launcher, *skipped]) == 0 and len(launched) == 2
    other = ["--num_processes", "2", "train.py", "--phase1_lr", "-1"]  # not distill: nothing to check
    assert launch_main(other) == 0 and launched[-1] == other


def test_each_machines_processes_are_counted_by_host_where_the_launcher_does_not_say(monkeypatch):
    """LOCAL_WORLD_SIZE, where the launcher sets it; else the processes on this host, in rank order."""
    from types import SimpleNamespace

    import distill.distributed as distributed

    process = SimpleNamespace(local_process_index=1, process_index=3, num_processes=5)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert distributed.machine_share(process) == (1, 2)
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    monkeypatch.setattr(distributed.socket, "gethostname", lambda: "b")
    monkeypatch.setattr(distributed, "gather_object", lambda items: ["a", "b", "a", "b", "b"])  # rank 3 is on b
    assert distributed.machine_share(process) == (1, 3)
    assert distributed.machine_share(SimpleNamespace(local_process_index=0, process_index=0, num_processes=1)) == (0, 1)


def test_one_process_log_lines_carry_no_rank_prefix(monkeypatch: pytest.MonkeyPatch) -> None:
    """accelerate prefixes each line with its rank; alone, a process's lines go without it; in a job of several,
    each line keeps the rank that said it."""
    import logging

    from distill.distributed import OneProcessLines

    def shown(world: str) -> str:
        monkeypatch.setenv("WORLD_SIZE", world)
        record = logging.LogRecord("distill.pipeline", logging.INFO, __file__, 1, "[RANK 0] data ...", None, None)
        OneProcessLines().filter(record)
        return record.getMessage()

    assert shown("1") == "data ..."
    assert shown("2") == "[RANK 0] data ..."
