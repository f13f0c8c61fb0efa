"""Checkpoints: kill, preempt, restart, resume - and reach the same weights as a run that was never interrupted."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from safetensors.torch import load_file

from conftest import reset_accelerate, shared_folder, tiny_run_flags
from distill.checkpoint import TrainingState, find_checkpoint, list_checkpoints, read_state
from distill.errors import DistillError
from distill.files import check
from distill.store import KEY

REPO = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")


def flags(tiny_models, tiny_data, out: Path, cache: Path, **extra) -> list[str]:
    """A run long enough to be interrupted: 4 + 3 epochs, a checkpoint every 3 optimizer steps.

    Phase 2 keeps a cross-batch passage memory, and the student has dropout: a resume that lost the memory, or
    did not continue torch's generator where the stopped run left it, would not reach the same weights.
    """
    settings = dict(
        student_model=tiny_models["dropout_student"],
        phase1_epochs=4,
        phase2_epochs=3,
        kl_memory_steps=2,
        checkpoint_steps=3,
        checkpoints_total_limit=3,
        save_to_artifacts=True,
        teacher_cache_dir=cache,
        eval_data="none",
    )
    settings.update(extra)
    return tiny_run_flags(tiny_models, tiny_data, out, **settings)


def command(num_processes: int, argv: list[str], *launch_args: str) -> list[str]:
    if num_processes == 1 and not launch_args:
        return [sys.executable, "-m", "distill.train", *argv]
    launch = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--num_processes",
        str(num_processes),
        "--multi_gpu",
        *launch_args,
    ]
    if "--num_machines" not in launch_args:
        launch += ["--num_machines", "1", "--main_process_port", str(free_port())]
    return [*launch, "-m", "distill.train", *argv]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def finish(cmd: list[str], timeout: int = 600) -> subprocess.CompletedProcess:
    done = subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stderr[-5000:]}"
    return done


def start(cmd: list[str]) -> subprocess.Popen:
    return subprocess.Popen(
        cmd, cwd=REPO, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True
    )


def wait_for_checkpoint(out: Path, phase: str, process: subprocess.Popen, timeout: float = 300) -> Path:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = [p for p in list_checkpoints(out / "checkpoints") if p.name.startswith(f"checkpoint-{phase}")]
        if found:
            return found[-1]
        if process.poll() is not None:
            pytest.fail(f"the run ended before a {phase} checkpoint appeared:\n{process.stderr.read()[-3000:]}")
        time.sleep(0.02)
    pytest.fail(f"no {phase} checkpoint within {timeout}s")


def training_processes(launcher: subprocess.Popen) -> list[psutil.Process]:
    """The ranks a launcher started (its descendants that run distill.train), in start order."""
    return [
        p
        for p in psutil.Process(launcher.pid).children(recursive=True)
        if "distill.train" in " ".join(p.cmdline()) and p.pid != launcher.pid
    ]


def outlived_by(killed: subprocess.Popen, others: list[psutil.Process]) -> tuple[str, list[psutil.Process]]:
    """The killed process's stderr and which of `others` still run once they had time to stop (then killed).

    Reading stderr to its end waits for the others too: they inherited it and hold it open until they exit.
    """
    try:
        _, stderr = killed.communicate(timeout=120)
        _, alive = psutil.wait_procs(others, timeout=30)
    finally:
        for process in others:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()
    return stderr, alive


def weights(out: Path) -> dict[str, torch.Tensor]:
    folder = out / "artifacts" / "model"
    found = {}
    for file in sorted(folder.rglob("model.safetensors")):
        found.update({f"{file.parent.name}.{k}": v for k, v in load_file(str(file)).items()})
    return found


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


@pytest.fixture(scope="session")
def reference(tiny_models, tiny_data, tmp_path_factory) -> dict[int, dict[str, torch.Tensor]]:
    """Uninterrupted runs on 1 and 2 processes, to compare interrupted ones with (made once per session)."""

    def make(root: Path) -> None:
        for n in (1, 2):
            finish(command(n, flags(tiny_models, tiny_data, root / f"n{n}", root / "cache")))

    root = shared_folder(tmp_path_factory, "reference", make)
    return {n: weights(root / f"n{n}") for n in (1, 2)}


def interrupt(process: subprocess.Popen, how: str, out: Path, phase: str) -> str:
    """Interrupt a run once it has a checkpoint of `phase` (newer than those it started with); its stderr.

    how: "kill" SIGKILLs the launcher's whole group, with no chance to clean up (the ranks of a multi-process
    launch, which torch elastic starts in sessions of their own, stop on their parent-death SIGTERM and
    checkpoint); "term" / "int" send SIGTERM / SIGINT to a single-process run, or to the last rank only.
    """
    before = set(list_checkpoints(out / "checkpoints"))
    deadline = time.monotonic() + 300
    while not [
        p for p in set(list_checkpoints(out / "checkpoints")) - before if p.name.startswith(f"checkpoint-{phase}")
    ]:
        if process.poll() is not None:
            pytest.fail(f"the run ended before a new {phase} checkpoint appeared:\n{process.stderr.read()[-3000:]}")
        assert time.monotonic() < deadline, f"no new {phase} checkpoint within 300 s"
        time.sleep(0.02)
    workers = training_processes(process)
    if how == "kill":
        os.killpg(process.pid, signal.SIGKILL)
        stderr, alive = outlived_by(process, workers)
        assert not alive, f"ranks still running after their launcher was killed: {alive}"
        return stderr
    stop = {"term": signal.SIGTERM, "int": signal.SIGINT}[how]
    (workers[-1] if workers else psutil.Process(process.pid)).send_signal(stop)
    _, stderr = process.communicate(timeout=300)
    exit_code = {"term": 143, "int": 130}[how]
    assert process.returncode == exit_code if not workers else process.returncode != 0, stderr[-3000:]
    assert f"stopped by {stop.name} in {phase}" in stderr and "--resume_from_checkpoint latest" in stderr
    assert set(list_checkpoints(out / "checkpoints")) - before, "no checkpoint was written on the way out"
    return stderr


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("num_processes", "first", "second"), [(1, "kill", "int"), (2, "term", "kill")], ids=["1-process", "2-processes"]
)
def test_stopped_in_both_phases_then_resumed_reaches_the_uninterrupted_weights(
    num_processes, first, second, reference, tiny_models, tiny_data, tmp_path
):
    """Stopped in phase 1, resumed, stopped again in phase 2, resumed: the weights of a run never interrupted.

    Each stop is of another kind. One process: SIGKILL (nothing saved on the way out: the resume starts from the
    last periodic checkpoint), then a Ctrl-C (finish the step, checkpoint, exit 130). Two processes: SIGTERM to
    one rank only (the stop flag travels in the per-batch loss reduction, so the other rank stops at the same step
    and rank 0 says so), then SIGKILL to the launcher (its ranks stop on their parent-death SIGTERM, with a
    checkpoint). Both phases keep a moving average and phase 2 a passage memory, which a resume must restore.
    """
    out = tmp_path / "stopped"
    argv = flags(tiny_models, tiny_data, out, tmp_path / "cache")
    resume = [*argv, "--resume_from_checkpoint", "latest"]
    interrupt(start(command(num_processes, argv)), first, out, "phase1")  # 2 processes: rank 0 says it stopped
    stderr = interrupt(start(command(num_processes, resume)), second, out, "phase2")
    assert "resuming from" in stderr and "checkpoint-phase1" in stderr
    if num_processes > 1:  # a launcher died: its ranks stopped by themselves, with a checkpoint
        assert "stopped by SIGTERM in phase2" in stderr, stderr[-3000:]
    assert not (out / "results.json").exists(), "the run finished before it was stopped"
    finish(command(num_processes, resume))
    assert max_difference(weights(out), reference[num_processes]) <= 1e-6
    assert json.loads((out / "results.json").read_text())["world_size"] == num_processes


@pytest.mark.multiprocess
def test_a_killed_relaunching_process_takes_its_launcher_and_ranks_with_it(tiny_models, tiny_data, tmp_path):
    """`python -m distill.train --num_processes 2` runs `accelerate launch` as a child: SIGKILL to it stops all."""
    out = tmp_path / "relaunched"
    process = start(
        [sys.executable, "-m", "distill.train", *flags(tiny_models, tiny_data, out, tmp_path / "cache")]
        + ["--num_processes", "2"]
    )
    wait_for_checkpoint(out, "phase1", process)
    descendants = psutil.Process(process.pid).children(recursive=True)  # accelerate launch and its 2 ranks
    assert len(training_processes(process)) == 3, descendants
    process.kill()  # this process only, not its group: its child, `accelerate launch`, is not signalled
    stderr, alive = outlived_by(process, descendants)
    assert not alive, f"still running after the relaunching process was killed: {alive}"
    assert "stopped by SIGTERM in phase" in stderr, stderr[-3000:]
    assert not (out / "results.json").exists(), "the run finished before it was killed"


@pytest.mark.multiprocess
def test_ctrl_c_on_a_relaunching_process_stops_its_ranks_as_sigint(tiny_models, tiny_data, tmp_path):
    """A terminal's Ctrl-C goes to the foreground process group: the relaunching process and `accelerate launch`.

    The relaunching process waits for the launcher instead of raising KeyboardInterrupt and killing it (whose
    ranks then raced the launcher's SIGINT against the parent-death SIGTERM); the ranks checkpoint and say SIGINT.
    """
    out = tmp_path / "relaunched-ctrl-c"
    process = start(
        [sys.executable, "-m", "distill.train", *flags(tiny_models, tiny_data, out, tmp_path / "cache")]
        + ["--num_processes", "2"]
    )
    wait_for_checkpoint(out, "phase1", process)
    descendants = psutil.Process(process.pid).children(recursive=True)
    before = set(list_checkpoints(out / "checkpoints"))
    os.killpg(process.pid, signal.SIGINT)  # the group `start` made: this process and its `accelerate launch`
    stderr, alive = outlived_by(process, descendants)
    assert not alive, f"still running after Ctrl-C: {alive}"
    assert "stopped by SIGINT in phase" in stderr, stderr[-3000:]
    assert "stopped by SIGTERM" not in stderr
    assert "KeyboardInterrupt" not in stderr, stderr[-3000:]  # the relaunching process waited, did not kill
    assert set(list_checkpoints(out / "checkpoints")) - before, "no checkpoint was written on the way out"
    assert not (out / "results.json").exists(), "the run finished before Ctrl-C"


def test_a_sigterm_between_phases_is_kept_for_the_next_phase():
    """Each phase installs the handler; a SIGTERM caught before phase 2's loop (its teacher encoding) still counts."""
    from distill.signals import PREEMPTION

    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    try:
        PREEMPTION.install()
        assert not PREEMPTION.requested
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.1)  # Python runs the handler at its next check
        assert PREEMPTION.requested
        PREEMPTION.install()  # the next phase
        assert PREEMPTION.requested
    finally:
        signal.signal(signal.SIGTERM, before[0])
        signal.signal(signal.SIGINT, before[1])  # install took Ctrl-C too
        PREEMPTION.requested = False


def test_a_first_sigint_is_noted_and_a_second_interrupts_at_once():
    """Ctrl-C once: a flag, like SIGTERM, and Python's handler is back; again: KeyboardInterrupt. `release` (training
    over) restores the handler found at install."""
    from distill.signals import PREEMPTION, release_stop_signals

    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    try:
        PREEMPTION.install()
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.1)  # Python runs the handler at its next check
        assert PREEMPTION.interrupted and not PREEMPTION.requested
        PREEMPTION.install()  # the next phase: the flag stays, and so does the immediate second Ctrl-C
        assert PREEMPTION.interrupted
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.1)
        PREEMPTION.install()
        release_stop_signals()
        assert not PREEMPTION.interrupted and signal.getsignal(signal.SIGINT) == before[0]
    finally:
        signal.signal(signal.SIGINT, before[0])
        signal.signal(signal.SIGTERM, before[1])
        PREEMPTION.requested = PREEMPTION.interrupted = False


@pytest.mark.multiprocess
@pytest.mark.parametrize("rendezvous", ["static", "c10d"])  # accelerate's default, and torchrun's
def test_elastic_restart_resumes_after_one_rank_dies(rendezvous, reference, tiny_models, tiny_data, tmp_path):
    """Under --max_restarts, a rank killed mid-run makes the group restart and pick up the latest checkpoint.

    Both rendezvous backends keep one store for every attempt; the restarted group must not read the keys of
    the killed one (distill.distributed.join_group_of_this_attempt), or it hangs joining gloo's mesh.
    """
    out = tmp_path / "elastic"
    argv = [*flags(tiny_models, tiny_data, out, tmp_path / "cache"), "--ddp_timeout", "120"]
    process = start(command(2, argv, "--max_restarts", "3", "--monitor_interval", "1", "--rdzv_backend", rendezvous))
    wait_for_checkpoint(out, "phase1", process)
    workers = training_processes(process)
    assert len(workers) == 2
    workers[-1].kill()
    _, stderr = process.communicate(timeout=600)
    assert process.returncode == 0, stderr[-4000:]
    assert "resuming from" in stderr  # the restarted group picked up the checkpoint rather than starting over
    results = json.loads((out / "results.json").read_text())
    assert results["world_size"] == 2
    assert max_difference(weights(out), reference[2]) <= 1e-6


@pytest.mark.multiprocess
def test_two_machines_of_one_process_match_one_machine_of_two(reference, tiny_models, tiny_data, tmp_path):
    out = tmp_path / "multinode"
    argv = flags(tiny_models, tiny_data, out, tmp_path / "cache", checkpoint_steps=0)
    port = str(free_port())
    machines = [
        start(
            command(
                2,
                argv,
                "--num_machines",
                "2",
                "--machine_rank",
                str(rank),
                "--main_process_ip",
                "127.0.0.1",
                "--main_process_port",
                port,
            )
        )
        for rank in (0, 1)
    ]
    for machine in machines:
        _, stderr = machine.communicate(timeout=600)
        assert machine.returncode == 0, stderr[-4000:]
    assert json.loads((out / "results.json").read_text())["world_size"] == 2
    assert max_difference(weights(out), reference[2]) <= 1e-6
    # one cache folder stands for a filesystem both machines share: one machine wrote each entry (the other, of the
    # same job, read it), each entry is whole, and neither left a staging folder or a lock behind
    kept = sorted((tmp_path / "cache").iterdir())
    assert [p.name for p in kept if p.name.startswith(".")] == []
    assert [p.name for p in kept if KEY.fullmatch(p.name) and check(p) is not None] == []
    assert not (out / "checkpoints").exists()  # the end-of-training checkpoint went once the export was in place


def test_non_finite_loss_stops_with_a_checkpoint_from_before_it(tiny_models, tiny_data, tmp_path, capsys):
    from distill.train import main

    out = tmp_path / "nan"
    argv = tiny_run_flags(
        tiny_models,
        tiny_data,
        out,
        phase1_lr=1e30,
        max_grad_norm=0,
        skip_phase2=True,
        eval_data="none",
        teacher_cache_dir=tmp_path / "cache",
        phase1_epochs=3,
    )
    assert main(argv) == 3
    message = capsys.readouterr().err
    assert "non-finite loss" in message and "in phase1 at optimizer step" in message
    checkpoint = find_checkpoint(out, "latest")
    assert checkpoint is not None
    saved = load_file(str(checkpoint / "model.safetensors"))
    assert all(torch.isfinite(t).all() for t in saved.values())
    assert not (out / "results.json").exists()


def test_a_checkpoint_from_another_run_is_refused(tmp_path):
    folder = tmp_path / "checkpoints" / "checkpoint-phase1-0000003"
    folder.mkdir(parents=True)
    state = TrainingState(identity={"teacher_model": "teacher-a", "student_model": "s"})
    (folder / "state.json").write_text(json.dumps(dataclasses.asdict(state)))
    with pytest.raises(DistillError, match="comes from a different run .*teacher_model: checkpoint has 'teacher-a'"):
        read_state(folder, {"teacher_model": "teacher-b", "student_model": "s"})


def test_latest_ignores_incomplete_checkpoints_and_bad_paths_are_errors(tmp_path):
    root = tmp_path / "checkpoints"
    for name, complete in (
        ("checkpoint-phase1-0000003", True),
        ("checkpoint-phase2-0000001", True),
        ("checkpoint-phase2-0000002", False),
        (".tmp-checkpoint-phase2-0000003", True),
    ):
        (root / name).mkdir(parents=True)
        if complete:
            (root / name / "state.json").write_text("{}")
    assert find_checkpoint(tmp_path, "latest").name == "checkpoint-phase2-0000001"
    assert find_checkpoint(tmp_path / "elsewhere", "latest") is None
    with pytest.raises(DistillError, match="is not a checkpoint folder"):
        find_checkpoint(tmp_path, str(root / "checkpoint-phase2-0000002"))


def test_resume_refuses_other_training_settings_and_allows_the_same_global_batch(tmp_path):
    """Data order and schedule follow seed, epochs and the global batch: a checkpoint resumes only under the same."""
    from distill.checkpoint import run_identity
    from distill.config import load_config

    def identity(*argv: str, world: int = 1) -> dict:
        return run_identity(load_config(["--teacher_model", "t", "--student_model", "s", *argv]), world)

    folder_state = TrainingState(identity=json.loads(json.dumps(identity("--batch_size", "16", world=1))))

    said: list[str] = []

    def resume_with(*argv: str, world: int = 1, state: TrainingState = folder_state) -> TrainingState:
        (tmp_path / "state.json").write_text(json.dumps(dataclasses.asdict(state)))
        return read_state(tmp_path, identity(*argv, world=world), said.append)

    assert resume_with("--batch_size", "8", world=2).identity["global_batch_size"] == 16  # elastic, same global
    resume_with("--batch_size", "16", "--mixed_precision", "bf16", "--teacher_batch_size", "64")  # speed only
    with pytest.raises(DistillError, match=r"global_batch_size: checkpoint has 16, this run 8.*--batch_size times"):
        resume_with("--batch_size", "8")
    with pytest.raises(DistillError, match=r"different run \(seed: checkpoint has 42, this run 7\)"):
        resume_with("--batch_size", "16", "--seed", "7")
    with pytest.raises(DistillError, match=r"gradient_accumulation_steps: checkpoint has 1, this run 2"):
        resume_with("--batch_size", "16", "--gradient_accumulation_steps", "2")
    # phase 2 starts afresh from a phase-1 checkpoint, under any phase-2 settings; a phase-2 checkpoint keeps its own
    trial = ("--batch_size", "16", "--phase2_epochs", "9", "--mnrl_weight", "8", "--mine_hard_negatives", "1")
    assert resume_with(*trial).identity == identity(*trial)
    assert said == [
        f"checkpoint {tmp_path} is from phase 1; phase 2 trains with this run's settings (mine_hard_negatives 0 -> 1, "
        "phase2_epochs 3 -> 9, mnrl_weight 4.0 -> 8.0)"
    ]
    in_phase2 = dataclasses.replace(folder_state, phase="phase2")
    with pytest.raises(DistillError, match=r"phase2_epochs: checkpoint has 3, this run 9"):
        resume_with(*trial, state=in_phase2)
    with pytest.raises(DistillError, match=r"phase1_epochs: checkpoint has 1, this run 2"):
        resume_with("--batch_size", "16", "--phase1_epochs", "2")
    old = TrainingState(identity={"teacher_model": "t", "student_model": "s"})  # an older checkpoint's identity
    assert resume_with("--batch_size", "8", state=old).identity == old.identity


def test_a_phase1_checkpoint_tries_other_phase2_settings_as_runs_that_had_them_from_the_start(
    tiny_models, tiny_data, tmp_path, caplog
):
    """One phase-1 run serves several phase-2 trials (docs/checkpoints.md): its last checkpoint, resumed in another
    --output_dir with other phase-2 settings, trains the weights of a run given those settings from the start."""
    from distill.train import main

    def run(out: Path, *extra: str) -> None:
        argv = tiny_run_flags(
            tiny_models, tiny_data, out, teacher_cache_dir=tmp_path / "cache", eval_data="none", save_to_artifacts=True
        )
        assert main([*argv, *extra]) == 0
        reset_accelerate()

    trial = ("--phase2_lr", "3e-4", "--mnrl_weight", "2", "--mine_hard_negatives", "1", "--kl_weight", "0.5")
    run(tmp_path / "phase1", "--skip_phase2", "True", "--checkpoint_steps", "1000")  # keeps its last checkpoint
    (checkpoint,) = list_checkpoints(tmp_path / "phase1" / "checkpoints")
    run(tmp_path / "trial", *trial, "--resume_from_checkpoint", str(checkpoint))
    assert "phase 2 trains with this run's settings (mine_hard_negatives 0 -> 1" in caplog.text
    run(tmp_path / "whole", *trial)
    assert max_difference(weights(tmp_path / "trial"), weights(tmp_path / "whole")) == 0
    trained = json.loads((tmp_path / "trial" / "results.json").read_text())["phases"]["phase2"]
    assert trained["terms"]["mnrl"] == 2.0 and trained["negatives"]["per_query"] == 1


def test_a_fresh_run_refuses_an_output_dir_with_an_earlier_runs_checkpoints(tiny_models, tiny_data, tmp_path, capsys):
    """Its checkpoints would be pruned in favour of the earlier ones, and `latest` would pick those."""
    from distill.train import main

    out = tmp_path / "reused"
    earlier = out / "checkpoints" / "checkpoint-phase2-0000012"
    earlier.mkdir(parents=True)
    (earlier / "state.json").write_text(json.dumps(dataclasses.asdict(TrainingState())))
    argv = tiny_run_flags(tiny_models, tiny_data, out, teacher_cache_dir=tmp_path / "cache", eval_data="none")
    assert main(argv) == 2
    message = capsys.readouterr().err
    assert "holds checkpoints of an earlier run (checkpoint-phase2-0000012, ...)" in message
    assert "--resume_from_checkpoint latest" in message
    assert (earlier / "state.json").is_file() and not (out / "results.json").exists()


def signal_at_call(monkeypatch: pytest.MonkeyPatch, call: int, make) -> None:
    """Wrap the phase loss so that its `call`-th call (a micro-batch) does `make(loss, reported)` first."""
    from distill.phases import AlignmentPhase

    calls = [0]
    phase_loss = AlignmentPhase.loss

    def wrapped(*args, **kwargs):
        calls[0] += 1
        loss, reported = phase_loss(*args, **kwargs)
        return make(loss, reported) if calls[0] == call else (loss, reported)

    monkeypatch.setattr(AlignmentPhase, "loss", wrapped)


def short_run_flags(tiny_models, tiny_data, out: Path, cache: Path, **extra) -> list[str]:
    """Phase 1 only, 6 optimizer steps, evaluated every 2, the best model kept."""
    settings = dict(skip_phase2=True, max_samples_phase1=48, eval_steps=2, keep_best=True, teacher_cache_dir=cache)
    return tiny_run_flags(tiny_models, tiny_data, out, **{**settings, **extra})


@pytest.fixture(scope="session")
def evaluated_run(tiny_models, tiny_data, tmp_path_factory) -> Path:
    from distill.train import main

    def make(root: Path) -> None:
        assert main(short_run_flags(tiny_models, tiny_data, root / "run", root / "cache")) == 0
        reset_accelerate()

    return shared_folder(tmp_path_factory, "evaluated", make) / "run"


@pytest.mark.parametrize(("stop", "exit_code"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)], ids=["TERM", "INT"])
def test_a_stop_on_an_evaluation_step_leaves_that_evaluation_to_the_resume(
    stop, exit_code, evaluated_run, tiny_models, tiny_data, tmp_path, monkeypatch, capsys
):
    """Stopped at step 4 of 6 (evaluated every 2) by SIGTERM or a Ctrl-C: the checkpoint marks step 4's evaluation
    as pending, and the resumed run's evaluations are the uninterrupted run's."""
    from distill.signals import PREEMPTION
    from distill.train import main

    out = tmp_path / "stopped"
    argv = short_run_flags(tiny_models, tiny_data, out, evaluated_run.parent / "cache")

    def send(loss, reported):
        os.kill(os.getpid(), stop)
        return loss, reported

    signal_at_call(monkeypatch, 4, send)
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    try:
        assert main(argv) == exit_code
    finally:
        signal.signal(signal.SIGTERM, before[1])
        PREEMPTION.requested = False
    assert signal.getsignal(signal.SIGINT) == before[0]  # training is over: Ctrl-C interrupts at once again
    assert f"stopped by {stop.name} in phase1 at optimizer step 4;" in capsys.readouterr().err
    checkpoint = find_checkpoint(out, "latest")
    state = read_state(checkpoint, {})
    assert checkpoint.name == "checkpoint-phase1-0000004" and state.evaluation_pending
    assert [h["step"] for h in state.results.evaluations["phase1"]] == [2]
    monkeypatch.undo()
    reset_accelerate()
    assert main([*argv, "--resume_from_checkpoint", "latest"]) == 0
    history = json.loads((out / "results.json").read_text())["evaluations"]["phase1"]
    expected = json.loads((evaluated_run / "results.json").read_text())["evaluations"]["phase1"]
    assert [h["step"] for h in history] == [h["step"] for h in expected] == [2, 4, 6]
    for got, want in zip(history, expected):
        assert got == pytest.approx(want, abs=1e-5)
    cards = [(run / "best" / "phase1" / "model" / "README.md").read_text() for run in (out, evaluated_run)]
    kept = [re.search(r"best of phase1[^:]*", card).group() for card in cards]
    assert kept[0] == kept[1]  # the same step's model is kept


def test_a_non_finite_loss_mid_window_rolls_back_the_windows_samples_too(tiny_models, tiny_data, tmp_path, monkeypatch):
    """Accumulating 2 micro-batches a step, the 2nd micro-batch of step 2 is not finite: the checkpoint holds step 1's
    counts (2 micro-batches, 16 samples), not the half-done window's."""
    from distill.train import main

    out = tmp_path / "nan"
    argv = short_run_flags(
        tiny_models,
        tiny_data,
        out,
        tmp_path / "cache",
        gradient_accumulation_steps=2,
        eval_data="none",
        keep_best=False,
    )
    signal_at_call(monkeypatch, 4, lambda loss, reported: (loss * float("nan"), reported * float("nan")))
    assert main(argv) == 3
    state = read_state(find_checkpoint(out, "latest"), {})
    assert (state.optimizer_steps, state.batches_done, state.train_samples) == (1, 2, 16)


def test_every_rank_resumes_from_the_checkpoint_the_main_process_found(tmp_path, monkeypatch):
    """`latest` is resolved on the main process only and broadcast: another rank never looks for itself."""
    from types import SimpleNamespace

    import distill.distributed
    from distill.checkpoint import resume_point
    from distill.config import build_config

    root = tmp_path / "checkpoints"
    for name in ("checkpoint-phase1-0000003", "checkpoint-phase1-0000006"):
        (root / name).mkdir(parents=True)
        (root / name / "state.json").write_text("{}")
    config = build_config({"output_dir": str(tmp_path), "resume_from_checkpoint": "latest", "log_with": "none"})
    sent = []
    monkeypatch.setattr(distill.distributed, "broadcast_object_list", lambda found: sent.append(list(found)))
    main_process = SimpleNamespace(is_main_process=True, num_processes=2)
    assert resume_point(main_process, config) == root / "checkpoint-phase1-0000006"
    assert sent == [[(root / "checkpoint-phase1-0000006", None)]]

    def receive(found: list) -> None:  # what the main process sent, whatever this rank would find
        found[0] = (str(root / "checkpoint-phase1-0000003"), None)

    monkeypatch.setattr(distill.distributed, "broadcast_object_list", receive)
    other_rank = SimpleNamespace(is_main_process=False, num_processes=2)
    assert resume_point(other_rank, config) == root / "checkpoint-phase1-0000003"
    monkeypatch.setattr(distill.distributed, "broadcast_object_list", lambda found: found.__setitem__(0, (None, "bad")))
    with pytest.raises(DistillError, match="^bad$"):  # the main process's error, on every rank
        resume_point(other_rank, config)


def test_checkpoints_total_limit_keeps_the_newest_and_removes_the_oldest(tiny_models, tiny_data, tmp_path):
    """32 steps, a checkpoint every 4, at most 3 kept: steps 24, 28 and 32 remain, the older ones are gone."""
    from distill.train import main

    out = tmp_path / "run"
    flags = dict(skip_phase2=True, eval_data="none", checkpoint_steps=4, checkpoints_total_limit=3)
    assert main(tiny_run_flags(tiny_models, tiny_data, out, **flags)) == 0
    kept = [path.name for path in list_checkpoints(out / "checkpoints")]
    assert kept == ["checkpoint-phase1-0000024", "checkpoint-phase1-0000028", "checkpoint-phase1-0000032"]
    assert sorted(p.name for p in (out / "checkpoints").iterdir() if p.name.startswith("checkpoint-")) == kept


POISONED_TRAIN = '''
import os
import sys

from distill.phases import AlignmentPhase
from distill.train import main

calls, loss = [0], AlignmentPhase.loss


def poisoned(*args, **kwargs):
    """The 5th batch of the rank POISONED_RANK names has a NaN loss; the other rank's never does."""
    calls[0] += 1
    value, reported = loss(*args, **kwargs)
    if os.environ["RANK"] == os.environ["POISONED_RANK"] and calls[0] == 5:
        return value * float("nan"), reported * float("nan")
    return value, reported


AlignmentPhase.loss = poisoned
code = main(sys.argv[1:])
with open(os.environ["EXIT_CODES"] + "." + os.environ["RANK"], "w") as out:  # each rank's own, before any kill
    out.write(str(code))
sys.exit(code)
'''


@pytest.mark.multiprocess
def test_a_non_finite_loss_on_one_process_stops_every_process_at_the_same_step(tiny_models, tiny_data, tmp_path):
    """Two processes, a NaN loss on rank 1 alone at step 5: both stop (exit code 3, no hang), and the one checkpoint
    left holds a clean two-process run's step 4, bit for bit."""
    script = tmp_path / "poisoned_train.py"
    script.write_text(POISONED_TRAIN)
    settings = dict(skip_phase2=True, eval_data="none", max_samples_phase1=96, ddp_timeout=60, batch_size=8)

    def launch(out: Path, rank: str, **extra) -> subprocess.CompletedProcess:
        command = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "2", "--multi_gpu"]
        command += ["--num_machines", "1", "--main_process_port", str(free_port()), str(script)]
        command += tiny_run_flags(tiny_models, tiny_data, out, **settings, **extra)
        env = dict(ENV, POISONED_RANK=rank, EXIT_CODES=str(out / "exit"))
        return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)

    clean = launch(tmp_path / "clean", "none", checkpoint_steps=4)
    assert clean.returncode == 0, clean.stderr[-4000:]
    done = launch(tmp_path / "poisoned", "1")
    # rank 0's loss was finite: its run returning 3 shows that it stopped at rank 1's step on its own, not that the
    # launcher killed it; `accelerate launch` itself then exits 1 (distill's relaunch passes the 3 on)
    assert done.returncode == 1, done.stderr[-4000:]
    assert [(tmp_path / "poisoned" / f"exit.{r}").read_text() for r in (0, 1)] == ["3", "3"], done.stderr[-4000:]
    assert "non-finite loss (nan) in phase1 at optimizer step 5" in done.stderr
    left = list_checkpoints(tmp_path / "poisoned" / "checkpoints")
    assert [c.name for c in left] == ["checkpoint-phase1-0000004"]
    state = read_state(left[0], {})
    assert (state.optimizer_steps, state.train_samples) == (4, 64)
    reference = tmp_path / "clean" / "checkpoints" / "checkpoint-phase1-0000004"
    assert state.losses == read_state(reference, {}).losses
    got, want = (load_file(str(c / "model.safetensors")) for c in (left[0], reference))
    assert max_difference(got, want) == 0.0


def test_a_sigterm_after_training_keeps_the_trained_model_and_the_resume_only_exports(
    evaluated_run, tiny_models, tiny_data, tmp_path, monkeypatch, capsys
):
    """SIGTERM during the cost stage, after the last step: the run stops with 143 at the next stage, and the
    checkpoint saved as training ended holds the trained student (the signal used to be noted and ignored, and a
    scheduler's SIGKILL after its grace period left no checkpoint and no model). A resume after the data file changed
    is refused in one line; with the data as it was, it trains nothing, ends as the uninterrupted run, and removes
    the checkpoint (this run keeps none)."""
    from distill import pipeline
    from distill.signals import PREEMPTION
    from distill.train import main

    texts = tmp_path / "texts.txt"
    shutil.copy2(tiny_data["texts"], texts)
    out = tmp_path / "late"
    argv = short_run_flags(tiny_models, {**tiny_data, "texts": texts}, out, tmp_path / "cache")
    real_cost = pipeline.cost_stage

    def sigterm_then_cost(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        return real_cost(*args, **kwargs)

    monkeypatch.setattr(pipeline, "cost_stage", sigterm_then_cost)
    before = signal.getsignal(signal.SIGTERM)
    try:
        assert main(argv) == 143
    finally:
        signal.signal(signal.SIGTERM, before)
        PREEMPTION.requested = False
    assert "stopped by SIGTERM after training; the trained student is in checkpoint" in capsys.readouterr().err
    assert find_checkpoint(out, "latest").name == "checkpoint-phase1-0000006"
    assert not (out / "results.json").exists()
    monkeypatch.undo()

    stat = texts.stat()
    os.utime(texts, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # edited since
    reset_accelerate()
    assert main([*argv, "--resume_from_checkpoint", "latest"]) == 2
    assert f"was trained on other data: {texts} changed since" in capsys.readouterr().err
    os.utime(texts, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    reset_accelerate()
    from distill import loop

    steps = []
    real_step = loop.train_step
    monkeypatch.setattr(loop, "train_step", lambda *args: steps.append(1) or real_step(*args))
    assert main([*argv, "--resume_from_checkpoint", "latest"]) == 0
    assert steps == []  # trained nothing
    got, want = (json.loads((run / "results.json").read_text()) for run in (out, evaluated_run))
    assert got["phases"]["phase1"]["optimizer_steps"] == 6
    assert len(got["evaluations"]["phase1"]) == len(want["evaluations"]["phase1"]) == 3
    for ours, theirs in zip(got["evaluations"]["phase1"], want["evaluations"]["phase1"]):
        assert ours == pytest.approx(theirs, abs=1e-6)
    assert got["student_after"]["ranks@10"] == want["student_after"]["ranks@10"]
    assert got["student_after"]["ndcg@10"] == pytest.approx(want["student_after"]["ndcg@10"], abs=1e-6)
    assert not (out / "checkpoints").exists()


def test_latest_and_the_rotation_go_by_save_order_and_skip_a_torn_checkpoint(accelerator, tmp_path):
    """Resumed from step 100 while 200 and 300 exist: the new save at 150 is `latest`, and the rotation removes the
    abandoned ones (by step, it used to remove each new save). A save a crash tore (a file cut short) is skipped by
    `latest` with a warning, and named when asked for."""
    from distill.checkpoint import save_checkpoint

    for steps in (100, 200, 300):
        save_checkpoint(accelerator, tmp_path, TrainingState(optimizer_steps=steps), limit=3)
    save_checkpoint(accelerator, tmp_path, TrainingState(optimizer_steps=150), limit=2)
    names = [p.name for p in list_checkpoints(tmp_path / "checkpoints")]
    assert names == ["checkpoint-phase1-0000300", "checkpoint-phase1-0000150"]
    newest = find_checkpoint(tmp_path, "latest")
    assert newest.name == "checkpoint-phase1-0000150"

    torn = next(p for p in newest.iterdir() if p.name not in ("state.json", "contents.json"))
    torn.write_bytes(torn.read_bytes()[:10])
    assert find_checkpoint(tmp_path, "latest").name == "checkpoint-phase1-0000300"
    with pytest.raises(DistillError, match=rf"checkpoint-phase1-0000150' is torn \({torn.name}: 10 bytes"):
        find_checkpoint(tmp_path, str(newest))
    save_checkpoint(accelerator, tmp_path, TrainingState(optimizer_steps=160), limit=2)  # the torn one goes
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "checkpoint-phase1-0000160",
        "checkpoint-phase1-0000300",
    ]


def test_a_resume_compares_each_source_it_reads(tmp_path):
    """Sources are compared one by one: a resume that skips a phase reads fewer of them, and is not refused."""
    from distill.checkpoint import Resume

    resume = Resume(TrainingState(identity={"data": {"a.jsonl": "1", "b.jsonl": "2"}}), tmp_path)
    resume.check_data({"b.jsonl": "2"})
    with pytest.raises(DistillError, match="was trained on other data: b.jsonl changed since"):
        resume.check_data({"a.jsonl": "1", "b.jsonl": "3"})
    fresh = Resume(TrainingState())
    fresh.check_data({"a.jsonl": "9"})
    assert fresh.state.identity["data"] == {"a.jsonl": "9"}
