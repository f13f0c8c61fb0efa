"""The one training loop, for both phases, on 1..N processes (CPU, one GPU, many GPUs, several nodes).

Accelerate owns the mechanics: DDP wrapping, mixed precision, gradient accumulation (`accumulate`),
device placement and batch sharding (`split_batches=True` over global length-grouped batches). Phase 2's
in-batch similarity loss sees the GLOBAL batch: embeddings are gathered from every process (keeping the
gradient of the local ones) and the loss is scaled by the world size, so N processes x batch B follow
the same trajectory as 1 process x batch N*B.
"""

from __future__ import annotations

import ctypes
import gc
import math
import os
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.logging import get_logger
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from distill.batching import assemble_chunks
from distill.checkpoint import TrainingState, load_checkpoint, save_checkpoint
from distill.errors import DistillError
from distill.losses import LossWeights, alignment_loss, relative_similarity_loss, similarity_kl_loss
from distill.student import DistillationModel

logger = get_logger(__name__)

NO_DECAY = ("bias", "LayerNorm.weight", "layer_norm.weight", "norm.weight")
FUSED_ADAMW_DEVICES = ("cpu", "cuda", "xpu", "mps")  # device types with torch's fused AdamW kernel
TRIM_EVERY = 50  # optimizer steps between heap trims (see release_freed_memory); 0 disables


@dataclass
class PhaseSettings:
    name: str  # "phase1" or "phase2"
    epochs: int
    lr: float
    warmup_ratio: float
    weight_decay: float
    max_grad_norm: float
    weights: LossWeights
    matryoshka_dims: list[int] | None  # None in projection mode
    projection_lr_scale: float = 1.0
    backbone_frozen_steps: int = 0  # optimizer steps at the start in which only the projection learns
    teacher_basis: torch.Tensor | None = None  # MRL: (teacher_dim, student_dim), applied before truncation
    kl_memory_steps: int = 0  # phase 2: earlier optimizer steps whose passages join the similarity KL
    ema_decay: float = 0.0  # > 0: the phase ends with an exponential moving average of its weights


class PassageMemory:
    """Phase 2's cross-batch memory: the passages of the last N optimizer steps as extra candidates in the KL.

    Each query's softmax then ranks its batch's passages plus these, so the student learns the teacher's
    ranking of (N + 1) x the batch at no extra forward pass (cross-batch memory, Wang et al. 2020). The
    student's vectors are kept detached (made by weights at most N steps old), the teacher's are exact. Every
    rank keeps the same gathered rows, so every rank scores the same global softmax. A batch's passages are
    staged, and join the memory only once its optimizer step is taken (`commit`): micro-batches of one
    accumulation window do not see each other, and a checkpoint (`state_dict`) never holds the passages of a
    step that was not taken, such as one whose loss was not finite.
    """

    def __init__(self, steps: int):
        self.entries: deque[tuple[torch.Tensor, torch.Tensor]] = deque(maxlen=max(0, steps))
        self.staged: list[tuple[torch.Tensor, torch.Tensor]] = []

    def extend(self, student: torch.Tensor, teacher: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(student, teacher) passages followed by the remembered ones, oldest first."""
        if not self.entries:
            return student, teacher
        return (
            torch.cat([student, *(s.to(student.dtype) for s, _ in self.entries)]),
            torch.cat([teacher, *(t.to(teacher.dtype) for _, t in self.entries)]),
        )

    def stage(self, student: torch.Tensor, teacher: torch.Tensor) -> None:
        if self.entries.maxlen:
            self.staged.append((student.detach(), teacher.detach()))

    def commit(self) -> None:
        """The optimizer step was taken: the staged passages become candidates for the next steps."""
        if self.staged:  # one entry per step, whatever the number of accumulated micro-batches
            self.entries.append(tuple(torch.cat(side) for side in zip(*self.staged)))
        self.staged = []

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {
            f"{side}.{i}": pair[j].contiguous()
            for i, pair in enumerate(self.entries)
            for j, side in enumerate(("student", "teacher"))
        }

    def load_state_dict(self, tensors: dict[str, torch.Tensor], device: torch.device) -> None:
        self.entries.clear()
        self.staged = []
        for i in range(len(tensors) // 2):
            self.entries.append((tensors[f"student.{i}"].to(device), tensors[f"teacher.{i}"].to(device)))


class WeightAverage:
    """An exponential moving average of the model's weights over a phase's optimizer steps (Polyak averaging).

    torch's `AveragedModel` keeps the averaged copy and updates it with one fused lerp per device and dtype.
    The average starts at the phase's starting weights, so after T steps those keep a weight of decay**T: in
    phase 2 the average stays partly anchored at what phase 1 learned. The phase ends with the average
    (`apply_to`), and periodic evaluations score it, since it is what the phase exports. Decay 0: off, no copy.
    Every rank holds the same parameters, so every rank's average is the same and checkpoints need one.
    """

    def __init__(self, model: DistillationModel, decay: float):
        self.averaged = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(decay)) if decay > 0 else None
        self.update(model)  # the first update copies: the average starts at the phase's starting weights

    def update(self, model: DistillationModel) -> None:
        if self.averaged is not None:
            self.averaged.update_parameters(model)

    def model(self, model: DistillationModel) -> DistillationModel:
        """What the phase would end with now: the average, or `model` itself when averaging is off."""
        return model if self.averaged is None else self.averaged.module

    @torch.no_grad()
    def apply_to(self, model: DistillationModel) -> None:
        if self.averaged is not None:
            torch._foreach_copy_(list(model.parameters()), list(self.averaged.module.parameters()))

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {} if self.averaged is None else dict(self.averaged.state_dict())  # save_checkpoint detaches

    def load_state_dict(self, tensors: dict[str, torch.Tensor]) -> None:
        if self.averaged is not None:
            self.averaged.load_state_dict(tensors)


def release_freed_memory() -> None:
    """Hand the heap's free pages back to the OS (glibc's malloc_trim), between stages and every few steps.

    Batches of varying shapes leave freed activation blocks scattered through the heap, and the resident
    size ratchets up with the number of distinct shapes seen; trimming returns those pages for a few page
    faults when they are reused (serving large blocks by mmap instead cost about 30% of the speed). Under
    tcmalloc, which the launchers preload when it is installed (distill/allocator.py), it trims nothing.
    """
    gc.collect()
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):
            pass  # not glibc: nothing to trim


def scaled_lr(lr: float, scaling: str, num_processes: int) -> float:
    """Learning rate for a global batch num_processes times the per-process one."""
    if scaling == "linear":
        return lr * num_processes
    if scaling == "sqrt":
        return lr * math.sqrt(num_processes)
    return lr


def make_optimizer(
    model: DistillationModel,
    lr: float,
    weight_decay: float,
    projection_lr_scale: float = 1.0,
    device_type: str = "cpu",
) -> torch.optim.Optimizer:
    """AdamW without weight decay on biases and norms; the projection in its own group at its own lr.

    On the devices torch has a fused AdamW kernel for (`device_type`: where training runs; the parameters
    may not be there yet), the whole update is one fused kernel: on a CPU it replaces a loop of a dozen
    tensor ops per parameter, the 3-layer demo student's step takes 48 -> 12 ms, about 12% of a training
    step (docs/QUALITY.md, session 20). Hugging Face's Trainer, and so the peer recipe, uses it too.
    """
    groups: dict[tuple[bool, bool], list[torch.nn.Parameter]] = {}
    for name, parameter in model.named_parameters():
        if parameter.requires_grad:
            key = (name.startswith("projection."), name.endswith(NO_DECAY))
            groups.setdefault(key, []).append(parameter)
    return torch.optim.AdamW(
        [
            {
                "params": params,
                "weight_decay": 0.0 if no_decay else weight_decay,
                "lr": lr * projection_lr_scale if is_projection else lr,
                "projection": is_projection,
            }
            for (is_projection, no_decay), params in sorted(groups.items())
        ],
        lr=lr,
        fused=device_type in FUSED_ADAMW_DEVICES or None,
    )


def make_scheduler(
    optimizer: torch.optim.Optimizer, warmup_steps: int, total_steps: int, backbone_frozen_steps: int = 0
) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up then linear decay to 0 (transformers' "linear" schedule), per parameter group.

    With `backbone_frozen_steps`, every group but the projection's has lr 0 for that many steps, then
    warms up from there: a warm-up in which only the projection learns, without changing which parameters
    take part in DDP's gradient all-reduce.
    """

    def linear(step: int, start: int = 0) -> float:
        if step < start:
            return 0.0
        if step < start + warmup_steps:
            return float(step - start) / float(max(1, warmup_steps))
        return max(0.0, float(total_steps - step) / float(max(1, total_steps - start - warmup_steps)))

    def backbone(step: int) -> float:
        return linear(step, backbone_frozen_steps)

    lambdas = [linear if group.get("projection") else backbone for group in optimizer.param_groups]
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambdas)


def gather_with_grad(accelerator: Accelerator, local: torch.Tensor) -> torch.Tensor:
    """All processes' rows (in rank order); only this process's rows carry a gradient."""
    if accelerator.num_processes == 1:
        return local
    chunks = list(accelerator.gather(local.detach().contiguous()).split(local.shape[0]))
    chunks[accelerator.process_index] = local
    return torch.cat(chunks)


def phase_loss(
    accelerator: Accelerator,
    model: torch.nn.Module,
    batch: dict,
    settings: PhaseSettings,
    memory: PassageMemory,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss to backpropagate, loss to report) for one batch of either phase; phase 2 stages into `memory`."""
    dims, weights = settings.matryoshka_dims, settings.weights
    if settings.teacher_basis is not None:  # the teacher's vectors in the basis the student is trained in
        batch = {k: v @ settings.teacher_basis if k.startswith("teacher") else v for k, v in batch.items()}
    if settings.name == "phase1":
        ((_, target),) = model(batch["texts"])
        loss = alignment_loss(target, batch["teacher"], weights, dims)
        if not weights.phase1_kl:
            return loss, loss.detach()
        texts = gather_with_grad(accelerator, target)
        teacher = accelerator.gather(batch["teacher"].contiguous())
        phase1_weights = replace(weights, kl=weights.phase1_kl)
        similarity = similarity_kl_loss(texts, texts, teacher, teacher, phase1_weights, dims, exclude_self=True)
        return loss + accelerator.num_processes * similarity, (loss + similarity).detach()
    query_chunks, passage_chunks = batch["queries"]["chunks"], batch["passages"]["chunks"]
    outputs = [target for _, target in model(*query_chunks, *passage_chunks)]  # one forward call for DDP
    queries = assemble_chunks(outputs[: len(query_chunks)], batch["queries"])  # (batch, dim)
    passages = assemble_chunks(outputs[len(query_chunks) :], batch["passages"])  # (batch x (1 + negatives), dim)
    alignment = 0.5 * (
        alignment_loss(queries, batch["teacher_queries"], weights, dims)
        + alignment_loss(passages, batch["teacher_passages"], weights, dims)
    )
    student_queries = gather_with_grad(accelerator, queries)
    teacher_queries = accelerator.gather(batch["teacher_queries"].contiguous())
    student_passages = gather_with_grad(accelerator, passages)
    teacher_passages = accelerator.gather(batch["teacher_passages"].contiguous())
    candidate_passages, candidate_teacher = memory.extend(student_passages, teacher_passages)
    similarity = similarity_kl_loss(
        student_queries, candidate_passages, teacher_queries, candidate_teacher, weights, dims
    )
    if weights.resim:  # the batch's own passages: the memory would square its (scores x scores) cost
        similarity = similarity + relative_similarity_loss(
            student_queries, student_passages, teacher_queries, teacher_passages, weights, dims
        )
    memory.stage(student_passages, teacher_passages)
    # DDP averages gradients over ranks; the global similarity loss is computed on every rank and each
    # rank's gradient covers only its own rows, so scaling by the world size makes the average the sum
    # (phase 1's text-to-text similarity above is scaled the same way).
    loss = alignment + accelerator.num_processes * similarity
    return loss, (alignment + similarity).detach()


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


class TrainingStopped(DistillError):
    """Training stopped on purpose (preemption, non-finite loss) after writing a checkpoint."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


class _Preemption:
    """SIGTERM and a first SIGINT (Ctrl-C) set a flag; the loop turns it into a collective decision at the next step.

    The handlers stay once the first phase installs them, and installing them again keeps the flags: a signal that
    comes between the phases (during the end-of-phase evaluation, say) stops the run at phase 2's first step. The
    stop that acts on a flag clears it. A first SIGINT puts Python's own handler back, so a second one interrupts
    at once (KeyboardInterrupt); `release` puts back the SIGINT handler found at install, once training is over.
    """

    requested = False  # SIGTERM
    interrupted = False  # SIGINT
    _sigint_before: object = None  # the SIGINT handler install found

    @classmethod
    def install(cls) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signal.SIGTERM) != cls._handle:
            cls.requested = False
            signal.signal(signal.SIGTERM, cls._handle)
        before = signal.getsignal(signal.SIGINT)
        # not when Ctrl-C came already (a second one interrupts), nor where SIGINT is ignored (nohup, `cmd &`)
        if before not in (cls._interrupt, signal.SIG_IGN) and not cls.interrupted:
            cls._sigint_before = before
            signal.signal(signal.SIGINT, cls._interrupt)

    @classmethod
    def release(cls) -> None:
        """Ctrl-C interrupts at once again, and a SIGINT no step acted on is forgotten."""
        if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) == cls._interrupt:
            signal.signal(signal.SIGINT, cls._previous_sigint())
        cls.interrupted = False

    @classmethod
    def _previous_sigint(cls) -> object:
        before = cls._sigint_before
        return before if callable(before) else signal.default_int_handler  # SIG_DFL or None: KeyboardInterrupt

    @classmethod
    def _handle(cls, signum: int, frame: object) -> None:
        cls.requested = True

    @classmethod
    def _interrupt(cls, signum: int, frame: object) -> None:
        cls.interrupted = True
        signal.signal(signal.SIGINT, cls._previous_sigint())  # a second Ctrl-C: at once
        if os.environ.get("RANK", "0") == "0":  # os.write: print is not safe in a signal handler
            os.write(2, b"\ndistill: Ctrl-C: stopping with a checkpoint after this step; Ctrl-C again stops at once\n")


def release_stop_signals() -> None:
    """Once training is over: Ctrl-C interrupts at once again (SIGTERM keeps being noted, as it was)."""
    _Preemption.release()


def _section(tensors: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {k.removeprefix(prefix): v for k, v in tensors.items() if k.startswith(prefix)}


def plain_model(accelerator: Accelerator, wrapped: torch.nn.Module) -> DistillationModel:
    """The model `prepare` was given, free of DDP and of torch.compile, sharing the trained parameters.

    Not compiled, so evaluation runs eagerly, checkpoints and exports carry no `_orig_mod.` in their keys,
    and the next phase's `prepare` compiles it afresh. Regional compilation leaves the given model untouched
    and compiles a copy of its module tree; Accelerate's `unwrap_model` keeps that copy by default (under
    DDP it even returns the DDP wrapper of the copy), so `keep_torch_compile=False` is what gives it back.
    """
    return accelerator.unwrap_model(wrapped, keep_torch_compile=False)


def train_phase(
    accelerator: Accelerator,
    model: DistillationModel,
    loader: DataLoader,
    settings: PhaseSettings,
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
    if settings.teacher_basis is not None:  # moved to the device once, not on every batch
        settings = replace(settings, teacher_basis=settings.teacher_basis.to(accelerator.device))
    optimizer = make_optimizer(
        model, settings.lr, settings.weight_decay, settings.projection_lr_scale, accelerator.device.type
    )
    sampler = loader.batch_sampler
    accumulation = accelerator.gradient_accumulation_steps
    steps_per_epoch = math.ceil(len(loader) / accumulation)
    # An epoch of batches that is no multiple of the window ends with a shorter window (Accelerate steps at the end of
    # the loader), whose losses Accelerate still divides by the full window length: scaled back up to their own mean.
    short_window = len(loader) % accumulation
    total_steps = max(1, steps_per_epoch * settings.epochs)
    scheduler = make_scheduler(
        optimizer, int(settings.warmup_ratio * total_steps), total_steps, settings.backbone_frozen_steps
    )
    wrapped, optimizer, prepared_loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    memory = PassageMemory(settings.kl_memory_steps if settings.name == "phase2" else 0)  # 0: holds nothing
    plain = plain_model(accelerator, wrapped)  # placed on the device by `prepare`; shares its parameters
    average = WeightAverage(plain, settings.ema_decay)

    def checkpoint() -> Path:
        extra = {f"memory.{k}": v for k, v in memory.state_dict().items()}
        extra |= {f"average.{k}": v for k, v in average.state_dict().items()}
        return save_checkpoint(accelerator, checkpoints.output_dir, state, checkpoints.limit, extra)

    def evaluation_due() -> bool:
        return evaluate is not None and eval_steps > 0 and state.optimizer_steps % eval_steps == 0

    if resume is not None:
        extra = load_checkpoint(accelerator, resume)
        memory.load_state_dict(_section(extra, "memory."), accelerator.device)
        average.load_state_dict(_section(extra, "average."))
        accelerator.step = state.accelerator_step  # keeps gradient-accumulation windows where they were
    else:
        state.start_phase(settings.name)
    _Preemption.install()
    wrapped.train()
    progress = tqdm(
        total=total_steps,
        initial=state.optimizer_steps,
        desc=settings.name,
        disable=not accelerator.is_local_main_process,
        dynamic_ncols=True,
    )
    window_losses: list[float] = []
    terminated = interrupted = False
    window_start = state.batches_done  # batches done at the last optimizer step: where a resume restarts
    window_samples = state.train_samples  # likewise the samples
    started = time.perf_counter() - state.train_seconds  # moved on by evaluations and checkpoints: not training time

    def outside_training_time(action: Callable[[], object]) -> None:
        nonlocal started
        before = time.perf_counter()
        action()
        started += time.perf_counter() - before

    if state.evaluation_pending:  # stopped at an evaluation step before evaluating: that evaluation comes first
        state.evaluation_pending = False
        if evaluate is not None:
            outside_training_time(lambda: evaluate(average.model(plain), state.optimizer_steps))
    try:  # the bar ends its line before any error is printed, not glued to it
        for epoch in range(state.epoch, settings.epochs):
            state.epoch = epoch
            batches = prepared_loader
            if state.batches_done:
                batches = accelerator.skip_first_batches(prepared_loader, state.batches_done)
            # Accelerate's loaders push their own epoch counter into the sampler when iterated; a loader made
            # by skip_first_batches starts that counter at 0, so set it explicitly to keep the data order.
            batches.set_epoch(epoch)
            sampler.set_epoch(epoch)
            for batch in batches:
                with accelerator.accumulate(wrapped):
                    loss, reported = phase_loss(accelerator, wrapped, batch, settings, memory)
                    if short_window and state.batches_done >= len(loader) - short_window:
                        loss = loss * (accumulation / short_window)
                    accelerator.backward(loss)
                    signals = (_Preemption.requested, _Preemption.interrupted)
                    global_loss, (term, intr) = batch_verdict(accelerator, reported, signals)
                    terminated, interrupted = terminated or term, interrupted or intr
                    if not math.isfinite(global_loss):  # before the optimizer step: the weights are still good
                        state.batches_done, state.train_samples = window_start, window_samples
                        path = checkpoint()
                        raise TrainingStopped(
                            f"non-finite loss ({global_loss}) in {settings.name} at optimizer step "
                            f"{state.optimizer_steps + 1} (epoch {epoch}); the checkpoint from before it is {path}; "
                            "lower the learning rate or use --mixed_precision bf16/no, then --resume_from_checkpoint",
                            exit_code=3,
                        )
                    if accelerator.sync_gradients and settings.max_grad_norm > 0:
                        accelerator.clip_grad_norm_(wrapped.parameters(), settings.max_grad_norm)
                    optimizer.step()
                    scheduler.step()
                    optimizer.zero_grad(set_to_none=True)
                window_losses.append(global_loss)
                state.batches_done += 1
                state.train_samples += sampler.batch_size
                if not accelerator.sync_gradients:
                    continue
                memory.commit()
                average.update(plain)
                mean_loss = sum(window_losses) / len(window_losses)
                window_losses.clear()
                window_start, window_samples = state.batches_done, state.train_samples
                state.optimizer_steps += 1
                state.accelerator_step = accelerator.step
                state.losses.append(mean_loss)
                state.train_seconds = time.perf_counter() - started
                progress.update(1)
                progress.set_postfix(loss=f"{mean_loss:.4f}", lr=f"{scheduler.get_last_lr()[0]:.2e}", refresh=False)
                accelerator.log(
                    {f"{settings.name}/loss": mean_loss, f"{settings.name}/lr": scheduler.get_last_lr()[0]},
                    step=state.global_step(),  # counted on over the phases: the trackers' x axis goes on
                )
                if terminated or interrupted:  # decided collectively (batch_verdict): every rank stops at the same step
                    name, code = ("SIGTERM", 143) if terminated else ("SIGINT", 130)
                    _Preemption.requested = _Preemption.interrupted = False
                    # this step's evaluation is left to the resumed run: a preemption's grace period is short
                    state.evaluation_pending = evaluation_due()
                    path = checkpoint()
                    raise TrainingStopped(
                        f"stopped by {name} in {settings.name} at optimizer step {state.optimizer_steps}; checkpoint "
                        f"saved to {path}; continue with --resume_from_checkpoint latest",
                        exit_code=code,
                    )
                if evaluation_due():
                    outside_training_time(lambda: evaluate(average.model(plain), state.optimizer_steps))  # all ranks
                if checkpoints.every and state.optimizer_steps % checkpoints.every == 0:
                    outside_training_time(checkpoint)
                if TRIM_EVERY and accelerator.device.type == "cpu" and state.optimizer_steps % TRIM_EVERY == 0:
                    release_freed_memory()
            state.batches_done = window_start = 0
    finally:
        progress.close()
    state.epoch = settings.epochs
    state.train_seconds = time.perf_counter() - started
    average.apply_to(plain)
    accelerator.free_memory()  # forget this phase's optimizer, scheduler and loader; the next phase re-prepares
    return plain
