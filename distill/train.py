"""Distill a teacher embedding model into a small SentenceTransformer student, in two phases.

    texts -> teacher embeddings (cached) -> phase 1 -> phase 2 -> evaluation -> exported SentenceTransformer

Stages of `run`:
1. data: phase-1 texts, phase-2 (query, passage) pairs, the held-out evaluation set    (data.py)
2. teacher: embeddings of every text, sharded over processes, cached by content        (teacher.py)
3. student: loaded, pruned, projection fitted by least squares in projection mode      (student.py)
4. baseline: teacher and untrained student evaluated                                   (evaluation.py)
5. phase 1: the student aligned with the teacher's embeddings on general text          (training.py, losses.py)
6. phase 2: the teacher's in-batch query/passage similarities distilled
7. export: SentenceTransformer folder(s) and results.json                              (export.py, report.py)

Run with `python -m distill.train [flags]` (one process), `accelerate launch -m distill.train [flags]`,
or with `--num_processes N` anywhere (distill relaunches itself through accelerate).
"""

from __future__ import annotations

import os
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from functools import partial
from pathlib import Path

import numpy as np
import torch
from accelerate import Accelerator, DataLoaderConfiguration, DistributedDataParallelKwargs, InitProcessGroupKwargs
from accelerate.logging import get_logger
from accelerate.utils import DDPCommunicationHookType, TorchDynamoPlugin, broadcast_object_list, set_seed

from distill.allocator import heap_allocator
from distill.batching import (
    PairVectors,
    Phase1Batches,
    Phase2Batches,
    TokenizedTexts,
    make_loader,
    topic_clusters,
)
from distill.checkpoint import PHASES, TrainingState, checkpoint_root, find_checkpoint, list_checkpoints, read_state
from distill.config import LEAVES, Config, dump_config, load_config, to_flat_dict
from distill.data import DistillData, Pairs, load_data
from distill.errors import DistillError, OutOfMemory, first_sentences, memory_message
from distill.evaluation import EvalInputs, EvalVectors, encode_student, evaluate_student, evaluate_teacher
from distill.export import export_models
from distill.hub import declared_dimension, resolve_model
from distill.launch import current_world_size, join_group_of_this_attempt, maybe_relaunch, stop_with_the_launcher
from distill.losses import LossWeights
from distill.report import ROWS, results_table, write_report, write_results
from distill.student import (
    DistillationModel,
    add_rotation,
    check_dimensions,
    embedding_dim,
    enable_gradient_checkpointing,
    least_squares_projection,
    load_student,
    matryoshka_dims,
    orthogonal_procrustes,
    orthogonal_projection,
    pca_basis,
)
from distill.teacher import TeacherCache, TeacherSpec, mine_hard_negatives
from distill.tracking import resolve_trackers
from distill.training import (
    CheckpointSettings,
    PhaseSettings,
    TrainingStopped,
    release_freed_memory,
    release_stop_signals,
    scaled_lr,
    train_phase,
)

logger = get_logger(__name__)

PROJECTION_FIT_SAMPLES = 4096
PCA_FIT_SAMPLES = 32768  # rows of the teacher's vectors its principal axes are computed from (a 3584-d teacher: ~1 min)


@dataclass
class TeacherVectors:
    """Cached teacher embeddings (memory-mapped) of everything the run uses."""

    phase1: np.ndarray | None
    queries: np.ndarray | None
    passages: np.ndarray | None  # positives, then every query's negatives
    passage_rows: np.ndarray | None  # (queries, 1 + negatives): row of each query's positive, then its negatives
    topics: np.ndarray | None  # phase 2 with --topic_cluster_size: each pair's cluster
    evaluation: EvalVectors | None
    seconds: dict[str, float]  # teacher time spent per phase (0 on a warm cache), loading included
    loaded: bool  # whether any teacher model was loaded at all
    load_seconds: float  # the part of `seconds` spent loading the teacher (0 when not loaded)

    @property
    def dim(self) -> int:
        for vectors in (self.phase1, self.queries, self.evaluation and self.evaluation.corpus):
            if vectors is not None:
                return int(vectors.shape[1])
        raise DistillError("nothing to distill: both phases are skipped and there is no evaluation set")


# The relative similarity loss's (scores x scores) matrices take about 50 bytes per entry, (batch**2)**2 entries
# (3 Matryoshka dims, forward and backward, measured on CPU: +117 MiB at 32, +823 MiB and 2.9 s a step at 64).
RESIM_MAX_GLOBAL_BATCH = 64


def make_accelerator(config: Config) -> Accelerator:
    """The Accelerator of this process: precision, accumulation, torch.compile and DDP's gradient compression."""
    t = config.training
    # without the flag, the precision `accelerate launch` passes on (its --mixed_precision or its config file)
    from_launcher = os.environ.get("ACCELERATE_MIXED_PRECISION", "no").lower()
    if (t.mixed_precision or from_launcher) == "fp16" and not torch.cuda.is_available():
        if t.mixed_precision:
            raise DistillError("mixed_precision fp16 needs a CUDA GPU; use bf16 or no on a CPU")
        # Accelerate would take it and train in float32 without a word
        raise DistillError(
            "mixed_precision fp16 (from accelerate launch: its --mixed_precision or the accelerate config) needs a "
            "CUDA GPU; pass --mixed_precision bf16 or no, or set mixed_precision to bf16 or no in the accelerate config"
        )
    world = current_world_size()
    global_batch = t.batch_size * world
    if t.resim_weight and global_batch > RESIM_MAX_GLOBAL_BATCH:
        # it compares every two of the global batch's (queries x passages) scores: (batch**2)**2 entries
        raise DistillError(
            f"resim_weight: the relative similarity loss compares every two of the {global_batch}x{global_batch} "
            f"query-passage scores of the global batch (batch_size x processes), about "
            f"{50 * global_batch**4 / 2**30:.1f} GiB a step; keep batch_size x processes <= {RESIM_MAX_GLOBAL_BATCH} "
            "or pass --resim_weight 0"
        )
    if world > 1 and not torch.cuda.is_available():
        # Launched as several processes on a machine without CUDA: without this, accelerate (1.x) makes each
        # process train alone; with it they form one gloo group (DistributedType.MULTI_CPU).
        os.environ["ACCELERATE_USE_CPU"] = "true"
        if t.ddp_comm_hook == "bf16":  # PyTorch refuses the bf16 hook without CUDA and NCCL >= 2.10
            raise DistillError(
                "ddp_comm_hook bf16 needs CUDA GPUs (NCCL); these processes run on CPUs over gloo, "
                "so drop --ddp_comm_hook or pass --ddp_comm_hook fp16"
            )
    timeout = timedelta(seconds=config.launch.ddp_timeout)
    join_group_of_this_attempt(timeout)  # only under torchelastic restarts; Accelerate forms the group otherwise
    handlers = [InitProcessGroupKwargs(timeout=timeout)]
    if t.ddp_comm_hook != "none":  # registered when Accelerate wraps the model in DDP; one process has no DDP
        handlers.append(DistributedDataParallelKwargs(comm_hook=DDPCommunicationHookType(t.ddp_comm_hook)))
    names = [n.strip() for n in config.output.log_with.split(",") if n.strip() and n.strip() != "none"]
    return Accelerator(
        log_with=resolve_trackers(names, config.output.output_dir, resume_requested(config)) or None,
        project_dir=config.output.output_dir,
        mixed_precision=t.mixed_precision,
        gradient_accumulation_steps=t.gradient_accumulation_steps,
        dataloader_config=DataLoaderConfiguration(split_batches=True),  # global batches, split over processes
        kwargs_handlers=handlers,
        # without --torch_compile, None: the dynamo settings of the accelerate config, if any
        dynamo_plugin=compile_plugin(t.torch_compile_backend) if t.torch_compile else None,
    )


def compile_plugin(backend: str) -> TorchDynamoPlugin:
    """torch.compile as Accelerate applies it in `prepare`: regional, with dynamic shapes.

    Regional compilation compiles the repeated transformer layer once and reuses the graph for the others,
    so compiling takes seconds rather than minutes. Shapes are dynamic because padded lengths change from
    batch to batch; left unset, `accelerate launch` passes its `--dynamo_use_dynamic` default (False), and
    every new length recompiles until dynamo's recompile limit (8) makes the rest run uncompiled.
    With mixed_precision no on CUDA, Accelerate also turns on TF32 matmuls whenever a backend is set.
    """
    return TorchDynamoPlugin(backend=backend, use_regional_compilation=True, dynamic=True)


def check_output_dir(accelerator: Accelerator, path: str, fresh: bool = False) -> Path:
    """Fail early if output_dir cannot be written, leaving nothing behind (folders made for the probe are removed).

    A `fresh` run (not resuming) also fails if output_dir holds an earlier run's checkpoints: its own would be
    ordered among them, pruned in their favour, and `latest` would pick the earlier run's.
    The main process probes and tells every process the verdict, so all of them stop, none waits alone.
    """
    output_dir = Path(path).expanduser()
    problem = [None]
    earlier = list_checkpoints(checkpoint_root(output_dir)) if fresh and accelerator.is_main_process else []
    if earlier:
        problem[0] = (
            f"output_dir {str(output_dir)!r} holds checkpoints of an earlier run ({earlier[-1].name}, ...); pass "
            "--resume_from_checkpoint latest to continue it, or a fresh --output_dir (or delete "
            f"{checkpoint_root(output_dir)})"
        )
    elif accelerator.is_main_process:
        missing = [p for p in [output_dir, *output_dir.parents] if not p.exists()]
        try:
            output_dir.mkdir(parents=True, exist_ok=True)
            probe = output_dir / f".write-test-{os.getpid()}"
            probe.write_text("ok")
            probe.unlink()
        except OSError as e:
            problem[0] = (
                f"output_dir {str(output_dir)!r} is not writable ({e.strerror or e}); pass a writable --output_dir"
            )
        finally:
            for folder in missing:  # deepest first
                if folder.is_dir() and not any(folder.iterdir()):
                    folder.rmdir()
    if accelerator.num_processes > 1:
        broadcast_object_list(problem)
    if problem[0]:
        raise DistillError(problem[0])
    return output_dir


def prepare_output_dir(accelerator: Accelerator, config: Config) -> Path:
    """Create output_dir with the resolved config.yaml, once the inputs have been validated."""
    output_dir = Path(config.output.output_dir).expanduser()
    if accelerator.is_main_process:
        output_dir.mkdir(parents=True, exist_ok=True)
        dump_config(config, output_dir / "config.yaml")
    accelerator.wait_for_everyone()
    return output_dir


def check_phase_sizes(config: Config, data: DistillData, phases: list[str], world: int) -> None:
    """Every phase needs at least one full global batch (batches are never partial)."""
    global_batch = config.training.batch_size * world
    sizes = {"phase1": len(data.phase1_texts), "phase2": len(data.phase2)}
    for phase in phases:
        if sizes[phase] < global_batch:
            raise DistillError(
                f"{phase} has {sizes[phase]} samples, fewer than one global batch of {global_batch} "
                f"({config.training.batch_size} per process x {world}); lower --batch_size or give more data"
            )


def passage_texts(pairs: Pairs) -> tuple[list[str], np.ndarray]:
    """Positives then all negatives, and for each query the rows of its positive and its negatives."""
    count, per_query = len(pairs), len(pairs.negatives[0]) if pairs.negatives else 0
    texts = pairs.passages + [n for negatives in pairs.negatives for n in negatives]
    rows = np.arange(count)[:, None]
    if per_query:
        rows = np.concatenate([rows, count + np.arange(count * per_query).reshape(count, per_query)], axis=1)
    return texts, rows


def embed_with_teacher(accelerator: Accelerator, config: Config, data: DistillData) -> TeacherVectors:
    """Stage 2: every text the run needs, through the teacher cache; the teacher is freed afterwards."""
    cache = TeacherCache(
        accelerator,
        TeacherSpec.from_config(config.model, accelerator.device),
        config.output.teacher_cache_dir,
        config.training.teacher_batch_size or config.training.batch_size,
    )
    seconds = {}
    phase1 = cache.embeddings(data.phase1_texts, "document") if data.phase1_texts else None
    seconds["phase1"] = cache.seconds
    queries = passages = rows = topics = None
    if len(data.phase2):
        texts, rows = passage_texts(data.phase2)
        queries = cache.embeddings(data.phase2.queries, "query")
        passages = cache.embeddings(texts, "document")
        if config.data.topic_cluster_size:  # a pair is its query plus its positive passage
            size, seed, positives = config.data.topic_cluster_size, config.training.seed, rows[:, 0]

            topics = main_process_array(
                accelerator, lambda: topic_clusters(PairVectors(queries, passages, positives), size, seed)
            )
    seconds["phase2"] = cache.seconds - seconds["phase1"]
    evaluation = None
    if data.evaluation is not None:
        e = data.evaluation
        evaluation = EvalVectors(
            np.asarray(cache.embeddings(e.queries, "query"), dtype=np.float32),
            np.asarray(cache.embeddings(e.corpus, "document"), dtype=np.float32),
            np.asarray(cache.embeddings(e.sts_texts, "document"), dtype=np.float32) if e.sts_texts else None,
        )
    seconds["evaluation"] = cache.seconds - seconds["phase1"] - seconds["phase2"]
    loaded = cache.loaded
    cache.release()
    release_freed_memory()  # the teacher's freed weights and activations go back to the OS
    if len(data.phase2) and config.data.mine_hard_negatives and rows.shape[1] == 1:  # the data brings none
        # after the teacher is gone: on a GPU the search needs the device memory the teacher held
        rows = np.concatenate([rows, mined_negatives(accelerator, config, texts, queries, passages)], axis=1)
    return TeacherVectors(phase1, queries, passages, rows, topics, evaluation, seconds, loaded, cache.load_seconds)


def mined_negatives(
    accelerator: Accelerator, config: Config, texts: list[str], queries: np.ndarray, passages: np.ndarray
) -> np.ndarray:
    """The teacher's hardest negatives for each pair, other pairs' passages (nothing more to encode).

    On the accelerator's device; a GPU that runs out of memory for the exhaustive search hands it to the CPU.
    """
    first_row: dict[str, int] = {}  # identical texts share an id: a copy of a positive is not its negative
    ids = np.array([first_row.setdefault(text, len(first_row)) for text in texts], dtype=np.int64)
    count = config.data.mine_hard_negatives
    try:
        return mine_hard_negatives(queries, passages, count, passage_ids=ids, device=accelerator.device)
    except torch.OutOfMemoryError:
        release_freed_memory()
        logger.warning(
            f"mine_hard_negatives: {len(passages):,} passages do not fit in {accelerator.device}'s free memory; "
            "searching on the CPU instead (slower)",
            main_process_only=False,  # each process mines on its own device, and may run out alone
        )
        return mine_hard_negatives(queries, passages, count, passage_ids=ids, device="cpu")


def build_student(
    accelerator: Accelerator, config: Config, data: DistillData, teacher: TeacherVectors
) -> tuple[DistillationModel, list[int] | None, np.ndarray | None]:
    """Stage 3: the student; a fitted projection in projection mode, MRL dims (and basis) otherwise.

    Returns (model, Matryoshka dims or None, teacher basis or None). The basis (teacher_dim x student_dim,
    orthonormal columns) is what the teacher's vectors are multiplied by before truncation in MRL mode.
    """
    student = load_student(
        config.model.student_model,
        config.model.student_num_layers,
        config.model.max_seq_length,
        config.model.trust_remote_code,
        config.model.student_attention_dropout,
    )
    freeze_unused_parameters(student)
    if config.training.gradient_checkpointing:
        enable_gradient_checkpointing(student)  # before Accelerate prepares (and perhaps compiles) the model
    student.to(accelerator.device)
    student_dim = embedding_dim(student)
    check_dimensions(student_dim, teacher.dim, config.model.use_projection)
    if not config.model.use_projection and config.model.matryoshka_basis == "none":
        return DistillationModel(student), matryoshka_dims(student_dim, config.model.matryoshka_dims), None
    if data.phase1_texts and teacher.phase1 is not None:
        texts, targets = data.phase1_texts, teacher.phase1
    else:
        texts, targets = data.phase2.passages, teacher.passages
    sample = np.random.default_rng(config.training.seed).permutation(len(texts))[:PROJECTION_FIT_SAMPLES]
    sample.sort()
    tokens = TokenizedTexts(student.tokenizer, [texts[i] for i in sample], student.max_seq_length)
    student_vectors, _ = encode_student(accelerator, DistillationModel(student), tokens, 2 * config.training.batch_size)
    sampled_targets = np.asarray(targets[sample], dtype=np.float32)
    if config.model.use_projection:
        init = config.model.projection_init
        if init == "auto":
            init = "orthogonal" if student_dim <= teacher.dim else "least_squares"
        fit = orthogonal_projection if init == "orthogonal" else least_squares_projection
        projection = fit(torch.from_numpy(student_vectors), torch.from_numpy(sampled_targets))  # fitted on the CPU
        return DistillationModel(student, projection.to(accelerator.device)), None, None
    # MRL with a PCA basis: the teacher's coordinates ordered by variance, so its truncations keep the most;
    # the student gets the fixed rotation that best lines its own space up with that basis.
    pca_rows = np.sort(np.random.default_rng(config.training.seed).permutation(len(targets))[:PCA_FIT_SAMPLES])
    basis = main_process_array(accelerator, lambda: pca_basis(targets[pca_rows])[:, :student_dim])
    rotated = torch.nn.functional.normalize(torch.from_numpy(sampled_targets @ basis), dim=-1)
    add_rotation(student, orthogonal_procrustes(torch.from_numpy(student_vectors), rotated).to(accelerator.device))
    return DistillationModel(student), matryoshka_dims(student_dim, config.model.matryoshka_dims), basis


def main_process_array(accelerator: Accelerator, compute: Callable[[], np.ndarray]) -> np.ndarray:
    """`compute()` on the main process, the same array on every process (linear algebra may differ by machine)."""
    value = [compute() if accelerator.is_main_process else None]
    broadcast_object_list(value)
    return value[0]


def check_declared_dimensions(model_config) -> None:  # noqa: ANN001 - ModelConfig
    """Matryoshka mode: teacher at least as wide as the student, --matryoshka_dims no wider, from the folders' configs.

    Checked before the teacher encodes (hours, for a large one), not after.
    """
    if model_config.use_projection:
        return
    teacher_dim = declared_dimension(resolve_model(model_config.teacher_model, model_config.teacher_revision))
    student_dim = declared_dimension(resolve_model(model_config.student_model))
    if teacher_dim and student_dim:
        check_dimensions(student_dim, teacher_dim, use_projection=False)
    if student_dim:
        matryoshka_dims(student_dim, model_config.matryoshka_dims)


def freeze_unused_parameters(student) -> None:  # noqa: ANN001
    """Freeze parameters the sentence embedding never uses (e.g. BERT's pooler): DDP fails on them otherwise."""
    features = student.preprocess(["a probe sentence", "another one"])
    features.pop("modality", None)
    student.train()
    student(features)["sentence_embedding"].sum().backward()
    for parameter in student.parameters():
        if parameter.grad is None:
            parameter.requires_grad_(False)
        parameter.grad = None


def phase_loader(config: Config, student, data: DistillData, teacher: TeacherVectors, phase: str, world: int):  # noqa: ANN001, ANN201
    """Tokenize the phase's texts once and build its length-grouped loader of global batches."""
    tokenizer, max_length = student.tokenizer, student.max_seq_length
    global_batch = config.training.batch_size * world
    tokenize = partial(
        TokenizedTexts, tokenizer, max_length=max_length, pad_to_multiple_of=config.training.pad_to_multiple_of
    )
    if phase == "phase1":
        texts = tokenize(data.phase1_texts)
        collate, lengths = Phase1Batches(texts, teacher.phase1), texts.lengths
        truncated = texts.truncated
    else:
        passages, rows = passage_texts(data.phase2)[0], teacher.passage_rows
        queries, passage_tokens = tokenize(data.phase2.queries), tokenize(passages)
        chunks = config.training.forward_chunks
        collate = Phase2Batches(queries, passage_tokens, rows, teacher.queries, teacher.passages, chunks)
        lengths = queries.lengths + passage_tokens.lengths[rows].sum(axis=1)
        truncated = queries.truncated + passage_tokens.truncated
    if truncated:
        logger.warning(
            f"{phase}: {truncated} texts are longer than {max_length} tokens and were truncated", main_process_only=True
        )
    topics = teacher.topics if phase == "phase2" else None
    return make_loader(lengths, global_batch, config.training.seed, collate, topics)


def phase_settings(
    config: Config, phase: str, world: int, dims: list[int] | None, basis: np.ndarray | None = None
) -> PhaseSettings:
    phase_config = getattr(config, phase)
    t = config.training
    return PhaseSettings(
        name=phase,
        epochs=phase_config.epochs,
        lr=scaled_lr(phase_config.lr, t.lr_scaling, world),
        warmup_ratio=t.warmup_ratio,
        weight_decay=t.weight_decay,
        max_grad_norm=t.max_grad_norm,
        weights=LossWeights(
            t.cosine_weight,
            t.mse_weight,
            t.kl_weight,
            t.temperature,
            matryoshka_full_teacher_similarity=t.matryoshka_full_teacher_similarity,
            phase1_kl=t.phase1_kl_weight,
            resim=t.resim_weight,
            resim_margin=t.resim_margin,
        ),
        matryoshka_dims=dims,
        projection_lr_scale=t.projection_lr_scale,
        backbone_frozen_steps=t.projection_warmup_steps if phase == "phase1" and config.model.use_projection else 0,
        teacher_basis=None if basis is None else torch.from_numpy(basis),
        kl_memory_steps=t.kl_memory_steps,
        ema_decay=t.ema_decay,
    )


def eval_inputs(  # noqa: ANN201
    student,  # noqa: ANN001
    data: DistillData,
    teacher: TeacherVectors,
    basis: np.ndarray | None = None,
) -> EvalInputs | None:
    if data.evaluation is None or teacher.evaluation is None:
        return None
    e, tok, length = data.evaluation, student.tokenizer, student.max_seq_length
    return EvalInputs(
        e,
        TokenizedTexts(tok, e.queries, length),
        TokenizedTexts(tok, e.corpus, length),
        TokenizedTexts(tok, e.sts_texts, length) if e.sts_texts else None,
        teacher.evaluation,
        basis,
    )


def tracker_config(config: Config) -> dict:
    """The flat config with values every tracker accepts (TensorBoard's hparams take no None or lists).

    Without resume_from_checkpoint: how a segment of the run was started, not a setting of the experiment, so a
    resumed run logs the config it started with (and the JSON-lines tracker does not write it again).
    """
    flat = to_flat_dict(config)
    flat.pop("resume_from_checkpoint", None)
    return {k: v if isinstance(v, (int, float, str, bool)) else str(v) for k, v in flat.items()}


# What a resumed run may change: how fast, where and how precisely it computes, not what it trains on or how.
RESUME_MAY_CHANGE = {
    "teacher_batch_size",
    "mixed_precision",
    "pad_to_multiple_of",
    "forward_chunks",
    "gradient_checkpointing",
    "torch_compile",
    "torch_compile_backend",
    "ddp_comm_hook",
    "skip_phase1",
    "skip_phase2",
}
RESUME_SECTIONS = ("model", "data", "phase1", "phase2", "training")


def run_identity(config: Config, world: int) -> dict:
    """What a checkpoint must share with the run that resumes it.

    Every setting of the model, data and training that decides what is trained on and how: the data order
    is a function of (seed, epoch, global batch), a resumed epoch skips the batches already done, and the
    schedule is laid out from the epochs and batch counts, so a change in any of them would silently train
    on other samples or bend the schedule. The per-process batch counts as the global batch, so an
    elastic restart on another number of processes resumes when the global batch is the same.
    """
    identity = {
        leaf.flag: getattr(getattr(config, leaf.section), leaf.name)
        for leaf in LEAVES
        if leaf.section in RESUME_SECTIONS and leaf.flag not in RESUME_MAY_CHANGE and leaf.flag != "batch_size"
    }
    identity["global_batch_size"] = config.training.batch_size * world
    return identity


def resume_requested(config: Config) -> bool:
    """Whether this run continues an earlier one: by the flag, or as an elastic restart of the group."""
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    return config.checkpoint.resume_from_checkpoint is not None or restarted


def resume_point(accelerator: Accelerator, config: Config) -> Path | None:
    """The checkpoint to continue from: the flag's, or the latest one after an elastic restart.

    Found by the main process and sent to the others, so every rank resumes from the same one (`latest` could
    change under a rank's feet, or differ between machines' views of a shared folder).
    """
    spec = config.checkpoint.resume_from_checkpoint
    if spec is None and resume_requested(config):
        spec = "latest"  # torchrun restarted the group after a failure: pick up where it stopped
    if not spec:
        return None
    found: list = [None]  # (checkpoint folder or None, error message or None)
    if accelerator.is_main_process:
        try:
            path = find_checkpoint(config.output.output_dir, spec)
            found[0] = (None if path is None else str(path), None)
        except DistillError as e:
            found[0] = (None, str(e))
    if accelerator.num_processes > 1:
        broadcast_object_list(found)
    path, problem = found[0]
    if problem:
        raise DistillError(problem)
    return None if path is None else Path(path)


def training_memory_message(
    config: Config, phase: str, state: TrainingState, precision: str, error: BaseException
) -> str:
    """What to change when a training step does not fit on the device (every epoch starts with its widest batch)."""
    t = config.training
    fixes = [
        f"lower --batch_size (now {t.batch_size} per process) and raise --gradient_accumulation_steps "
        f"(now {t.gradient_accumulation_steps}) to keep the samples per optimizer step"
    ]
    if not t.gradient_checkpointing:
        fixes.append("pass --gradient_checkpointing True")
    if precision == "no":
        fixes.append("use --mixed_precision bf16")
    return (
        f"{phase}: the student ran out of device memory at optimizer step {state.optimizer_steps + 1} "
        f"({memory_message(error)}); {', or '.join(fixes)}"
    )


PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")  # gloo's words


def lost_a_peer(error: BaseException) -> str | None:
    """The first sentence of a collective's error when another process of the job died under it, else None.

    gloo raises a plain RuntimeError ("[.../pair.cc:553] Connection closed by peer [10.0.0.2]:29500. This is
    typically caused by a remote worker crashing ..."); NCCL and the store raise torch.distributed.DistError.
    """
    if current_world_size() < 2 or not isinstance(error, (RuntimeError, torch.distributed.DistError)):
        return None
    text = str(error).splitlines()[0] if str(error) else type(error).__name__
    if not isinstance(error, torch.distributed.DistError) and not any(words in text for words in PEER_GONE):
        return None
    return first_sentences(re.sub(r"^\[[^\]]*\]\s*", "", text), 1, 200)  # without gloo's [source file:line]


class PhaseEvaluation:
    """A phase's evaluations, on every process: every --eval_steps optimizer steps (`periodic`, logged) and at its
    end (`final`); with --keep_best, the best of them is exported to <output_dir>/best/<phase>.

    The end-of-phase model is the one the last periodic evaluation scored when the phase ends on an evaluation
    step (the weight average, when there is one, is what both score), so that evaluation is not made twice.
    """

    def __init__(
        self,
        accelerator: Accelerator,
        config: Config,
        evaluation: EvalInputs,
        dims: list[int] | None,
        phase: str,
        state: TrainingState,
        output_dir: Path,
    ):
        self.accelerator, self.config, self.evaluation, self.dims = accelerator, config, evaluation, dims
        self.phase, self.state, self.output_dir = phase, state, output_dir
        self.history = state.results.setdefault("evaluations", {}).setdefault(phase, [])
        self.best = max((h["ndcg@10"] for h in self.history), default=float("-inf"))
        self.last: tuple[int, dict] | None = None  # (optimizer step, metrics) of the last periodic evaluation
        self.keep_best = config.checkpoint.keep_best and config.checkpoint.eval_steps > 0

    def periodic(self, model: DistillationModel, step: int) -> None:
        metrics = self._evaluate(model)
        scalars = {k: v for k, v in metrics.items() if isinstance(v, float)}
        self.history.append({"step": step, **scalars})
        self.accelerator.log({f"{self.phase}/eval/{k}": v for k, v in scalars.items()}, step=self.state.global_step())
        self.last = (step, metrics)
        self._keep_if_best(model, metrics, f"best of {self.phase} at optimizer step {step}: {scalars}")

    def final(self, model: DistillationModel, step: int) -> dict:
        """The metrics of the model the phase ends with, at its last optimizer step `step`."""
        if self.last is not None and self.last[0] == step:
            return self.last[1]  # scored (and compared) by the periodic evaluation of that step
        metrics = self._evaluate(model)
        scalars = {k: v for k, v in metrics.items() if isinstance(v, float)}
        self._keep_if_best(model, metrics, f"best of {self.phase}: its end, optimizer step {step}: {scalars}")
        return metrics

    def _evaluate(self, model: DistillationModel) -> dict:
        batch_size = 2 * self.config.training.batch_size
        return evaluate_student(self.accelerator, model, self.evaluation, batch_size, self.dims)

    def _keep_if_best(self, model: DistillationModel, metrics: dict, description: str) -> None:
        if self.keep_best and metrics["ndcg@10"] > self.best:
            self.best = metrics["ndcg@10"]
            export_models(
                self.accelerator, model, self.output_dir / "best" / self.phase, to_flat_dict(self.config), description
            )


def tracked_results(results: dict) -> dict[str, float]:
    """The run's evaluation rows as flat tracker scalars: `student_after/ndcg@10`, `teacher/matryoshka_ndcg@10/8`."""
    scalars = {}
    for row in ROWS:
        for name, value in results.get(row, {}).items():
            if isinstance(value, dict):
                scalars |= {f"{row}/{name}/{k}": v for k, v in value.items() if isinstance(v, (int, float))}
            elif isinstance(value, (int, float)):
                scalars[f"{row}/{name}"] = value
    return scalars


def run(config: Config) -> dict:
    """The whole pipeline on this process (one of the launched ones). Returns the results dict."""
    accelerator = make_accelerator(config)
    set_seed(config.training.seed)
    check_output_dir(accelerator, config.output.output_dir, fresh=not resume_requested(config))
    world = accelerator.num_processes
    phases = [p for p in PHASES if not getattr(config.training, f"skip_{p}")]
    resume = resume_point(accelerator, config)
    identity = run_identity(config, world)
    state = read_state(resume, identity) if resume else TrainingState(identity=identity)
    if resume:
        logger.warning(
            f"resuming from {resume} ({state.phase}, optimizer step {state.optimizer_steps})", main_process_only=True
        )

    check_declared_dimensions(config.model)  # before any encoding: a wrong pairing fails in seconds
    data = load_data(config.data, config.training.seed, "phase1" in phases, "phase2" in phases)
    check_phase_sizes(config, data, phases, world)
    teacher = embed_with_teacher(accelerator, config, data)
    model, dims, basis = build_student(accelerator, config, data, teacher)
    evaluation = eval_inputs(model.student, data, teacher, basis)
    output_dir = prepare_output_dir(accelerator, config)  # inputs are valid: from here on the run writes
    accelerator.init_trackers("distill", config=tracker_config(config))
    eval_batch = 2 * config.training.batch_size
    checkpoints = CheckpointSettings(
        output_dir, config.checkpoint.checkpoint_steps, config.checkpoint.checkpoints_total_limit
    )

    results: dict = state.results or {"mode": "projection" if model.projection is not None else "matryoshka"}
    state.results = results  # checkpoints carry the evaluations made so far
    results["world_size"] = world
    results["heap_allocator"] = heap_allocator()
    if accelerator.device.type == "cpu" and results["heap_allocator"] == "glibc":
        logger.warning(  # shown: nothing sets up logging, so an info line would never be seen
            "heap allocator: glibc malloc, whose peak memory creeps up with the steps on a CPU; for a flat peak "
            "install libtcmalloc-minimal4 and launch through make or run_ddp.sh (see distill/allocator.py)",
            main_process_only=True,
        )
    if evaluation is not None and "teacher" not in results:
        results["teacher"] = evaluate_teacher(evaluation)
        results["student_before"] = evaluate_student(accelerator, model, evaluation, eval_batch, dims)
    results.setdefault("phases", {})
    for phase in phases:
        if resume is not None and PHASES.index(phase) < PHASES.index(state.phase):
            continue  # finished before the checkpoint; its figures are in the checkpoint's results
        loader = phase_loader(config, model.student, data, teacher, phase, world)
        settings = phase_settings(config, phase, world, dims, basis)
        evaluations = None
        if evaluation is not None:
            evaluations = PhaseEvaluation(accelerator, config, evaluation, dims, phase, state, output_dir)
        try:
            model = train_phase(
                accelerator,
                model,
                loader,
                settings,
                state,
                checkpoints,
                resume if resume is not None and phase == state.phase else None,
                evaluations.periodic if evaluations is not None else None,
                config.checkpoint.eval_steps,
            )
        except torch.OutOfMemoryError as e:  # evaluation halves its batches itself: this is a training step
            message = training_memory_message(config, phase, state, accelerator.mixed_precision, e)
            raise OutOfMemory(message) from None
        resume = None
        release_freed_memory()
        results["phases"][phase] = {
            "teacher_seconds": round(teacher.seconds[phase], 3),
            "train_seconds": round(state.train_seconds, 3),
            "train_samples": state.train_samples,
            "optimizer_steps": state.optimizer_steps,
            "samples_per_second": round(state.train_samples / max(state.train_seconds, 1e-9), 2),
            "final_loss": state.losses[-1] if state.losses else None,
            "losses": list(state.losses),
        }
        if evaluations is not None:
            key = "after_phase1" if phase == "phase1" and len(phases) == 2 else "student_after"
            results[key] = evaluations.final(model, state.optimizer_steps)
    if evaluation is not None:  # the evaluation rows, once, at the run's last step
        accelerator.log(tracked_results(results), step=state.global_step())
    results["teacher_loaded"] = teacher.loaded
    results["teacher_load_seconds"] = round(teacher.load_seconds, 3)
    results["teacher_seconds_evaluation"] = round(teacher.seconds["evaluation"], 3)
    table = results_table(results) if evaluation is not None else "(no evaluation set)"
    if config.output.save_to_artifacts:
        results["exported"] = export_models(
            accelerator, model, config.output.artifacts_dir, to_flat_dict(config), table
        )
    results["config"] = to_flat_dict(config)
    path = write_results(accelerator, output_dir, results)
    if accelerator.is_main_process:
        try:
            write_report(output_dir, results)  # leaf writer: report.png and report.md
        except Exception as e:  # the model and results.json are written: an unwritable report must not fail the run
            logger.warning(f"report not written ({type(e).__name__}: {e}); results.json holds every figure")
    accelerator.print(f"\n{table}\n\nresults: {path}")
    accelerator.wait_for_everyone()  # the group is torn down by all ranks together, not while rank 0 still writes
    accelerator.end_training()
    return results


def _quiet_libraries() -> None:
    import transformers

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    if os.environ.get("RANK", "0") != "0":
        os.environ.setdefault("TQDM_DISABLE", "1")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        config = load_config(argv)
        code = maybe_relaunch(config.launch.num_processes, argv, config.launch.accelerate_config)
        if code is not None:
            return code
        stop_with_the_launcher()
        _quiet_libraries()
        started = time.perf_counter()
        run(config)
        logger.info(f"done in {time.perf_counter() - started:.1f}s", main_process_only=True)
        return 0
    except TrainingStopped as e:
        if os.environ.get("RANK", "0") == "0":
            print(f"distill: {e}", file=sys.stderr)
        return e.exit_code
    except (RuntimeError, torch.distributed.DistError) as e:
        lost = lost_a_peer(e)
        if lost is None:
            raise
        if os.environ.get("RANK", "0") == "0":  # the process that died said why; one line for all who waited on it
            print(
                f"\nerror: [rank 0] stopped: another process of this job failed ({lost}); its own error line "
                "(or traceback) above, or in its machine's log, says why",
                file=sys.stderr,
            )
        return 1
    except DistillError as e:
        rank = os.environ.get("RANK", "0")
        if rank == "0":  # one line from one process, not one per rank
            print(f"error: {e}", file=sys.stderr)
        elif e.every_rank:  # its own problem; on a line of its own, not after rank 0's progress bar
            print(f"\nerror: {e}", file=sys.stderr)
        return 2
    finally:
        release_stop_signals()  # training is over: Ctrl-C interrupts at once again


if __name__ == "__main__":
    sys.exit(main())
