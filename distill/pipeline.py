"""The distillation pipeline, stage by stage:

    texts -> teacher embeddings -> student -> phase 1 -> phase 2 -> evaluation -> cost -> export -> publish

1. data: phase-1 texts, phase-2 (query, passage) pairs, the held-out evaluation set    (data/)
2. teacher: embeddings of every text, sharded over processes, cached by content        (stages/targets.py)
3. student: loaded by its kind, projection or basis fitted on the teacher's vectors    (stages/initialise.py)
4. baseline: the teacher and the untrained student evaluated                           (stages/scoring.py)
5. phases: phase 1 aligns the student with the teacher's vectors on general text;      (phases.py, loop.py)
   phase 2 distils the teacher's in-batch query/passage similarities
6. cost: the student's size and encoding speed beside the teacher's, on this device    (stages/cost.py)
7. export: SentenceTransformer folder(s), results.json and the report                 (stages/export.py, report.py)
8. publish: the exported folder uploaded to the Hub (--push_to_hub)                   (stages/export.py)

`run(config)` is what `python -m distill.train` calls on every process, and what a Python user calls too.
"""

from __future__ import annotations

import contextlib
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.logging import get_logger
from accelerate.utils import set_seed

from distill.allocator import heap_allocator, release_freed_memory
from distill.checkpoint import PHASES as PHASE_ORDER
from distill.checkpoint import CheckpointSettings, Resume, TrainingState, resume_requested
from distill.config.flags import to_flat_dict
from distill.config.schema import Config
from distill.data import prepared_data
from distill.data.containers import DistillData
from distill.distributed import machine_share, main_decides, make_accelerator, on_main_process
from distill.errors import OutOfMemory, TrainingStopped
from distill.files import folder_bytes
from distill.loop import train_phase, training_memory_message
from distill.metrics import score
from distill.phases import Phase, PhaseSettings, check_phase_sizes, make_phases, phase_settings
from distill.precision import log_auto_precision
from distill.report import check_output_dir, prepare_output_dir, release_output_dir, results_table, write_results
from distill.results import PhaseFigures, RunResults
from distill.signals import PREEMPTION, agreed_stop
from distill.stages.candidates import check_candidates, score_candidates
from distill.stages.cost import CostTexts, Efficiency, measure_student
from distill.stages.export import deployable_model, export_models, push_to_hub
from distill.stages.forms import forms_to_dict, measure_forms, remove, staging_folder
from distill.stages.forms import wanted as onnx_wanted
from distill.stages.initialise import (
    PHASE1_TEACHER,
    TEACHER,
    Fitting,
    build_student,
    check_declared_dimensions,
    phase_bases,
)
from distill.stages.scoring import (
    EvalInputs,
    KeepBest,
    PhaseEvaluation,
    eval_inputs,
    evaluate_student,
    evaluate_teacher,
)
from distill.stages.targets import CacheSettings, TeacherVectors, embed_with_teacher
from distill.stages.tradeoff import cost_table, trade_off_line
from distill.students import kind_of, student_kind
from distill.students.head import DistillationModel
from distill.students.kinds import LoadContext, StudentDescription
from distill.teachers import TeacherContext
from distill.teachers.local import teacher_dtype
from distill.tracking import tracker_config

logger = get_logger(__name__)
NO_EVALUATION = "(no evaluation set)"
TOKENS = "tokens"  # under --teacher_cache_dir: each machine's tokenized texts (distill/tokens.py)
DATA = "data"  # under --teacher_cache_dir: each machine's read and cleaned data (distill/data/kept.py)


def run(config: Config) -> RunResults:
    """The whole pipeline on this process (one of the launched ones). Returns the run's results."""
    accelerator, resume = start(config)
    phases = make_phases(training_phases(config, accelerator.num_processes), accelerator.num_processes)
    trained = {phase.name for phase in phases}
    check_declared_dimensions(config.teacher, config.student, config.mode)  # a wrong pairing fails in seconds
    student = student_kind(config.student.student_model).describe(config.student, config.teacher)
    with stage("data"):
        caches = Path(config.output.teacher_cache_dir).expanduser()
        data = prepared_data(config.data, config.training.seed, "phase1" in trained, "phase2" in trained, caches / DATA)
        check_phase_sizes(phases, data, config.training.batch_size, accelerator.num_processes)
        if config.reranker.reranker_model is not None:
            check_candidates(data, config.data.mine_hard_negatives)
        resume.check_data(data.stamps)  # a resume trains on the data its checkpoint was trained on
    costs = CostTexts.from_data(data, config.output.efficiency_texts, config.training.batch_size, config.training.seed)
    onnx = onnx_wanted(config.output.export_onnx, accelerator.device)  # `true` without the extra: one line, now
    with stage("teacher"):  # the teacher's own cost is measured while it is loaded: it is never loaded twice
        teacher = teacher_stage(accelerator, config, data, costs, student)
    with stage("student"):
        model, dims, bases = student_stage(accelerator, config, data, teacher)
        tokens = caches / TOKENS
        evaluation = eval_inputs(model.student, data, teacher.evaluation, bases["phase2"], tokens)
    output_dir = prepare_output_dir(accelerator, config)  # inputs are valid: from here on the run writes
    accelerator.init_trackers(config.output.tracker_project, config=tracker_config(config))
    state = resume.started(data.capped, teacher.reranker)
    with stage("evaluation before training"):
        evaluate_baseline(accelerator, config, model, state, evaluation, dims, teacher)
    trained_model = None  # the checkpoint saved as training ended
    for phase in phases:
        if resume.finished(phase.name):
            continue
        phase.use_student(dims, bases[phase.name])
        evaluations = None
        if evaluation is not None:
            keep = keep_best(config, output_dir, student)
            batch = 2 * config.training.batch_size
            evaluations = PhaseEvaluation(accelerator, evaluation, dims, phase.name, state, batch, keep)
        with stage(phase.name):
            checkpoint = resume.checkpoint_for(phase.name)
            last = phase is phases[-1]
            model, trained_model = train_stage(
                accelerator, config, model, phase, data, teacher, state, evaluations, checkpoint, at_end=last
            )
            record_phase(state, phase, teacher, model, evaluations, phase.samples(data), final=last)
    with stage("cost"):
        stop_if_signalled(accelerator, trained_model)
        efficiency = cost_stage(accelerator, config, model, teacher, costs)
        stop_if_signalled(accelerator, trained_model)
        forms = forms_stage(accelerator, config, model, data, costs, efficiency, state.results, onnx)
    with stage("export"):
        stop_if_signalled(accelerator, trained_model)
        results = export_stage(accelerator, config, model, state, teacher, efficiency, student, forms)
        path = write_results(accelerator, output_dir, results)
        forget_end_checkpoint(accelerator, config, trained_model)
    exported = (results.exported or {}).get("model")
    if config.output.push_to_hub and exported:  # after results.json: an upload never costs the results
        with stage("publish"):
            results.hub = main_decides(accelerator, lambda: publish(config, model, exported))
            write_results(accelerator, output_dir, results)
    return finish(accelerator, results, path)


def training_phases(config: Config, world: int) -> list[PhaseSettings]:
    """Each phase's settings from its sections of the config, in order (--skip_phase1 / --skip_phase2 leave one out).
    With phase 1's own target (phase1_teacher_model) the student is not in the teacher's space: phase 2 distils the
    teacher's similarities alone."""
    own_target = config.teacher.phase1_teacher_model is not None
    return [
        phase_settings(
            name,
            getattr(config, name),
            config.training,
            config.losses,
            config.performance,
            world,
            aligned=not (name == "phase2" and own_target),
            token_cache=Path(config.output.teacher_cache_dir).expanduser() / TOKENS,
        )
        for name in PHASE_ORDER
        if not getattr(config.training, f"skip_{name}")
    ]


def teacher_context(
    config: Config, device: torch.device | str, student: StudentDescription | None = None
) -> TeacherContext:
    """What the teacher takes from the rest of the run: the token limit, --max_seq_length or else the student's own
    as its kind reports it (`student`, described here if not given; a table reads every token: the teacher reads up
    to its own), the trust flag, the request size."""
    if student is None:
        student = student_kind(config.student.student_model).describe(config.student, config.teacher)
    return TeacherContext(
        device,
        student_tokens=config.student.max_seq_length or student.token_limit,
        trust_remote_code=config.student.trust_remote_code,
        batch_size=config.performance.teacher_batch_size,
        cache_dir=Path(config.output.teacher_cache_dir).expanduser(),
    )


def teacher_stage(
    accelerator: Accelerator,
    config: Config,
    data: DistillData,
    costs: CostTexts | None,
    student: StudentDescription,
) -> TeacherVectors:
    """The teacher stage, given its own sections: the teacher's, what it takes from the student, and its cache's."""
    context = teacher_context(config, accelerator.device, student)
    batch_size = config.performance.teacher_batch_size or config.training.batch_size
    cache = CacheSettings(config.output.teacher_cache_dir, batch_size, config.data.mine_hard_negatives)
    vectors = embed_with_teacher(accelerator, config.teacher, context, cache, data, costs)
    if config.reranker.reranker_model is not None and vectors.passage_rows is not None:
        scored = score_candidates(accelerator, config.reranker, context, cache, data, vectors.passage_rows)
        vectors.scores, vectors.reranker = scored.scores, scored.figures(config.losses.reranker_loss)
        vectors.seconds["phase2"] += scored.seconds
        vectors.loaded = vectors.loaded or scored.loaded
    return vectors


def student_stage(
    accelerator: Accelerator, config: Config, data: DistillData, teacher: TeacherVectors
) -> tuple[DistillationModel, list[int] | None, dict[str, np.ndarray | None]]:
    """The student stage, given its own sections: the student its kind loads, fitted to the teacher's vectors;
    its Matryoshka dims (None in projection mode), and the basis each phase reads its targets in."""
    context = LoadContext(
        device=accelerator.device,
        mixed_precision=accelerator.mixed_precision,
        teacher=config.teacher,
        cache_dir=Path(config.output.teacher_cache_dir),
        teacher_dtype=teacher_dtype(config.teacher.teacher_dtype, accelerator.device),
        share=machine_share(accelerator),
        wait=accelerator.wait_for_everyone,
        gradient_checkpointing=config.performance.gradient_checkpointing,
    )
    target = PHASE1_TEACHER if config.teacher.phase1_teacher_model else TEACHER
    fitting = Fitting(config.training.seed, 2 * config.training.batch_size, target)
    fit = (teacher.fit_dim, *teacher.fit_sample(data))
    model, dims, basis = build_student(accelerator, config.student, config.mode, context, fitting, *fit)
    return model, dims, phase_bases(accelerator, fitting, model, basis, teacher)


def keep_best(config: Config, output_dir: Path, student: StudentDescription) -> KeepBest | None:
    """--keep_best: each phase's best model to <output_dir>/best/<phase>, where there are evaluations to compare."""
    if not (config.checkpoint.keep_best and config.checkpoint.eval_steps > 0):
        return None
    return KeepBest(output_dir / "best", to_flat_dict(config), student)


def start(config: Config) -> tuple[Accelerator, Resume]:
    """The Accelerator, the seed, a usable output folder, and where the run starts: afresh or from a checkpoint."""
    continues = resume_requested(config)  # the trackers append to the run's logs, the output folder holds them
    accelerator = make_accelerator(config, continues)
    log_auto_precision(accelerator, config.performance.mixed_precision)
    set_seed(config.training.seed)
    check_output_dir(accelerator, config.output.output_dir, fresh=not continues)
    return accelerator, Resume.find(accelerator, config)


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
    teacher: TeacherVectors,
) -> None:
    """The results start (a resumed run's come from its checkpoint): the teacher (and a combined teacher's members)
    and the untrained student scored."""
    results = state.results  # checkpoints carry the evaluations made so far
    results.mode = results.mode or ("projection" if model.projection is not None else "matryoshka")
    results.world_size = accelerator.num_processes
    results.heap_allocator = heap_allocator()
    results.mixed_precision = accelerator.mixed_precision
    path = getattr(model.student, "attention_path", None)  # a transformer's; other kinds have no attention to choose
    results.attention = path.to_dict() if path is not None else None
    if accelerator.device.type == "cpu" and results.heap_allocator == "glibc":
        logger.warning(
            "heap allocator: glibc malloc, whose peak memory creeps up with the steps on a CPU; for a flat peak "
            "install libtcmalloc-minimal4 and launch through make or run_ddp.sh (see distill/allocator.py)",
            main_process_only=True,
        )
    if evaluation is not None and results.teacher is None:
        results.teacher = evaluate_teacher(evaluation)
        members = {name: score(vectors, evaluation.eval_set) for name, vectors in teacher.members.items()}
        results.teachers = members or None
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
    at_end: bool = False,
) -> tuple[DistillationModel, Path | None]:
    """One phase trained from its start, or from the checkpoint `resume`; the trained model, and with `at_end` the
    checkpoint of it saved as its training ended."""
    loader = phase.loader(model.student, data, teacher)
    checkpoints = CheckpointSettings(
        Path(config.output.output_dir).expanduser(),
        config.checkpoint.checkpoint_steps,
        config.checkpoint.checkpoints_total_limit,
        at_end,
    )
    periodic = evaluations.periodic if evaluations is not None else None
    try:
        model = train_phase(
            accelerator, model, phase, loader, state, checkpoints, resume, periodic, config.checkpoint.eval_steps
        )
    except torch.OutOfMemoryError as e:  # evaluation halves its batches itself: this is a training step
        message = training_memory_message(
            config.training, config.performance, phase.name, state, accelerator.mixed_precision, e
        )
        raise OutOfMemory(message) from None
    release_freed_memory()
    return model, checkpoints.saved_at_end


def stop_if_signalled(accelerator: Accelerator, trained_model: Path | None) -> None:
    """Between the stages after training: a SIGTERM or Ctrl-C noted since ends the run here, agreed by every process.
    The checkpoint saved as training ended holds all the later stages need, so a scheduler's grace period is never
    spent on them and its SIGKILL costs nothing."""
    stop = agreed_stop(accelerator)
    if stop is None:
        return
    name, code = stop
    PREEMPTION.clear()
    raise TrainingStopped(
        f"stopped by {name} after training; the trained student is in checkpoint {trained_model}; continue with "
        "--resume_from_checkpoint latest, which evaluates and exports it without training again",
        exit_code=code,
    )


def forget_end_checkpoint(accelerator: Accelerator, config: Config, trained_model: Path | None) -> None:
    """Once the export and results.json are in place, the checkpoint saved as training ended goes, unless the run
    keeps checkpoints (--checkpoint_steps): then it is the run's last, as the user asked."""
    if trained_model is None or config.checkpoint.checkpoint_steps:
        return

    def remove() -> None:
        shutil.rmtree(trained_model, ignore_errors=True)
        with contextlib.suppress(OSError):  # the folder goes too where nothing else is in it
            trained_model.parent.rmdir()

    on_main_process(accelerator, remove)


def negatives_of(teacher: TeacherVectors) -> dict[str, Any] | None:
    """Phase 2's hard negatives per query, as results.json and the card state them (None: in-batch ones alone)."""
    rows, mined = teacher.passage_rows, teacher.mined
    if rows is None or rows.shape[1] == 1:
        return None
    return {"per_query": int(rows.shape[1] - 1), "from": "mined by the teacher" if mined else "the data"}


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
        terms=phase.terms(),
        negatives=negatives_of(teacher) if phase.name == "phase2" else None,
    )
    if evaluations is not None:
        metrics = evaluations.final(model, state.optimizer_steps)
        before = results.after_phase1 if phase.name == "phase2" else results.student_before
        results.phases[phase.name].added = added(before, metrics)
        if final:
            results.student_after = metrics
        else:
            results.after_phase1 = metrics


ADDED = ("ndcg@10", "mrr@10", "sts_spearman")  # the figures whose change a phase's record states


def added(before: dict | None, after: dict) -> dict[str, float] | None:
    """What a phase changed of the evaluation's headline figures (after - before), where both have them."""
    if before is None:
        return None
    return {k: round(after[k] - before[k], 4) for k in ADDED if isinstance(before.get(k), float) and k in after}


def cost_stage(
    accelerator: Accelerator,
    config: Config,
    model: DistillationModel,
    teacher: TeacherVectors,
    costs: CostTexts | None,
) -> Efficiency | None:
    """What the deployable student costs beside the teacher, timed alike on this device (None: not measured)."""
    if costs is None:
        return None
    dtype = teacher_dtype(config.teacher.teacher_dtype, accelerator.device)  # both models in one dtype
    deployable = deployable_model(model)
    runtime = kind_of(deployable).runtime_cost  # a kind's own runtime as well: a table's through model2vec
    return measure_student(accelerator, deployable, teacher.cost, costs, dtype, teacher.cost_note, runtime)


def forms_stage(
    accelerator: Accelerator,
    config: Config,
    model: DistillationModel,
    data: DistillData,
    costs: CostTexts | None,
    efficiency: Efficiency | None,
    results: RunResults,
    onnx: bool,
) -> Path | None:
    """The student's served forms (ONNX float32 and int8, where its kind has them and the run exports), measured on
    the main process beside its cost; returns the folder of the forms for the export stage, or None."""
    if efficiency is None or costs is None:
        return None
    deployable = deployable_model(model)
    exported = config.output.save_to_artifacts or config.output.push_to_hub
    transformer = kind_of(deployable).onnx_transformer(deployable) if onnx and exported else None
    if transformer is None:  # not asked for, not exported, or a kind without an ONNX form (a static table)
        return None
    folder = staging_folder(config.output.artifacts_dir)
    pytorch = (efficiency.student.texts_per_second, (results.student_after or {}).get("ndcg@10"))

    def measured() -> list[dict]:
        return forms_to_dict(measure_forms(deployable, transformer, folder, costs, data.evaluation, pytorch))

    efficiency.forms = main_decides(accelerator, measured)
    return folder


def export_stage(
    accelerator: Accelerator,
    config: Config,
    model: DistillationModel,
    state: TrainingState,
    teacher: TeacherVectors,
    efficiency: Efficiency | None,
    student: StudentDescription,
    forms: Path | None = None,
) -> RunResults:
    """The run's results, complete, and the exported model folder(s) with their card (with --save_to_artifacts)."""
    results = state.results
    evaluated = results.teacher is not None
    if evaluated:  # the evaluation rows, once, at the run's last step
        accelerator.log(results.tracked_scalars(), step=state.global_step())
    results.teacher_loaded = teacher.loaded
    results.teacher_load_seconds = round(teacher.load_seconds, 3)
    results.teacher_seconds_evaluation = round(teacher.seconds["evaluation"], 3)
    results.efficiency = efficiency.to_dict() if efficiency is not None else None
    results.config = to_flat_dict(config)
    if config.output.save_to_artifacts or config.output.push_to_hub:
        figures = results.to_dict()
        table = results_table(figures) if evaluated else NO_EVALUATION
        card = "\n\n".join(filter(None, [table, trade_off_line(figures), cost_table(figures)]))
        folder = config.output.artifacts_dir
        exported = export_models(accelerator, model, folder, results.config, card, figures, student, forms)
        results.exported = exported
        if efficiency is not None:
            efficiency.exported_bytes = main_decides(accelerator, lambda: folder_bytes(exported["model"]))
            results.efficiency = efficiency.to_dict()
    on_main_process(accelerator, lambda: remove(forms))
    return results


def finish(accelerator: Accelerator, results: RunResults, path: Path) -> RunResults:
    """The run's table and trade-off line printed once; the process group torn down by every rank together."""
    figures = results.to_dict()
    table = results_table(figures) if results.teacher is not None else NO_EVALUATION
    trade_off = trade_off_line(figures)
    for name, folder in (results.exported or {}).items():
        logger.info(f"exported {name}: {folder}")
    accelerator.print(f"\n{table}\n" + (f"\n{trade_off}\n" if trade_off else "") + f"\nresults: {path}")
    accelerator.wait_for_everyone()  # not while rank 0 still writes
    accelerator.end_training()
    release_output_dir()  # another run may use the folder now
    return results


def publish(config: Config, model: DistillationModel, folder: str) -> dict[str, str]:
    """--push_to_hub: the exported model folder uploaded (main process); results.json's `hub` entry."""
    repo, private = config.output.push_to_hub, config.output.hub_private
    assert repo is not None
    return push_to_hub(deployable_model(model), folder, repo, private)
