"""The one training loop, for both phases, on 1..N processes (CPU, one GPU, many GPUs, several nodes).

Accelerate owns the mechanics: DDP wrapping, mixed precision, gradient accumulation (`accumulate`), device
placement and batch sharding (`split_batches=True` over global length-grouped batches). The phase
(distill/phases.py) owns its batches and its loss; the loop is forward, backward, step, log, save. The rare
exits (preemption, a non-finite loss) and the heap trims live in one `Guard` it consults once a step.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.logging import get_logger
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from distill.allocator import release_freed_memory
from distill.checkpoint import TrainingState, load_checkpoint, save_checkpoint
from distill.config import Config
from distill.distributed import progress_bar
from distill.errors import TrainingStopped, memory_message
from distill.phases import Phase
from distill.signals import PREEMPTION
from distill.student import DistillationModel

logger = get_logger(__name__)

NO_DECAY = ("bias", "LayerNorm.weight", "layer_norm.weight", "norm.weight")
FUSED_ADAMW_DEVICES = ("cpu", "cuda", "xpu", "mps")  # device types with torch's fused AdamW kernel
TRIM_EVERY = 50  # optimizer steps between heap trims (see release_freed_memory); 0 disables


def make_optimizer(
    model: DistillationModel,
    lr: float,
    weight_decay: float,
    device_type: str = "cpu",
) -> torch.optim.Optimizer:
    """AdamW without weight decay on biases and norms.

    On the devices torch has a fused AdamW kernel for (`device_type`: where training runs; the parameters
    may not be there yet), the whole update is one fused kernel: on a CPU it replaces a loop of a dozen
    tensor ops per parameter, the 3-layer demo student's step takes 48 -> 12 ms, about 12% of a training
    step (docs/QUALITY.md). Hugging Face's Trainer, and so the peer recipe, uses it too.
    """
    groups: dict[bool, list[torch.nn.Parameter]] = {}
    for name, parameter in model.named_parameters():
        if parameter.requires_grad:
            groups.setdefault(name.endswith(NO_DECAY), []).append(parameter)
    return torch.optim.AdamW(
        [
            {"params": params, "weight_decay": 0.0 if no_decay else weight_decay}
            for no_decay, params in sorted(groups.items())
        ],
        lr=lr,
        fused=device_type in FUSED_ADAMW_DEVICES or None,
    )


def make_scheduler(
    optimizer: torch.optim.Optimizer, warmup_steps: int, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up then linear decay to 0 (transformers' "linear" schedule)."""

    def linear(step: int) -> float:
        if step < warmup_steps:
            return float(step) / float(max(1, warmup_steps))
        return max(0.0, float(total_steps - step) / float(max(1, total_steps - warmup_steps)))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, linear)


def batch_verdict(
    accelerator: Accelerator, reported: torch.Tensor, stops: tuple[bool, bool]
) -> tuple[float, tuple[bool, bool]]:
    """(the batch's loss averaged over all ranks, (whether any rank got SIGTERM, whether any got SIGINT)).

    One collective, one host read. Called once backward is queued, so a GPU runs the backward pass while the host
    waits for the loss, and the optimizer step is still to come, so a non-finite loss can stop the run with the
    weights intact. The stop flags travel in the same reduction, so a step costs one blocking collective, not two.
    """
    reported = reported.detach().float().reshape(1)
    flags = torch.cat([reported, *(reported.new_full((1,), float(s)) for s in stops)])  # made on the device: no copy
    total, terminated, interrupted = accelerator.reduce(flags, reduction="sum").tolist()
    return total / accelerator.num_processes, (terminated > 0, interrupted > 0)


@dataclass
class CheckpointSettings:
    output_dir: Path
    every: int  # optimizer steps between checkpoints; 0 disables periodic checkpoints
    limit: int  # checkpoints kept


class Guard:
    """The loop's rare exits and upkeep, consulted once a batch (`verdict`) and once an optimizer step (`after_step`).

    - A non-finite loss stops the run before the optimizer step, with a checkpoint of the weights before it.
    - SIGTERM (preemption) or Ctrl-C on any rank stops every rank at the same step, with a checkpoint.
    - On a CPU the heap is trimmed every TRIM_EVERY steps.
    Both stops raise `TrainingStopped`; the decision travels with the loss in one collective (`batch_verdict`).
    """

    def __init__(self, accelerator: Accelerator, phase: str, checkpoint: Callable[[], Path]):
        self.accelerator, self.phase, self.checkpoint = accelerator, phase, checkpoint
        self.terminated = self.interrupted = False
        PREEMPTION.install()

    def verdict(self, reported: torch.Tensor, state: TrainingState, window: Window) -> float:
        """The batch's loss averaged over all ranks; stops the run if it is not finite."""
        signals = (PREEMPTION.requested, PREEMPTION.interrupted)
        global_loss, (terminated, interrupted) = batch_verdict(self.accelerator, reported, signals)
        self.terminated, self.interrupted = self.terminated or terminated, self.interrupted or interrupted
        if not math.isfinite(global_loss):  # before the optimizer step: the weights are still good
            state.batches_done, state.train_samples = window.start_batches, window.start_samples
            path = self.checkpoint()
            raise TrainingStopped(
                f"non-finite loss ({global_loss}) in {self.phase} at optimizer step {state.optimizer_steps + 1} "
                f"(epoch {state.epoch}); the checkpoint from before it is {path}; lower the learning rate or use "
                "--mixed_precision bf16/no, then --resume_from_checkpoint",
                exit_code=3,
            )
        return global_loss

    def after_step(self, state: TrainingState, evaluation_due: bool) -> None:
        """Stop with a checkpoint if a signal came (the evaluation due is left to the resumed run); trim the heap."""
        if self.terminated or self.interrupted:  # decided collectively: every rank stops at the same step
            name, code = ("SIGTERM", 143) if self.terminated else ("SIGINT", 130)
            PREEMPTION.clear()
            state.evaluation_pending = evaluation_due  # a preemption's grace period is short
            path = self.checkpoint()
            raise TrainingStopped(
                f"stopped by {name} in {self.phase} at optimizer step {state.optimizer_steps}; checkpoint "
                f"saved to {path}; continue with --resume_from_checkpoint latest",
                exit_code=code,
            )
        if TRIM_EVERY and self.accelerator.device.type == "cpu" and state.optimizer_steps % TRIM_EVERY == 0:
            release_freed_memory()


@dataclass
class Window:
    """The micro-batches of the gradient-accumulation window in progress, and where it started."""

    start_batches: int  # batches done at the last optimizer step: where a resume restarts
    start_samples: int  # likewise the samples
    losses: list[float]

    def close(self, state: TrainingState) -> float:
        """The optimizer step was taken: the window's mean loss; the next window starts here."""
        mean_loss = sum(self.losses) / len(self.losses)
        self.losses.clear()
        self.start_batches, self.start_samples = state.batches_done, state.train_samples
        return mean_loss


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


def epoch_batches(accelerator: Accelerator, prepared: Prepared, sampler: object, state: TrainingState) -> DataLoader:
    """The epoch's batches, after those a resumed run has done already."""
    batches = prepared.loader
    if state.batches_done:
        batches = accelerator.skip_first_batches(prepared.loader, state.batches_done)
    # Accelerate's loaders push their own epoch counter into the sampler when iterated; a loader made
    # by skip_first_batches starts that counter at 0, so set it explicitly to keep the data order.
    batches.set_epoch(state.epoch)
    sampler.set_epoch(state.epoch)  # type: ignore[attr-defined]
    return batches


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

    resume_phase(accelerator, phase, run, state, resume)
    clock = Clock(state.train_seconds)  # a resumed phase goes on counting from its checkpoint
    guard, window = Guard(accelerator, phase.name, checkpoint), Window(state.batches_done, state.train_samples, [])
    run.wrapped.train()
    progress = progress_bar(accelerator, run.total_steps, phase.name, done=state.optimizer_steps)
    if state.evaluation_pending:  # stopped at an evaluation step before evaluating: that evaluation comes first
        state.evaluation_pending = False
        evaluate_now()
    try:  # the bar ends its line before any error is printed, not glued to it
        for epoch in range(state.epoch, phase.settings.epochs):
            state.epoch = epoch
            for batch in epoch_batches(accelerator, run, sampler, state):
                train_step(accelerator, phase, run, batch, state, guard, window)
                state.batches_done += 1
                state.train_samples += sampler.batch_size
                if not accelerator.sync_gradients:
                    continue
                step_taken(accelerator, phase, run, state, window.close(state), clock.seconds(), progress)
                due = evaluate is not None and eval_steps > 0 and state.optimizer_steps % eval_steps == 0
                guard.after_step(state, due)  # may stop the run
                if due:
                    evaluate_now()  # on every rank
                if checkpoints.every and state.optimizer_steps % checkpoints.every == 0:
                    clock.pause(checkpoint)
            state.batches_done = window.start_batches = 0
    finally:
        progress.close()
    state.epoch, state.train_seconds = phase.settings.epochs, clock.seconds()
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
        window.losses.append(guard.verdict(reported, state, window))  # may stop the run
        if accelerator.sync_gradients and phase.settings.max_grad_norm > 0:
            accelerator.clip_grad_norm_(run.wrapped.parameters(), phase.settings.max_grad_norm)
        run.optimizer.step()
        run.scheduler.step()
        run.optimizer.zero_grad(set_to_none=True)


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
) -> None:
    """Start the phase afresh, or restore it from the checkpoint `resume`."""
    if resume is None:
        state.start_phase(phase.settings.name)
        return
    extra = load_checkpoint(accelerator, resume)
    phase.load_state_dict(extra, accelerator.device)
    accelerator.step = state.accelerator_step  # keeps gradient-accumulation windows where they were


def step_taken(
    accelerator: Accelerator,
    phase: Phase,
    run: Prepared,
    state: TrainingState,
    mean_loss: float,
    seconds: float,
    progress: tqdm,
) -> None:
    """Bookkeeping of an optimizer step: the phase's memory, the state, the bar, the trackers."""
    phase.step_taken()
    state.optimizer_steps += 1
    state.accelerator_step = accelerator.step
    state.losses.append(mean_loss)
    state.train_seconds = seconds
    lr = run.scheduler.get_last_lr()[0]
    progress.update(1)
    progress.set_postfix(loss=f"{mean_loss:.4f}", lr=f"{lr:.2e}", refresh=False)
    name = phase.settings.name
    # counted on over the phases: the trackers' x axis goes on
    accelerator.log({f"{name}/loss": mean_loss, f"{name}/lr": lr}, step=state.global_step())


def training_memory_message(
    config: Config, phase: str, state: TrainingState, precision: str, error: BaseException
) -> str:
    """What to change when a training step does not fit on the device (every epoch starts with its widest batch)."""
    t = config.training
    fixes = [
        f"lower --batch_size (now {t.batch_size} per process) and raise --gradient_accumulation_steps "
        f"(now {t.gradient_accumulation_steps}) to keep the samples per optimizer step"
    ]
    if not config.performance.gradient_checkpointing:
        fixes.append("pass --gradient_checkpointing True")
    if precision == "no":
        fixes.append("use --mixed_precision bf16")
    return (
        f"{phase}: the student ran out of device memory at optimizer step {state.optimizer_steps + 1} "
        f"({memory_message(error)}); {', or '.join(fixes)}"
    )
