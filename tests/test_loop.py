from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.overrides import TorchFunctionMode

from tests.conftest import reset_accelerate, tiny_run_flags

DISTILL = str(Path(__file__).resolve().parent.parent / "distill")
# Tensor methods that make the host wait for the tensor's value: on a GPU, a synchronisation with its queue.
HOST_READS = {"item", "tolist", "numpy", "cpu", "__bool__", "__float__", "__int__", "__index__"}


class HostReads(TorchFunctionMode):
    """Counts the host reads of tensors made by the toolkit's own code (frames under distill/)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in HOST_READS:
            frame = sys._getframe(1)
            while frame is not None and "/torch/" in frame.f_code.co_filename:
                frame = frame.f_back
            if frame is not None and frame.f_code.co_filename.startswith(DISTILL):
                self.count += 1
        return func(*args, **(kwargs or {}))


def reads_and_steps(monkeypatch, tiny_models, tiny_data, out: Path, read_every: int, **flags) -> tuple[int, list[int]]:
    """(host reads by distill's code inside the training loop, optimizer steps of each phase) of a tiny run."""
    import distill.loop
    import distill.pipeline
    from distill.train import main

    monkeypatch.setattr(distill.loop, "READ_EVERY", read_every)
    counter, steps = HostReads(), []
    train_phase = distill.loop.train_phase

    def counted(accelerator, model, phase, loader, state, *args, **kwargs):
        with counter:
            trained = train_phase(accelerator, model, phase, loader, state, *args, **kwargs)
        steps.append(state.optimizer_steps)
        return trained

    monkeypatch.setattr(distill.pipeline, "train_phase", counted)
    reset_accelerate()
    argv = tiny_run_flags(tiny_models, tiny_data, out, eval_data="none", save_to_artifacts=False, **flags)
    assert main(argv) == 0
    return counter.count, steps


def test_the_training_loop_reads_the_host_once_per_logging_interval(monkeypatch, tiny_models, tiny_data, tmp_path):
    """Both phases, 2 epochs each: the losses reach the host once every READ_EVERY steps (and at each epoch's end),
    not once a batch; the same run reading every step counts one read a step, so the count is not blind."""
    flags = dict(phase1_epochs=2, phase2_epochs=2, teacher_cache_dir=tmp_path / "cache")
    every_step, steps = reads_and_steps(monkeypatch, tiny_models, tiny_data, tmp_path / "a", 1, **flags)
    assert every_step == sum(steps) and sum(steps) >= 40
    read_every = 4
    interval, same_steps = reads_and_steps(monkeypatch, tiny_models, tiny_data, tmp_path / "b", read_every, **flags)
    assert same_steps == steps
    per_epoch = [s // 2 for s in steps]
    assert interval == sum(2 * -(-n // read_every) for n in per_epoch)


def test_a_deferred_read_skips_the_steps_after_a_non_finite_loss_on_the_device():
    """The fused AdamW step after a poisoned loss leaves weights, moments and step counts as they were."""
    from distill.loop import skips_on_device

    weight = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.AdamW([weight], lr=0.1, fused=True)
    assert skips_on_device(optimizer) and not skips_on_device(torch.optim.AdamW([weight], lr=0.1))
    weight.grad = torch.ones(3)
    optimizer.step()
    before = (
        weight.detach().clone(),
        optimizer.state[weight]["exp_avg"].clone(),
        optimizer.state[weight]["step"].clone(),
    )
    optimizer.found_inf = torch.ones(())
    weight.grad = torch.full((3,), float("nan"))
    optimizer.step()
    after = weight.detach(), optimizer.state[weight]["exp_avg"], optimizer.state[weight]["step"]
    for b, a in zip(before, after):
        assert torch.equal(b, a)


def poisoned_run(monkeypatch, tiny_models, tiny_data, tmp_path, read_every, poison, **flags) -> tuple[int, Path, Path]:
    """A clean phase-1 run checkpointed every 4 steps, then the same run whose loss at the 5th batch is
    `poison(loss, reported)`, reading the losses every `read_every` steps. Returns the poisoned run's exit code, its
    latest checkpoint and the clean run's step-4 checkpoint."""
    import distill.loop
    from distill.checkpoint import find_checkpoint
    from distill.phases import AlignmentPhase
    from distill.train import main

    flags = dict(skip_phase2=True, eval_data="none", teacher_cache_dir=tmp_path / "cache", **flags)
    reference = tmp_path / "reference"
    clean = tiny_run_flags(tiny_models, tiny_data, reference, checkpoint_steps=4, checkpoints_total_limit=10, **flags)
    assert main(clean) == 0
    reset_accelerate()
    monkeypatch.setattr(distill.loop, "READ_EVERY", read_every)
    calls, phase_loss = [0], AlignmentPhase.loss

    def poisoned(*args, **kwargs):
        calls[0] += 1
        loss, reported = phase_loss(*args, **kwargs)
        return poison(loss, reported) if calls[0] == 5 else (loss, reported)

    monkeypatch.setattr(AlignmentPhase, "loss", poisoned)
    out = tmp_path / "poisoned"
    code = main(tiny_run_flags(tiny_models, tiny_data, out, **flags))
    assert calls[0] == (5 if read_every == 1 else 16)  # read late, the loop ran on to its next read
    return code, find_checkpoint(out, "latest"), reference / "checkpoints" / "checkpoint-phase1-0000004"


def same_tensors(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("read_every", [1, 16])
def test_a_non_finite_loss_read_late_rolls_back_to_its_step(monkeypatch, tiny_models, tiny_data, tmp_path, read_every):
    """The 5th step's loss is not finite: read at once or 11 steps later, the checkpoint holds the weights, the
    counters and the schedule of an unpoisoned run's 4th step, and the run stops with exit code 3."""
    from safetensors.torch import load_file

    from distill.checkpoint import read_state

    def nan(loss, reported):
        return loss * float("nan"), reported * float("nan")

    code, checkpoint, at_4 = poisoned_run(monkeypatch, tiny_models, tiny_data, tmp_path, read_every, nan)
    assert code == 3
    state = read_state(checkpoint, {})
    assert (state.optimizer_steps, state.batches_done, state.train_samples) == (4, 4, 32)
    assert state.losses == pytest.approx(read_state(at_4, {}).losses, abs=0)
    got, want = (torch.load(c / "scheduler.bin", weights_only=False) for c in (checkpoint, at_4))
    assert got["last_epoch"] == want["last_epoch"] == 4 and got["_last_lr"] == want["_last_lr"]
    assert same_tensors(*(load_file(str(c / "model.safetensors")) for c in (checkpoint, at_4)))


class InfiniteGradient(torch.autograd.Function):
    """The identity forward, an infinite gradient backward: a finite loss whose gradients are not."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * float("inf")


@pytest.mark.parametrize(("read_every", "max_grad_norm"), [(1, 1.0), (16, 0.0)])
def test_infinite_gradients_under_a_finite_loss_roll_back_to_their_step(
    monkeypatch, tiny_models, tiny_data, tmp_path, read_every, max_grad_norm
):
    """The 5th step's loss is finite and its gradients are not (clipped or unclipped): the run stops with exit code 3
    and its checkpoint is bit-equal to a clean run's 4th step, weights and optimizer moments alike."""
    from safetensors.torch import load_file

    from distill.checkpoint import read_state

    reported_losses: list[float] = []

    def infinite_gradient(loss, reported):
        reported_losses.append(float(reported))
        return InfiniteGradient.apply(loss), reported

    code, checkpoint, at_4 = poisoned_run(
        monkeypatch, tiny_models, tiny_data, tmp_path, read_every, infinite_gradient, max_grad_norm=max_grad_norm
    )
    assert code == 3
    assert reported_losses and all(np.isfinite(reported_losses))  # the poisoned step's loss was finite
    assert read_state(checkpoint, {}).optimizer_steps == 4
    assert same_tensors(*(load_file(str(c / "model.safetensors")) for c in (checkpoint, at_4)))
    got, want = (torch.load(c / "optimizer.bin", weights_only=False)["state"] for c in (checkpoint, at_4))
    assert got.keys() == want.keys()
    for key in got:
        assert all(torch.equal(got[key][m], want[key][m]) for m in ("exp_avg", "exp_avg_sq", "step"))


def test_each_steps_learning_rate_follows_the_linear_warmup_and_decay(tiny_models, tiny_data, tmp_path):
    """--warmup_ratio 0.25 over 2 epochs: the lr logged at every optimizer step is what transformers'
    get_linear_schedule_with_warmup gives for the same steps (an independent reference), rising to --phase1_lr and
    falling to 0."""
    import json

    from transformers import get_linear_schedule_with_warmup

    from distill.train import main

    out = tmp_path / "run"
    flags = dict(skip_phase2=True, eval_data="none", warmup_ratio=0.25, phase1_epochs=2, phase1_lr=2e-3)
    assert main(tiny_run_flags(tiny_models, tiny_data, out, log_with="jsonl", **flags)) == 0
    logged = [json.loads(line).get("values", {}) for line in (out / "metrics.jsonl").read_text().splitlines()]
    lrs = [values["phase1/lr"] for values in logged if "phase1/lr" in values]
    total = 2 * 256 // 8
    assert len(lrs) == total
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=2e-3)
    schedule = get_linear_schedule_with_warmup(optimizer, int(0.25 * total), total)
    expected = []
    for _ in range(total):  # each logged lr is the one set after its step: the next step's
        optimizer.step()
        schedule.step()
        expected.append(schedule.get_last_lr()[0])
    assert lrs == pytest.approx(expected, rel=1e-9, abs=1e-15)
    assert max(lrs) == pytest.approx(2e-3) and lrs[-1] == 0.0


@pytest.mark.parametrize(("scaling", "factor"), [("none", 1.0), ("linear", 9.0), ("sqrt", 3.0)])
def test_lr_scaling_multiplies_each_phases_learning_rate_by_the_process_count(scaling, factor):
    """--lr_scaling with 9 processes: each phase's learning rate, the one its optimizer and schedule start from (the
    schedule test above reads it back from a run's optimizer)."""
    from distill.config import load_config
    from distill.phases import make_phases
    from distill.pipeline import training_phases

    config = load_config(["--teacher_model", "t", "--student_model", "s", "--lr_scaling", scaling]
                         + ["--phase1_lr", "1e-4", "--phase2_lr", "3e-5"])  # fmt: skip
    phases = make_phases(training_phases(config, 9), world=9)
    assert [p.settings.lr for p in phases] == pytest.approx([1e-4 * factor, 3e-5 * factor])
