"""The planner's formulas: FLOPs, seconds, memory, all-reduce and checkpoint bytes, from the models' shapes (which the
kinds describe without loading weights) and the measured text lists."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from distill.config.schema import Config
from distill.files import DIGEST_BYTES
from distill.hub import ModelShape, config_folder, model_shape
from distill.plan.devices import INTER_MACHINE_BYTES_PER_S, Device
from distill.students.kinds import StudentFigures

CACHE_ENTRY_OVERHEAD = 2 * 128 + 400  # an entry's two .npy headers and its manifest.json
# A checkpoint's files besides the weights and AdamW's moments: RNG states, the scheduler, state.json (about 25 KB),
# and the optimizer's pickle, about 1.4 KB per parameter tensor (measured on the tiny test models).
CHECKPOINT_FIXED_BYTES, CHECKPOINT_BYTES_PER_TENSOR = 25_000, 1_400


@dataclass
class TextList:
    """One list of texts: how many, and their lengths in the teacher's and the student's tokens."""

    name: str
    phase: str  # "phase1", "phase2" or "evaluation"
    count: int
    teacher_tokens: float  # mean per text, prompt included, truncated as the teacher reads it
    teacher_square: float  # mean squared length, for attention
    student_tokens: float
    student_square: float
    student_longest: int  # the longest sampled text, as the student reads it
    teacher_longest: int = 0  # and as the teacher reads it
    tokenize_seconds: float = 0.0  # per text, by the student's tokenizer on this machine (the sample, timed)

    @property
    def total_teacher_tokens(self) -> float:
        return self.count * self.teacher_tokens

    @property
    def total_student_tokens(self) -> float:
        return self.count * self.student_tokens


@dataclass(frozen=True)
class Models:
    """The run's models as the planner reads them: their folders (configs and tokenizers) and shapes."""

    teacher_folder: Path  # whose tokenizer counts the teacher's tokens: the first teacher run here, or the student
    student_folder: Path
    phase1_folder: Path | None  # phase 1's own target (phase1_teacher_model), if any
    teachers: list[ModelShape]  # several when combined; an endpoint or a vectors file costs nothing here
    student: ModelShape
    phase1_teacher: ModelShape | None  # phase 1's own target
    student_figures: StudentFigures  # as its kind describes it: whether it reads every token, a table to distil

    @property
    def teacher_dim(self) -> int:
        """The width of the vectors the student learns: the members' concatenated."""
        return sum(t.dim for t in self.teachers)

    def encoders(self, phase: str) -> list[ModelShape]:
        """The models that encode a phase's texts: phase 1's own target, else the teacher's members."""
        return [self.phase1_teacher] if phase == "phase1" and self.phase1_teacher else self.teachers


def model_shapes(config: Config) -> Models:
    """The teachers', the student's and phase 1's target's configs and shapes, as their kinds describe them with no
    weights loaded. A teacher that runs elsewhere (an endpoint, a vectors file) costs nothing here."""
    from distill.students import student_kind
    from distill.teachers import check_teacher, teacher_kind, teacher_names

    settings, trust = config.teacher, config.student.trust_remote_code
    check_teacher(settings)
    student = student_kind(config.student.student_model).figures(config.student, settings)
    elsewhere = ModelShape(0, 0, 0, 0, 0, 0, 0, settings.teacher_dimensions or student.shape.dim)
    names = teacher_names(settings)
    found = [teacher_kind(name).figures(name, settings, trust) for name in names]  # a name given twice counts twice
    here = [figures for figures in found if figures is not None]
    teachers = [figures[1] if figures is not None else elsewhere for figures in found] or [elsewhere]
    phase1_folder = config_folder(settings.phase1_teacher_model, None) if settings.phase1_teacher_model else None
    phase1_teacher = model_shape(phase1_folder, None, trust) if phase1_folder else None
    teacher_folder = here[0][0] if here else student.folder
    return Models(teacher_folder, student.folder, phase1_folder, teachers, student.shape, phase1_teacher, student)


def teacher_figures(
    config: Config, device: Device, models: Models, measured: list[TextList], projection: int
) -> tuple[float, float, int, int]:
    """(FLOPs, seconds per process, peak bytes per process, cache bytes) of every teacher encoding every list once;
    a combined teacher's members are loaded one after the other and each is cached, besides the combination."""
    processes = config.launch.num_processes or 1
    flops = sum(
        shape.forward_flops(t.count, t.teacher_tokens, t.teacher_square)
        for t in measured
        for shape in models.encoders(t.phase)
    )
    shapes = models.teachers + ([models.phase1_teacher] if models.phase1_teacher else [])
    peak = max(memory(config, device, shape, models.student, measured, projection)[0] for shape in shapes)
    combined = 1 if len(models.teachers) > 1 else 0
    cache = sum(
        t.count * 2 * (sum(s.dim for s in models.encoders(t.phase)) + combined * models.teacher_dim)
        + (t.count * DIGEST_BYTES + CACHE_ENTRY_OVERHEAD) * (len(models.encoders(t.phase)) + combined)
        for t in measured
    )
    return flops, flops / (processes * device.teacher_rate), peak, cache


TABLE_TOKEN_LENGTH = 3  # a vocabulary token as model2vec's distillation runs it: the token and the special tokens


def table_figures(config: Config, device: Device, models: Models, machines: int) -> dict[str, Any]:
    """The Plan's table_tokens, table_flops and table_seconds: a table distilled here (a static student), every
    vocabulary token through the model once on each machine, split over its processes (distill/students/static.py);
    zeros for any other student, and for a table that starts from a folder."""
    source = models.student_figures.table_source
    if source is None:
        return {"table_tokens": 0, "table_flops": 0.0, "table_seconds": 0.0}
    shape = model_shape(source, None, config.student.trust_remote_code)
    tokens = models.student.parameters // max(models.student.dim, 1)  # the table's rows
    flops = shape.forward_flops(tokens, TABLE_TOKEN_LENGTH, TABLE_TOKEN_LENGTH**2)
    per_machine = max((config.launch.num_processes or 1) // machines, 1)
    return {"table_tokens": tokens, "table_flops": flops, "table_seconds": flops / (per_machine * device.teacher_rate)}


def allreduce_bytes(
    config: Config, device: Device, student: ModelShape, projection: int, machines: int
) -> tuple[int, float]:
    """(bytes each process sends and receives in one step's gradient all-reduce (a ring), the link's bytes/s)."""
    processes = config.launch.num_processes or 1
    gradient_bytes = 2 if config.performance.ddp_comm_hook in ("fp16", "bf16") else 4
    ring = 2 * (processes - 1) / processes
    allreduce = int(ring * (student.trainable_parameters + projection) * gradient_bytes)
    link = device.link_bytes_per_s if machines == 1 else min(device.link_bytes_per_s, INTER_MACHINE_BYTES_PER_S)
    return allreduce, link


def checkpoint_bytes(config: Config, student: ModelShape, projection: int) -> tuple[int, int]:
    """(bytes of one checkpoint: weights, AdamW's moments, the files' own overhead; how many are kept at once)."""
    one = (
        (student.parameters + projection) * 4
        + (student.trainable_parameters + projection) * 8
        + CHECKPOINT_FIXED_BYTES
        + CHECKPOINT_BYTES_PER_TENSOR * (student.tensors + (2 if projection else 0))
    )
    kept = config.checkpoint.checkpoints_total_limit + 1 if config.checkpoint.checkpoint_steps else 1
    return one, kept


def training_flops(
    config: Config, student: ModelShape, measured: list[TextList], projection_width: int
) -> tuple[dict[str, float], dict[str, int]]:
    """Each phase's training FLOPs (three forward passes per text, every epoch) and optimizer steps."""
    training, processes = config.training, config.launch.num_processes or 1
    epochs = {"phase1": config.phase1.epochs, "phase2": config.phase2.epochs}
    flops: dict[str, float] = {}
    steps: dict[str, int] = {}
    for phase in ("phase1", "phase2"):
        trained = [t for t in measured if t.phase == phase]
        if not trained:
            continue
        mined = config.data.mine_hard_negatives  # other pairs' passages, forwarded again as negatives
        passes = 4 if config.performance.gradient_checkpointing else 3  # checkpointing recomputes the forward pass
        per_epoch = sum(
            passes
            * student.forward_flops(
                t.count * (1 + mined if t.name == "phase2 passages" else 1), t.student_tokens, t.student_square
            )
            for t in trained
        )
        per_epoch += sum(3 * 2 * student.dim * projection_width * t.count for t in trained)  # projection mode
        flops[phase] = per_epoch * epochs[phase]
        batches = trained[0].count // (training.batch_size * processes)  # the last partial batch is dropped
        if phase == "phase1" and training.max_tokens_per_batch:  # about; padding to each batch's longest left out
            batches = max(
                1, int(trained[0].count * trained[0].student_tokens / (training.max_tokens_per_batch * processes))
            )
        steps[phase] = epochs[phase] * batches // training.gradient_accumulation_steps
    return flops, steps


def memory(
    config: Config, device: Device, teacher: ModelShape, student: ModelShape, measured: list[TextList], projection: int
) -> tuple[int, int]:
    """Peak bytes per process while the teacher encodes, and while the student trains.

    The teacher: its weights, and one layer's activations for a batch of the longest texts (hidden states, Q, K,
    V, the attention output, the MLP's two intermediate tensors). The student: float32 weights, gradients and
    AdamW's two moments and the temporary of its update, and every layer's activations kept for the backward
    pass at the longest batch (phase 2 forwards its queries and passages together). Both on top of the device's
    base: on a CPU the process's RSS with the run's imports, data and tokenizers.
    """
    training, performance = config.training, config.performance
    longest = max((t.student_longest for t in measured), default=0)
    teacher_longest = max((t.teacher_longest for t in measured), default=0)
    teacher_batch = performance.teacher_batch_size or training.batch_size
    teacher_activations = teacher_batch * teacher_longest * (5 * teacher.width + 2 * teacher.ffn)
    teacher_bytes = teacher.parameters * device.bytes_per_param + teacher_activations * device.bytes_per_param
    texts_per_step = training.batch_size * (1 if training.skip_phase2 else 2 + config.data.mine_hard_negatives)
    per_layer = texts_per_step * longest * (10 * student.width + 2 * student.ffn)
    # with gradient checkpointing each layer keeps its input only, and one layer's activations are recomputed at once
    checkpointed = student.layers * texts_per_step * longest * student.width + per_layer
    kept = checkpointed if performance.gradient_checkpointing else student.layers * per_layer
    student_bytes = (
        (student.parameters + projection) * 4
        # gradients, AdamW's two moments and the parameter-sized temporary its update holds, float32
        # (measured on a CPU: 8.0 bytes of moments and 4.3-5.1 of temporaries per parameter)
        + (student.trainable_parameters + projection) * 16
        + kept * device.activation_bytes
    )
    return int(device.base_bytes + teacher_bytes), int(device.base_bytes + student_bytes)
