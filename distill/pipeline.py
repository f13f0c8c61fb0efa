"""The distillation pipeline, stage by stage:

    texts -> teacher embeddings -> student -> phase 1 -> phase 2 -> evaluation -> export

1. data: phase-1 texts, phase-2 (query, passage) pairs, the held-out evaluation set    (data.py)
2. teacher: embeddings of every text, sharded over processes, cached by content        (teacher.py, cache.py)
3. student: loaded, pruned, projection or basis fitted on the teacher's vectors        (student.py)
4. baseline: the teacher and the untrained student evaluated                           (evaluation.py)
5. phases: phase 1 aligns the student with the teacher's vectors on general text;      (phases.py, loop.py)
   phase 2 distils the teacher's in-batch query/passage similarities
6. cost: the teacher's and the student's size and encoding speed on this device       (efficiency.py)
7. export: SentenceTransformer folder(s), results.json and the report                 (export.py, report.py)

`run(config)` is what `python -m distill.train` calls on every process, and what a Python user calls too.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.logging import get_logger
from accelerate.utils import set_seed

from distill.allocator import heap_allocator, release_freed_memory
from distill.checkpoint import PHASES, TrainingState, resume_requested, resume_state
from distill.config import Config, to_flat_dict
from distill.data import DistillData, load_data
from distill.distributed import main_decides, make_accelerator
from distill.efficiency import CostTexts, cost_table, measure_student, trade_off_line
from distill.errors import OutOfMemory
from distill.evaluation import EvalInputs, PhaseEvaluation, eval_inputs, evaluate_student, evaluate_teacher
from distill.export import deployable_model, export_models, push_to_hub
from distill.files import folder_bytes
from distill.loop import CheckpointSettings, train_phase, training_memory_message
from distill.phases import Phase, check_phase_sizes, make_phases
from distill.report import check_output_dir, prepare_output_dir, results_table, write_results
from distill.results import PhaseFigures, RunResults
from distill.student import DistillationModel, build_student, check_declared_dimensions, phase_bases
from distill.teacher import TeacherVectors, embed_with_teacher, teacher_dtype
from distill.tracking import tracker_config

logger = get_logger(__name__)


def run(config: Config) -> RunResults:
    """The whole pipeline on this process (one of the launched ones). Returns the run's results."""
    resuming = resume_requested(config)
    accelerator = make_accelerator(config, resuming)
    set_seed(config.training.seed)
    check_output_dir(accelerator, config.output.output_dir, fresh=not resuming)
    phases = make_phases(config, accelerator.num_processes)
    state, resume = resume_state(accelerator, config)

    check_declared_dimensions(config.model)  # before any encoding: a wrong pairing fails in seconds
    trained = {phase.name for phase in phases}
    with stage("data"):
        data = load_data(config.data, config.training.seed, "phase1" in trained, "phase2" in trained, config.inherited)
        check_phase_sizes(phases, data, config.training.batch_size, accelerator.num_processes)
    costs = CostTexts.from_data(data, config.output.efficiency_texts, config.training.batch_size, config.training.seed)
    with stage("teacher"):
        teacher = embed_with_teacher(accelerator, config, data, costs)
    with stage("student"):
        model, dims, basis = build_student(accelerator, config, teacher.fit_dim, *teacher.fit_sample(data))
        bases = phase_bases(accelerator, config, model, basis, teacher)
        evaluation = eval_inputs(model.student, data, teacher.evaluation, bases["phase2"])
    output_dir = prepare_output_dir(accelerator, config)  # inputs are valid: from here on the run writes
    accelerator.init_trackers(config.output.tracker_project, config=tracker_config(config))

    with stage("evaluation before training"):
        evaluate_baseline(accelerator, config, model, state, evaluation, dims)
    for phase in phases:
        if resume is not None and PHASES.index(phase.name) < PHASES.index(state.phase):
            continue  # finished before the checkpoint; its figures are in the checkpoint's results
        phase.use_student(dims, bases[phase.name])
        evaluations = None
        if evaluation is not None:
            evaluations = PhaseEvaluation(accelerator, config, evaluation, dims, phase.name, state, output_dir)
        resumed = resume if phase.name == state.phase else None
        with stage(phase.name):
            model = train_stage(accelerator, config, model, phase, data, teacher, state, evaluations, resumed)
            record_phase(state, phase, teacher, model, evaluations, phase.samples(data), final=phase is phases[-1])
        resume = None
    return finish(accelerator, config, model, state, teacher, output_dir, evaluation is not None, costs)


@contextmanager
def stage(name: str) -> Iterator[None]:
    """Log a stage's start and its seconds (info level, main process)."""
    started = time.perf_counter()
    logger.info(f"{name} ...")
    yield
    logger.info(f"{name}: done in {time.perf_counter() - started:.1f} s")


def evaluate_baseline(
    accelerator: Accelerator,
    config: Config,
    model: DistillationModel,
    state: TrainingState,
    evaluation: EvalInputs | None,
    dims: list[int] | None,
) -> None:
    """The results start (a resumed run's come from its checkpoint): the teacher and the untrained student scored."""
    results = state.results  # checkpoints carry the evaluations made so far
    results.mode = results.mode or ("projection" if model.projection is not None else "matryoshka")
    results.world_size = accelerator.num_processes
    results.heap_allocator = heap_allocator()
    if accelerator.device.type == "cpu" and results.heap_allocator == "glibc":
        logger.warning(
            "heap allocator: glibc malloc, whose peak memory creeps up with the steps on a CPU; for a flat peak "
            "install libtcmalloc-minimal4 and launch through make or run_ddp.sh (see distill/allocator.py)",
            main_process_only=True,
        )
    if evaluation is not None and results.teacher is None:
        results.teacher = evaluate_teacher(evaluation)
        results.student_before = evaluate_student(accelerator, model, evaluation, 2 * config.training.batch_size, dims)


def train_stage(
    accelerator: Accelerator,
    config: Config,
    model: DistillationModel,
    phase: Phase,
    data: DistillData,
    teacher: TeacherVectors,
    state: TrainingState,
    evaluations: PhaseEvaluation | None,
    resume: Path | None,
) -> DistillationModel:
    """One phase trained from its start, or from the checkpoint `resume`; returns the trained model."""
    loader = phase.loader(model.student, data, teacher)
    checkpoints = CheckpointSettings(
        Path(config.output.output_dir).expanduser(),
        config.checkpoint.checkpoint_steps,
        config.checkpoint.checkpoints_total_limit,
    )
    periodic = evaluations.periodic if evaluations is not None else None
    try:
        model = train_phase(
            accelerator, model, phase, loader, state, checkpoints, resume, periodic, config.checkpoint.eval_steps
        )
    except torch.OutOfMemoryError as e:  # evaluation halves its batches itself: this is a training step
        message = training_memory_message(config, phase.name, state, accelerator.mixed_precision, e)
        raise OutOfMemory(message) from None
    release_freed_memory()
    return model


def record_phase(
    state: TrainingState,
    phase: Phase,
    teacher: TeacherVectors,
    model: DistillationModel,
    evaluations: PhaseEvaluation | None,
    examples: int,
    final: bool,
) -> None:
    """The phase's figures into the results (`examples`: the texts or pairs it trains on), and its end-of-phase
    evaluation (`final`: the run's last phase)."""
    results = state.results
    results.phases[phase.name] = PhaseFigures(
        teacher_seconds=round(teacher.seconds[phase.name], 3),
        train_seconds=round(state.train_seconds, 3),
        train_samples=state.train_samples,
        optimizer_steps=state.optimizer_steps,
        samples_per_second=round(state.train_samples / max(state.train_seconds, 1e-9), 2),
        final_loss=state.losses[-1] if state.losses else None,
        losses=list(state.losses),
        examples=examples,
    )
    if evaluations is not None:
        metrics = evaluations.final(model, state.optimizer_steps)
        if final:
            results.student_after = metrics
        else:
            results.after_phase1 = metrics


def finish(
    accelerator: Accelerator,
    config: Config,
    model: DistillationModel,
    state: TrainingState,
    teacher: TeacherVectors,
    output_dir: Path,
    evaluated: bool,
    costs: CostTexts | None = None,
) -> RunResults:
    """The cost and export stages: what the student saves, the model folder(s), results.json and the report."""
    results = state.results
    if evaluated:  # the evaluation rows, once, at the run's last step
        accelerator.log(results.tracked_scalars(), step=state.global_step())
    results.teacher_loaded = teacher.loaded
    results.teacher_load_seconds = round(teacher.load_seconds, 3)
    results.teacher_seconds_evaluation = round(teacher.seconds["evaluation"], 3)
    efficiency = None
    if costs is not None:
        with stage("cost"):
            dtype = teacher_dtype(config.model.teacher_dtype, accelerator.device)  # both models alike
            efficiency = measure_student(accelerator, deployable_model(model), teacher.cost, costs, dtype)
        results.efficiency = efficiency.to_dict()
    figures = results.to_dict()
    table = results_table(figures) if evaluated else "(no evaluation set)"
    trade_off = trade_off_line(figures)
    if config.output.save_to_artifacts or config.output.push_to_hub:
        card = "\n\n".join(filter(None, [table, trade_off, cost_table(figures)]))
        exported = export_models(accelerator, model, config.output.artifacts_dir, to_flat_dict(config), card, figures)
        results.exported = exported
        if efficiency is not None:
            efficiency.exported_bytes = main_decides(accelerator, lambda: folder_bytes(exported["model"]))
            results.efficiency = efficiency.to_dict()
    results.config = to_flat_dict(config)
    path = write_results(accelerator, output_dir, results)
    if config.output.push_to_hub and results.exported:  # after results.json: an upload never costs the results
        folder = results.exported["model"]
        results.hub = main_decides(accelerator, lambda: publish(config, model, folder))
        write_results(accelerator, output_dir, results)
    for name, folder in (results.exported or {}).items():
        logger.info(f"exported {name}: {folder}")
    accelerator.print(f"\n{table}\n" + (f"\n{trade_off}\n" if trade_off else "") + f"\nresults: {path}")
    accelerator.wait_for_everyone()  # the group is torn down by all ranks together, not while rank 0 still writes
    accelerator.end_training()
    return results


def publish(config: Config, model: DistillationModel, folder: str) -> dict[str, str]:
    """--push_to_hub: the exported model folder uploaded (main process); results.json's `hub` entry."""
    repo, private = config.output.push_to_hub, config.output.hub_private
    assert repo is not None
    return push_to_hub(deployable_model(model), folder, repo, private)
