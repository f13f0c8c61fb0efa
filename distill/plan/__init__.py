"""The planner: what a run will cost, before it is paid for.

    python -m distill.plan [the run's flags or --config] [--device h100] [--num_machines 2] [--json]

It reads the data as the run would (`load_data`: the same caps, cleaning and held-out split), tokenizes a
seeded sample of every text list with the teacher's and the student's tokenizers (the teacher's prompts
included), and builds both models on PyTorch's meta device from their configs: configs and tokenizers only,
no weight is loaded. From these it counts, for the topology given:

- texts and tokens per phase, and the teacher cache's bytes on disk (float16 vectors, one per text);
- FLOPs: a forward pass costs 2 x (parameters outside the embedding tables) per token, plus 4 x layers x width
  x length per token for attention; training costs three forward passes;
- seconds: FLOPs / (processes x the device's achieved FLOP/s). A GPU's achieved rate is its bf16 dense peak
  times a stated utilisation (`DEVICES`), or what `--teacher_tflops` / `--student_tflops` say (measured by
  `make bench-gpu`, say). On a CPU the planner times the run's own work on this machine: a few optimizer steps of
  the student at the run's batch and lengths, a few teacher batches (distill/plan/calibration.py), kept per
  processor model;
- peak memory per process, all-reduce bytes per optimizer step, and the disk the checkpoints need;
- for a static student distilled here, its table's pass: each vocabulary token through the model once, as three
  tokens, on each machine.

Every assumption is printed with the figures; `--json` prints them as one object.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from distill.config.schema import Config
from distill.plan.calibration import calibrate
from distill.plan.devices import Device, calibrated, process_base_bytes
from distill.plan.figures import (
    Models,
    TextList,
    allreduce_bytes,
    checkpoint_bytes,
    memory,
    model_shapes,
    table_figures,
    teacher_figures,
    training_flops,
)
from distill.plan.host import HostFigures, host_figures
from distill.plan.texts import SAMPLE, measure_texts, scale_counts, text_lists, token_counts
from distill.teachers import where


@dataclass
class Plan:
    """Every figure the planner prints."""

    device: str
    processes: int
    machines: int
    texts: dict[str, int]
    tokens: dict[str, dict[str, float]]  # phase -> {"teacher": ..., "student": ...} (one epoch)
    cache_bytes: int
    teacher_flops: float
    teacher_seconds: float
    train_flops: dict[str, float]
    train_seconds_by_phase: dict[str, float]
    train_seconds: float
    optimizer_steps: dict[str, int]
    teacher_memory_bytes: int
    student_memory_bytes: int
    allreduce_bytes_per_step: int
    allreduce_seconds_per_step: float
    checkpoint_bytes: int  # every checkpoint kept at once (--checkpoints_total_limit, plus the one being written)
    checkpoint_bytes_each: int
    parameters: dict[str, int]
    dominant: str
    device_memory_bytes: float = 0.0
    assumptions: dict[str, Any] = field(default_factory=dict)
    teacher: str = ""  # a model run here: empty; else what stands behind it (an endpoint, a vectors file)
    table_tokens: int = 0  # a static student distilled here: its vocabulary, each token through the model once
    table_flops: float = 0.0
    table_seconds: float = 0.0  # on each machine, split over its processes
    host: HostFigures | None = None  # memory per process, preparation and mining on the host
    reranker: str = ""  # phase 2's reranker, where one scores the candidates
    reranker_pairs: int = 0  # (query, candidate) pairs it scores once: queries x (1 + negatives)
    reranker_tokens: float = 0.0  # their tokens, query and passage, counted as the teacher's


def make_plan(
    config: Config, device: Device, machines: int = 1, phase1_texts: int | None = None, phase2_pairs: int | None = None
) -> Plan:
    """The figures for `config` on `config.launch.num_processes` processes of `device` over `machines`
    (`phase1_texts`, `phase2_pairs`: plan for that many, with the lengths of the data read)."""
    processes, training = config.launch.num_processes or 1, config.training
    models = model_shapes(config)
    student = models.student
    lists, reading = text_lists(config, not training.skip_phase1, not training.skip_phase2)
    measured, teacher_tokenizer = measure_texts(config, lists, models)
    if device.base_bytes:  # a CPU: the process's base is its RSS with the data and tokenizers a run holds, too
        device = replace(device, base_bytes=process_base_bytes())
    del lists
    measured = scale_counts(measured, phase1_texts, phase2_pairs)
    if device.calibration:  # a CPU: the run's own work timed here, now that its models and lengths are known
        rates = calibrate(config, models, measured, again=device.calibration == "again")
        device = calibrated(device, rates.teacher, rates.student, rates.line)
    projection = student.dim * models.teacher_dim + models.teacher_dim if config.mode.use_projection else 0
    teacher_flops, teacher_seconds, teacher_memory, cache_bytes = teacher_figures(
        config, device, models, measured, projection
    )
    table = table_figures(config, device, models, machines)
    train_flops, steps = training_flops(config, student, measured, projection // max(models.teacher_dim, 1))
    train_seconds_by_phase = {
        phase: flops / (processes * device.student_rate_of(phase)) for phase, flops in train_flops.items()
    }
    train_seconds = sum(train_seconds_by_phase.values())
    allreduce, link = allreduce_bytes(config, device, student, projection, machines)
    student_memory = memory(config, device, models.teachers[0], student, measured, projection)[1]
    checkpoint_one, kept = checkpoint_bytes(config, student, projection)
    return Plan(
        device=device.name,
        processes=processes,
        machines=machines,
        texts={t.name: t.count for t in measured},
        tokens=token_counts(measured),
        cache_bytes=cache_bytes,
        teacher_flops=teacher_flops,
        teacher_seconds=teacher_seconds,
        train_flops=train_flops,
        train_seconds_by_phase=train_seconds_by_phase,
        train_seconds=train_seconds,
        optimizer_steps=steps,
        teacher_memory_bytes=teacher_memory,
        student_memory_bytes=student_memory,
        allreduce_bytes_per_step=allreduce,
        allreduce_seconds_per_step=allreduce / link if allreduce and link else 0.0,
        checkpoint_bytes=checkpoint_one * kept,
        checkpoint_bytes_each=checkpoint_one,
        parameters=parameter_counts(models),
        dominant="the teacher's encoding"
        if teacher_seconds + table["table_seconds"] >= train_seconds
        else "the student's training",
        teacher=where(config.teacher),
        **table,
        device_memory_bytes=device.memory_bytes,
        assumptions=assumptions(device, link, teacher_tokenizer),
        host=host_figures(measured, reading, vectors_bytes(config), mining_width(config, models), device.teacher_rate),
        **reranker_figures(config, measured),
    )


def parameter_counts(models: Models) -> dict[str, int]:
    """The teacher's (its members' summed) and the student's parameters, all and outside the embeddings."""
    return {
        "teacher": sum(t.parameters for t in models.teachers),
        "teacher_dense": sum(t.dense_parameters for t in models.teachers),
        "student": models.student.parameters,
        "student_dense": models.student.dense_parameters,
        **({"phase1_teacher": models.phase1_teacher.parameters} if models.phase1_teacher else {}),
    }


def mining_width(config: Config, models: Models) -> tuple[int, int]:
    """(negatives mined a query, the width of the vectors searched): (0, width) where nothing is mined."""
    return config.data.mine_hard_negatives, models.teacher_dim or 1


def vectors_bytes(config: Config) -> int:
    """The bytes of a --teacher_vectors file, which a cold run copies into the teacher cache (0: none)."""
    path = Path(config.teacher.teacher_vectors or "").expanduser()
    return path.stat().st_size if config.teacher.teacher_vectors and path.is_file() else 0


def reranker_figures(config: Config, measured: list[TextList]) -> dict[str, Any]:
    """The pairs a reranker scores: each phase-2 query with its positive and negatives (the data's, or mined)."""
    lists = {t.name: t for t in measured}
    queries, passages = lists.get("phase2 queries"), lists.get("phase2 passages")
    if config.reranker.reranker_model is None or queries is None or passages is None or not queries.count:
        return {}
    given = passages.count // queries.count - 1  # the data's negatives per query
    candidates = 1 + (given or config.data.mine_hard_negatives)
    pairs = queries.count * candidates
    return {
        "reranker": config.reranker.reranker_model,
        "reranker_pairs": pairs,
        "reranker_tokens": pairs * (queries.teacher_tokens + passages.teacher_tokens),
    }


def assumptions(device: Device, link: float, teacher_tokenizer: str) -> dict[str, Any]:
    """What the plan's figures rest on: the device's rates and link, which tokenizer counted, the sample's size."""
    return {
        "teacher_flops_per_second": device.teacher_rate,
        "student_flops_per_second": device.student_rate,
        "student_flops_per_phase": dict(device.student_rates),  # a CPU's, timed per phase
        "rates": device.rates,
        "interconnect_bytes_per_second": link,
        "teacher_tokenizer": teacher_tokenizer,
        "sampled_texts_per_list": SAMPLE,
        "process_base_bytes": device.base_bytes,
    }
