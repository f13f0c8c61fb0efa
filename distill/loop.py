"""The one training loop, for both phases, on 1..N processes (CPU, one GPU, many GPUs, several nodes).

Accelerate owns the mechanics: DDP wrapping, mixed precision, gradient accumulation (`accumulate`), device
placement and batch sharding (`split_batches=True` over global length-grouped batches). The phase
(distill/phases.py) owns its batches and its loss; the loop is forward, backward, step, log, save. The rare
exits (preemption, a non-finite loss), the host's reads of the losses and the heap trims live in one `Guard` it
consults once a step. Nothing in a step waits for the device: the losses stay there until the guard reads them,
every READ_EVERY steps, so the host queues the next steps while a GPU runs this one.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.logging import get_logger
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from distill.allocator import release_freed_memory
from distill.checkpoint import (
    CheckpointSettings,
    TrainingState,
    end_checkpoint,
    load_checkpoint,
    save_checkpoint,
    set_rng,
)
from distill.config.schema import PerformanceConfig, TrainingConfig
from distill.distributed import progress_bar
from distill.errors import TrainingStopped, memory_message
from distill.optimizer import make_optimizer, make_scheduler
from distill.phases import Phase
from distill.signals import PREEMPTION, agreed_stop
from distill.students.head import DistillationModel

logger = get_logger(__name__)

TRIM_EVERY = 50  # optimizer steps between heap trims (see release_freed_memory); 0 disables


READ_EVERY = 16  # optimizer steps between the host's reads of the losses (and before checkpoints, evaluations, ends)


def skips_on_device(optimizer: torch.optim.Optimizer) -> bool:
    """Whether the optimizer can skip a step on the device when told a loss was not finite (`found_inf`).

    torch's fused AdamW takes a `found_inf` tensor and leaves weights, moments and step counts untouched where
    it is non-zero: the loop then never has to read a loss before stepping. fp16's gradient scaler sets that
    tensor itself, and other optimizers have none: there the loss is read before every step.
    """
    inner = getattr(optimizer, "optimizer", optimizer)
    fused = any(group.get("fused") for group in inner.param_groups)
    return fused and getattr(optimizer, "scaler", None) is None


@dataclass
class StepRecord:
    """An optimizer step whose loss the host has not read yet, and where the run stood before it."""

    loss: torch.Tensor  # 0-d, the step's mean loss over its micro-batches and processes, on the device
    gradient_norm: torch.Tensor  # 0-d, the step's total gradient norm on the device (0 where not read: fp16)
    lr: float
    global_step: int  # the trackers' x axis
    before: Snapshot


@dataclass
class Snapshot:
    """Where the run stood at the start of an accumulation window: what a rollback to it restores."""

    batches_done: int
    train_samples: int
    optimizer_steps: int
    accelerator_step: int
    scheduler: dict
    phase: dict[str, torch.Tensor]


class Window:
    """The micro-batches of the accumulation window in progress, their losses on the device, and where it started."""

    def __init__(self, accelerator: Accelerator, run: Prepared, phase: Phase, state: TrainingState):
        self.accelerator, self.run, self.phase = accelerator, run, phase
        self.losses: list[torch.Tensor] = []
        self.gradient_norm = torch.zeros((), device=accelerator.device)
        self.start = self.snapshot(state)

    def snapshot(self, state: TrainingState) -> Snapshot:
        return Snapshot(
            state.batches_done,
            state.train_samples,
            state.optimizer_steps,
            self.accelerator.step,
            self.run.scheduler.state_dict(),
            self.phase.state_dict(),  # references to tensors that are replaced, never changed in place
        )

    def close(self, state: TrainingState) -> StepRecord:
        """The optimizer step was taken: its record; the next window starts here."""
        record = StepRecord(
            torch.stack(self.losses).mean(),
            self.gradient_norm,
            self.run.scheduler.get_last_lr()[0],
            state.global_step(),
            self.start,
        )
        self.losses.clear()
        self.gradient_norm = torch.zeros((), device=self.accelerator.device)
        self.start = self.snapshot(state)
        return record

    def restore(self, state: TrainingState, snapshot: Snapshot) -> None:
        """Put the counters, the schedule and the phase's state back to `snapshot` (the weights already are)."""
        state.batches_done, state.train_samples = snapshot.batches_done, snapshot.train_samples
        state.optimizer_steps = snapshot.optimizer_steps
        self.accelerator.step = state.accelerator_step = snapshot.accelerator_step
        self.run.scheduler.load_state_dict(snapshot.scheduler)
        for group, lr in zip(self.run.optimizer.param_groups, snapshot.scheduler["_last_lr"]):
            group["lr"] = lr
        self.phase.load_state_dict(snapshot.phase, self.accelerator.device)


class Guard:
    """The loop's rare exits, its reads of the losses and its upkeep.

    The host reads the losses every READ_EVERY optimizer steps (`read`), not every batch: a GPU's queue is
    never drained mid-run, and the host runs ahead of it. So that nothing is lost by reading late:
    - A non-finite loss, or non-finite gradients under a finite loss (their total norm, which clipping computes
      anyway), marks the run as poisoned on the device; every optimizer step from then on is skipped there
      (`found_inf`), so the weights stay those from before it. At the next read the run rolls back to the start
      of that step's window and stops with a checkpoint (exit code 3). Optimizers that cannot skip on the device
      (`skips_on_device`) have the loss and the norm read before every step instead. Under fp16 the gradient
      scaler skips steps with non-finite gradients itself, as its loss scale calibrates: those are not stops.
    - SIGTERM (preemption) or Ctrl-C on any process stops every process at the same step, with a checkpoint,
      agreed every step by a collective on the CPU (`signals.agreed_stop`).
    - On a CPU the heap is trimmed every TRIM_EVERY steps.
    Both stops raise `TrainingStopped`.
    """

    def __init__(self, accelerator: Accelerator, phase: Phase, run: Prepared, checkpoint: Callable[[], Path]):
        self.accelerator, self.phase, self.run, self.checkpoint = accelerator, phase, run, checkpoint
        self.deferred = skips_on_device(run.optimizer)
        self.poisoned = torch.zeros((), device=accelerator.device)  # 1 once any loss was not finite
        self.pending: list[StepRecord] = []
        PREEMPTION.install()

    def observe(self, reported: torch.Tensor, state: TrainingState, window: Window) -> None:
        """After backward: the batch's loss over all processes, kept on the device; the step is skipped if it is
        not finite."""
        loss = self.accelerator.reduce(reported.detach().float().reshape(()), reduction="sum")
        window.losses.append(loss / self.accelerator.num_processes)
        self.poisoned = torch.maximum(self.poisoned, (~torch.isfinite(loss)).float())
        if self.deferred:
            inner = getattr(self.run.optimizer, "optimizer", self.run.optimizer)
            inner.found_inf = self.poisoned  # read by the fused kernel on the device: no host synchronisation
        elif not math.isfinite(value := window.losses[-1].item()):  # before the step: the weights are still good
            self.stop_non_finite(value, state, window, window.start)

    def observe_gradients(self, norm: torch.Tensor | None, state: TrainingState, window: Window) -> None:
        """At an optimizer step, after the gradients are synchronised (and clipped): their total norm, kept on the
        device; the step is skipped if it is not finite."""
        if norm is None or getattr(self.run.optimizer, "scaler", None) is not None:  # fp16: the scaler's to skip
            return
        window.gradient_norm = norm.detach().float().reshape(())
        self.poisoned = torch.maximum(self.poisoned, (~torch.isfinite(window.gradient_norm)).float())
        if self.deferred:
            inner = getattr(self.run.optimizer, "optimizer", self.run.optimizer)
            inner.found_inf = self.poisoned
        elif not math.isfinite(value := window.gradient_norm.item()):  # before the step: the weights are still good
            self.stop_non_finite(value, state, window, window.start, "gradient norm")

    def read(self, state: TrainingState, window: Window, progress: tqdm) -> None:
        """The host reads the pending steps' losses (one transfer): they go to the state, the bar and the trackers."""
        if not self.pending:
            return
        values, norms = torch.stack([torch.stack([r.loss, r.gradient_norm]) for r in self.pending]).T.tolist()
        pending, self.pending = self.pending, []
        name = self.phase.settings.name
        for record, value, norm in zip(pending, values, norms):
            if not math.isfinite(value):
                self.stop_non_finite(value, state, window, record.before)
            if not math.isfinite(norm):
                self.stop_non_finite(norm, state, window, record.before, "gradient norm")
            state.losses.append(value)
            # counted on over the phases: the trackers' x axis goes on
            self.accelerator.log({f"{name}/loss": value, f"{name}/lr": record.lr}, step=record.global_step)
        progress.set_postfix(loss=f"{values[-1]:.4f}", lr=f"{pending[-1].lr:.2e}", refresh=False)

    def stop_non_finite(
        self, value: float, state: TrainingState, window: Window, before: Snapshot, what: str = "loss"
    ) -> None:
        window.restore(state, before)
        path = self.checkpoint()
        raise TrainingStopped(
            f"non-finite {what} ({value}) in {self.phase.name} at optimizer step {state.optimizer_steps + 1} "
            f"(epoch {state.epoch}); the checkpoint from before it is {path}; lower the learning rate or use "
            "--mixed_precision bf16/no, then --resume_from_checkpoint",
            exit_code=3,
        )

    def after_step(self, state: TrainingState, window: Window, progress: tqdm, evaluation_due: bool) -> None:
        """Read the losses when due; stop with a checkpoint if a signal came (the evaluation due is left to the
        resumed run); trim the heap."""
        stop = agreed_stop(self.accelerator)
        if stop or len(self.pending) >= READ_EVERY or not self.deferred:
            self.read(state, window, progress)
        if stop:  # decided collectively: every process stops at the same step
            name, code = stop
            PREEMPTION.clear()
            state.evaluation_pending = evaluation_due  # a preemption's grace period is short
            path = self.checkpoint()
            raise TrainingStopped(
                f"stopped by {name} in {self.phase.name} at optimizer step {state.optimizer_steps}; checkpoint "
                f"saved to {path}; continue with --resume_from_checkpoint latest",
                exit_code=code,
            )
        if TRIM_EVERY and self.accelerator.device.type == "cpu" and state.optimizer_steps % TRIM_EVERY == 0:
            release_freed_memory()


class Clock:
    """Training seconds: wall time less what evaluations and checkpoints took, continued across a resume."""

    def __init__(self, seconds_so_far: float):
        self.started = time.perf_counter() - seconds_so_far

    def seconds(self) -> float:
        return time.perf_counter() - self.started

    def pause(self, action: Callable[[], object]) -> None:
        """Run `action` outside training time."""
        before = time.perf_counter()
        action()
        self.started += time.perf_counter() - before


def plain_model(accelerator: Accelerator, wrapped: torch.nn.Module) -> DistillationModel:
    """The model `prepare` was given, free of DDP and of torch.compile, sharing the trained parameters.

    Not compiled, so evaluation runs eagerly, checkpoints and exports carry no `_orig_mod.` in their keys,
    and the next phase's `prepare` compiles it afresh. Regional compilation leaves the given model untouched
    and compiles a copy of its module tree; Accelerate's `unwrap_model` keeps that copy by default (under
    DDP it even returns the DDP wrapper of the copy), so `keep_torch_compile=False` is what gives it back.
    """
    return accelerator.unwrap_model(wrapped, keep_torch_compile=False)


@dataclass
class Prepared:
    """What `accelerator.prepare` made of a phase's model, optimizer, loader and schedule."""

    wrapped: torch.nn.Module  # DDP and/or compiled: the one to call for training
    plain: DistillationModel  # shares its parameters: for evaluation, checkpoints and export
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    loader: DataLoader
    total_steps: int
    batches: int  # micro-batches per epoch
    short_window: int  # micro-batches of an epoch's last, shorter accumulation window (0: none)


def prepare_phase(accelerator: Accelerator, model: DistillationModel, phase: Phase, loader: DataLoader) -> Prepared:
    """Optimizer and schedule for the phase, everything passed through `accelerator.prepare`."""
    settings = phase.settings
    phase.to_device(accelerator.device)
    optimizer = make_optimizer(model, settings.lr, settings.weight_decay, accelerator.device.type)
    accumulation = accelerator.gradient_accumulation_steps
    total_steps = max(1, math.ceil(len(loader) / accumulation) * settings.epochs)
    scheduler = make_scheduler(optimizer, int(settings.warmup_ratio * total_steps), total_steps)
    wrapped, optimizer, prepared_loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    plain = plain_model(accelerator, wrapped)  # placed on the device by `prepare`; shares its parameters
    return Prepared(
        wrapped,
        plain,
        optimizer,
        scheduler,
        prepared_loader,
        total_steps,
        len(loader),
        len(loader) % accumulation,
    )


def loss_scale(accelerator: Accelerator, prepared: Prepared, batches_done: int) -> float | None:
    """The factor for a micro-batch of an epoch's last, shorter accumulation window; None for the others.

    Accelerate steps at the end of the loader but divides every micro-batch loss by the full window length:
    the short window's losses are scaled back up to their own mean.
    """
    if prepared.short_window and batches_done >= prepared.batches - prepared.short_window:
        return accelerator.gradient_accumulation_steps / prepared.short_window
    return None


def epoch_batches(
    accelerator: Accelerator, prepared: Prepared, sampler: object, state: TrainingState, rng: dict[str, torch.Tensor]
) -> Iterable[dict]:
    """The epoch's batches, after those a resumed run has done already; `rng`: the generator states of the
    checkpoint this epoch resumes from mid-way (see `continued`)."""
    batches = prepared.loader
    if state.batches_done:
        batches = accelerator.skip_first_batches(prepared.loader, state.batches_done)
    # Accelerate's loaders push their own epoch counter into the sampler when iterated; a loader made
    # by skip_first_batches starts that counter at 0, so set it explicitly to keep the data order.
    batches.set_epoch(state.epoch)
    sampler.set_epoch(state.epoch)  # type: ignore[attr-defined]
    return continued(batches, rng) if state.batches_done and rng else batches


def continued(batches: DataLoader, rng: dict[str, torch.Tensor]) -> Iterator[dict]:
    """A resumed epoch's batches, torch's generators set to the checkpoint's states once the first is fetched.

    Iterating a DataLoader draws a number from torch's global generator (its workers' base seed) as it fetches
    the first batch. The run that was never stopped drew it at the epoch's start, before the steps the
    checkpoint comes after; the resumed run draws it again, after the checkpoint's states were set. Setting
    them once more after that draw gives the next step the dropout the run never stopped had.
    """
    iterator = iter(batches)
    first = next(iterator, None)
    set_rng(rng)
    if first is not None:
        yield first
        yield from iterator


def train_phase(
    accelerator: Accelerator,
    model: DistillationModel,
    phase: Phase,
    loader: DataLoader,
    state: TrainingState,
    checkpoints: CheckpointSettings,
    resume: Path | None = None,
    evaluate: Callable[[DistillationModel, int], None] | None = None,
    eval_steps: int = 0,
) -> DistillationModel:
    """Train `model` for one phase, continuing `state` from the checkpoint `resume` if given.

    Updates `state` (losses, steps, samples, seconds) in place and returns the unwrapped model. With
    `eval_steps`, `evaluate(model, step)` runs on every process every that many optimizer steps.
    """
    run, sampler = prepare_phase(accelerator, model, phase, loader), loader.batch_sampler
    checkpoint = partial(save_phase_checkpoint, accelerator, phase, run, state, checkpoints)

    def evaluate_now() -> None:
        if evaluate is not None:
            clock.pause(lambda: evaluate(run.plain, state.optimizer_steps))

    rng, steps_before = resume_phase(accelerator, phase, run, state, resume), state.optimizer_steps
    clock = Clock(state.train_seconds)  # a resumed phase goes on counting from its checkpoint
    guard, window = Guard(accelerator, phase, run, checkpoint), Window(accelerator, run, phase, state)
    run.wrapped.train()
    progress = progress_bar(accelerator, run.total_steps, phase.name, done=state.optimizer_steps)
    if state.evaluation_pending:  # stopped at an evaluation step before evaluating: that evaluation comes first
        state.evaluation_pending = False
        evaluate_now()
    try:  # the bar ends its line before any error is printed, not glued to it
        for epoch in range(state.epoch, phase.settings.epochs):
            state.epoch = epoch
            batches, rng = epoch_batches(accelerator, run, sampler, state, rng), {}
            for batch in batches:
                train_step(accelerator, phase, run, batch, state, guard, window)
                state.batches_done += 1
                state.train_samples += phase.rows(batch) * accelerator.num_processes  # equal shares
                if not accelerator.sync_gradients:
                    continue
                step_taken(accelerator, phase, state, guard, window, clock.seconds(), progress)
                due = evaluate is not None and eval_steps > 0 and state.optimizer_steps % eval_steps == 0
                saves = checkpoints.every and state.optimizer_steps % checkpoints.every == 0
                if due or saves:  # evaluations and checkpoints see every loss so far
                    guard.read(state, window, progress)
                guard.after_step(state, window, progress, due)  # may stop the run
                if due:
                    evaluate_now()  # on every process
                if saves:
                    clock.pause(checkpoint)
            guard.read(state, window, progress)  # a stop at the epoch's end rolls back within the epoch
            state.batches_done = 0
            window.start = window.snapshot(state)
    finally:
        progress.close()
    state.epoch, state.train_seconds = phase.settings.epochs, clock.seconds()
    checkpoints.saved_at_end = end_checkpoint(state, checkpoints, resume, steps_before, checkpoint)
    accelerator.free_memory()  # forget this phase's optimizer, scheduler and loader; the next phase re-prepares
    return run.plain


def train_step(
    accelerator: Accelerator,
    phase: Phase,
    run: Prepared,
    batch: dict,
    state: TrainingState,
    guard: Guard,
    window: Window,
) -> None:
    """One micro-batch: forward, backward, and (at the end of an accumulation window) clip and step."""
    with accelerator.accumulate(run.wrapped):
        loss, reported = phase.loss(accelerator, run.wrapped, batch)
        scale = loss_scale(accelerator, run, state.batches_done)
        accelerator.backward(loss if scale is None else loss * scale)
        guard.observe(reported, state, window)  # may stop the run, or mark this step to be skipped
        if accelerator.sync_gradients:
            norm = gradient_norm(accelerator, run.wrapped, phase.settings.max_grad_norm)
            guard.observe_gradients(norm, state, window)  # likewise, for gradients that are not finite
        run.optimizer.step()
        run.scheduler.step()
        run.optimizer.zero_grad(set_to_none=True)


def gradient_norm(accelerator: Accelerator, wrapped: torch.nn.Module, max_norm: float) -> torch.Tensor | None:
    """The synchronised gradients' total norm, on the device; clipped to `max_norm` where it is above 0."""
    if max_norm > 0:
        return accelerator.clip_grad_norm_(wrapped.parameters(), max_norm)
    grads = [p.grad for p in wrapped.parameters() if p.grad is not None]
    if not grads:
        return None
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads]))


def save_phase_checkpoint(
    accelerator: Accelerator, phase: Phase, run: Prepared, state: TrainingState, checkpoints: CheckpointSettings
) -> Path:
    """A checkpoint of the phase: the prepared objects, the state and the phase's own tensors."""
    return save_checkpoint(accelerator, checkpoints.output_dir, state, checkpoints.limit, phase.state_dict())


def resume_phase(
    accelerator: Accelerator,
    phase: Phase,
    run: Prepared,
    state: TrainingState,
    resume: Path | None,
) -> dict[str, torch.Tensor]:
    """Start the phase afresh, or restore it from the checkpoint `resume`; the checkpoint's generator states."""
    if resume is None:
        state.start_phase(phase.settings.name)
        return {}
    extra, rng = load_checkpoint(accelerator, resume)
    phase.load_state_dict(extra, accelerator.device)
    accelerator.step = state.accelerator_step  # keeps gradient-accumulation windows where they were
    return rng


def step_taken(
    accelerator: Accelerator,
    phase: Phase,
    state: TrainingState,
    guard: Guard,
    window: Window,
    seconds: float,
    progress: tqdm,
) -> None:
    """Bookkeeping of an optimizer step: the phase's memory, the state, the bar; its loss waits for `Guard.read`."""
    phase.step_taken()
    state.optimizer_steps += 1
    state.accelerator_step = accelerator.step
    state.train_seconds = seconds
    guard.pending.append(window.close(state))
    progress.update(1)


def training_memory_message(
    t: TrainingConfig,
    performance: PerformanceConfig,
    phase: str,
    state: TrainingState,
    precision: str,
    error: BaseException,
) -> str:
    """What to change when a training step does not fit on the device (every epoch starts with its widest batch)."""
    fixes = [
        f"lower --batch_size (now {t.batch_size} per process) and raise --gradient_accumulation_steps "
        f"(now {t.gradient_accumulation_steps}) to keep the samples per optimizer step"
    ]
    if not performance.gradient_checkpointing:
        fixes.append("pass --gradient_checkpointing True")
    if precision == "no":
        fixes.append("use --mixed_precision bf16")
    return (
        f"{phase}: the student ran out of device memory at optimizer step {state.optimizer_steps + 1} "
        f"({memory_message(error)}); {', or '.join(fixes)}"
    )
