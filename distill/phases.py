"""The two phases as objects: each owns its batches, its loss and the state it carries between steps.

- `AlignmentPhase` (phase 1): general texts; the student's vectors are pulled onto the teacher's (cosine + MSE).
- `SimilarityPhase` (phase 2): (query, passage) pairs; the teacher's in-batch query-passage similarities are
  distilled (KL over softmaxed scores, `--kl_weight`), with a cross-batch passage memory and alignment of both
  sides (none where `--phase1_teacher_model` gives phase 1 another target than the teacher: the student is then
  in that model's space, not the teacher's); the pairs' own labels rank each query's passage first among the
  global batch's (`--mnrl_weight`), leaving out those the teacher ranks as high.

The loop (distill/loop.py) calls `phase.loss` on each batch and `phase.step_taken` after each optimizer step; it
never asks which phase it runs. Both losses see the GLOBAL batch: embeddings are gathered from every process
(keeping the gradient of the local ones) and the similarity loss is scaled by the world size, so N processes x
batch B follow the same trajectory as 1 process x batch N*B.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.logging import get_logger
from torch.utils.data import DataLoader

from distill.batching import Phase1Batches, Phase2Batches, TokenBudgetBatchSampler, make_loader
from distill.config.schema import LossConfig, PerformanceConfig, PhaseConfig, TrainingConfig
from distill.data.containers import DistillData, passage_texts
from distill.errors import DistillError
from distill.losses import LossWeights, alignment_loss, label_loss, reranker_loss, similarity_kl_loss
from distill.students import kind_of
from distill.tokens import TokenizedTexts, assemble_chunks, cached_tokens

if TYPE_CHECKING:
    from sentence_transformers import SentenceTransformer

    from distill.stages.targets import TeacherVectors

logger = get_logger(__name__)


@dataclass(frozen=True)
class Batching:
    """How a phase batches its texts: per-process batches of `batch_size` (phase 1: of `max_tokens_per_batch` padded
    tokens, where given), seeded, padded to a multiple of `pad_to_multiple_of`; phase 2 forwards its queries and its
    passages in up to `forward_chunks` chunks of similar length."""

    batch_size: int
    seed: int
    pad_to_multiple_of: int = 1
    forward_chunks: int = 1
    max_tokens_per_batch: int | None = None
    token_cache: Path | None = None  # where each machine keeps its tokenized texts (distill/tokens.py); None: none


@dataclass
class PhaseSettings:
    """The optimisation settings of one phase (learning rate already scaled for the number of processes)."""

    name: str  # "phase1" or "phase2": checkpoint names, tracker keys, results
    epochs: int
    lr: float
    warmup_ratio: float
    weight_decay: float
    max_grad_norm: float
    weights: LossWeights
    matryoshka_dims: list[int] | None  # None in projection mode
    teacher_basis: torch.Tensor | None = None  # MRL: (teacher_dim, student_dim), applied before truncation
    kl_memory_steps: int = 0  # phase 2: earlier optimizer steps whose passages join the similarity KL
    batching: Batching = Batching(batch_size=64, seed=42)


def scaled_lr(lr: float, scaling: str, num_processes: int) -> float:
    """Learning rate for a global batch num_processes times the per-process one."""
    if scaling == "linear":
        return lr * num_processes
    if scaling == "sqrt":
        return lr * math.sqrt(num_processes)
    return lr


def phase_settings(
    name: str,
    phase_config: PhaseConfig,
    t: TrainingConfig,
    losses: LossConfig,
    performance: PerformanceConfig,
    world: int,
    aligned: bool = True,
    token_cache: Path | None = None,
) -> PhaseSettings:
    """`name`'s settings from its sections of the config, for `world` processes; the student's dims and basis come
    with `Phase.use_student`. `aligned`: the student is in the teacher's space, so the alignment losses apply (not
    so for phase 2 where phase 1 has its own target, `phase1_teacher_model`: it distils similarities alone)."""
    batching = Batching(
        t.batch_size,
        t.seed,
        performance.pad_to_multiple_of,
        performance.forward_chunks,
        t.max_tokens_per_batch,
        token_cache,
    )
    return PhaseSettings(
        name=name,
        epochs=phase_config.epochs,
        lr=scaled_lr(phase_config.lr, t.lr_scaling, world),
        warmup_ratio=t.warmup_ratio,
        weight_decay=t.weight_decay,
        max_grad_norm=t.max_grad_norm,
        weights=LossWeights(
            losses.cosine_weight if aligned else 0.0,
            losses.mse_weight if aligned else 0.0,
            losses.kl_weight,
            losses.temperature,
            matryoshka_full_teacher_similarity=losses.matryoshka_full_teacher_similarity,
            reranker=losses.reranker_weight,
            reranker_loss=losses.reranker_loss,
            reranker_temperature=losses.reranker_temperature,
            label=losses.mnrl_weight,
            label_margin=losses.mnrl_margin,
        ),
        matryoshka_dims=None,
        kl_memory_steps=losses.kl_memory_steps,
        batching=batching,
    )


def gather_with_grad(accelerator: Accelerator, local: torch.Tensor) -> torch.Tensor:
    """All processes' rows (in rank order); only this process's rows carry a gradient."""
    if accelerator.num_processes == 1:
        return local
    chunks = list(accelerator.gather(local.detach().contiguous()).split(local.shape[0]))
    chunks[accelerator.process_index] = local
    return torch.cat(chunks)


def by_candidate(passages: torch.Tensor, world: int, per_rank: int) -> torch.Tensor:
    """Gathered phase-2 passages reordered for the label loss: every query's positive (in the gathered queries'
    order), then every query's first negative, then its second, and so on.

    Gathered, they come rank by rank, each rank's positives first, then its queries' negatives query by query
    (`Phase2Batches`): (world x per_rank x ways, dim) either way."""
    dim = passages.shape[-1]
    by_rank = passages.reshape(world, -1, dim)  # (world, per_rank x ways, dim)
    ways = by_rank.shape[1] // per_rank
    positives = by_rank[:, :per_rank].reshape(-1, dim)  # (world x per_rank, dim)
    negatives = by_rank[:, per_rank:].reshape(world, per_rank, ways - 1, dim).permute(2, 0, 1, 3)
    return torch.cat([positives, negatives.reshape(-1, dim)])


class Phase:
    """One phase of distillation: its settings, its loader of global batches and its loss."""

    name: str

    def __init__(self, settings: PhaseSettings, world: int):
        self.settings, self.world = settings, world
        self.batching = settings.batching

    def use_student(self, dims: list[int] | None, basis: np.ndarray | None) -> None:
        """The student's Matryoshka dims and the teacher basis it is trained in (see `build_student`)."""
        teacher_basis = None if basis is None else torch.from_numpy(basis)
        self.settings = replace(self.settings, matryoshka_dims=dims, teacher_basis=teacher_basis)

    def samples(self, data: DistillData) -> int:
        """How many samples (texts or pairs) one epoch of this phase draws from."""
        raise NotImplementedError

    def loader(self, student: SentenceTransformer, data: DistillData, teacher: TeacherVectors) -> DataLoader:
        """Tokenize the phase's texts once and build its length-grouped loader of global batches."""
        raise NotImplementedError

    def loss(self, accelerator: Accelerator, model: torch.nn.Module, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """(loss to backpropagate, loss to report) for one batch."""
        raise NotImplementedError

    def rows(self, batch: dict) -> int:
        """The samples of this process in `batch`."""
        raise NotImplementedError

    def terms(self) -> dict[str, float]:
        """The loss terms this phase trains with (those of weight above 0), by name, with their weights."""
        weights = self.settings.weights
        return {name: w for name, w in (("cosine", weights.cosine), ("mse", weights.mse)) if w}

    def to_device(self, device: torch.device) -> None:
        """Move what the loss uses on every batch to the training device, once."""
        if self.settings.teacher_basis is not None:
            self.settings = replace(self.settings, teacher_basis=self.settings.teacher_basis.to(device))

    def step_taken(self) -> None:
        """The optimizer step was taken (called once per step, after every micro-batch of its window)."""

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Tensors the phase carries between steps, the same on every rank (saved in checkpoints)."""
        return {}

    def load_state_dict(self, tensors: dict[str, torch.Tensor], device: torch.device) -> None:
        """Restore what `state_dict` returned."""

    def _teacher_in_basis(self, batch: dict) -> dict:
        """The teacher's vectors in the basis the student is trained in (MRL with a PCA basis); else `batch`."""
        basis = self.settings.teacher_basis
        if basis is None:
            return batch
        return {k: v @ basis if k.startswith("teacher") else v for k, v in batch.items()}

    def _tokenizer(self, student: SentenceTransformer) -> Callable[[Sequence[str]], TokenizedTexts]:
        """Texts tokenized as the student's kind batches them, once per machine (`cached_tokens`)."""
        return partial(
            cached_tokens,
            kind_of(student).texts(student),
            student.tokenizer,
            folder=self.batching.token_cache,
            max_length=student.max_seq_length,
            pad_to_multiple_of=self.batching.pad_to_multiple_of,
        )

    def _warn_truncated(self, truncated: int, max_length: int) -> None:
        if truncated:
            logger.warning(
                f"{self.name}: {truncated} texts are longer than {max_length} tokens and were truncated",
                main_process_only=True,
            )


class AlignmentPhase(Phase):
    """Phase 1: the student's vectors of general texts aligned with the teacher's."""

    name = "phase1"

    def samples(self, data: DistillData) -> int:
        return len(data.phase1_texts)

    def loader(self, student: SentenceTransformer, data: DistillData, teacher: TeacherVectors) -> DataLoader:
        texts = self._tokenizer(student)(data.phase1_texts)
        self._warn_truncated(texts.truncated, student.max_seq_length)
        batching = self.batching
        budget = None
        if batching.max_tokens_per_batch:
            widths = texts.padded_widths(texts.lengths)
            budget = TokenBudgetBatchSampler(widths, batching.max_tokens_per_batch, self.world, batching.seed)
        collate = Phase1Batches(texts, teacher.phase1)
        return make_loader(texts.lengths, batching.batch_size * self.world, batching.seed, collate, budget)

    def rows(self, batch: dict) -> int:
        return len(batch["teacher"])

    def loss(self, accelerator: Accelerator, model: torch.nn.Module, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        dims, weights = self.settings.matryoshka_dims, self.settings.weights
        batch = self._teacher_in_basis(batch)
        ((_, target),) = model(batch["texts"])
        loss = alignment_loss(target, batch["teacher"], weights, dims)
        return loss, loss.detach()


class SimilarityPhase(Phase):
    """Phase 2: the teacher's in-batch query-passage similarities distilled, with a cross-batch passage memory; and,
    where a reranker scored each query's candidates, its scores (`reranker_loss`)."""

    name = "phase2"

    def __init__(self, settings: PhaseSettings, world: int):
        super().__init__(settings, world)
        self.memory = PassageMemory(self.settings.kl_memory_steps)
        self.reranker = 0.0  # the reranker's weight, once its scores are in the batches

    def samples(self, data: DistillData) -> int:
        return len(data.phase2)

    def loader(self, student: SentenceTransformer, data: DistillData, teacher: TeacherVectors) -> DataLoader:
        tokenize = self._tokenizer(student)
        passages, rows = passage_texts(data.phase2)[0], teacher.passage_rows
        queries, passage_tokens = tokenize(data.phase2.queries), tokenize(passages)
        chunks = self.batching.forward_chunks
        collate = Phase2Batches(
            queries, passage_tokens, rows, teacher.queries, teacher.passages, chunks, teacher.scores
        )
        self.reranker = self.settings.weights.reranker if teacher.scores is not None else 0.0
        lengths = queries.lengths + passage_tokens.lengths[rows].sum(axis=1)
        self._warn_truncated(queries.truncated + passage_tokens.truncated, student.max_seq_length)
        global_batch = self.batching.batch_size * self.world
        return make_loader(lengths, global_batch, self.batching.seed, collate)

    def rows(self, batch: dict) -> int:
        return len(batch["teacher_queries"])

    def loss(self, accelerator: Accelerator, model: torch.nn.Module, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        dims, weights = self.settings.matryoshka_dims, self.settings.weights
        batch = self._teacher_in_basis(batch)
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
        candidate_passages, candidate_teacher = self.memory.extend(student_passages, teacher_passages)
        similarity = similarity_kl_loss(
            student_queries, candidate_passages, teacher_queries, candidate_teacher, weights, dims
        )
        self.memory.stage(student_passages, teacher_passages)
        # The reranker's loss is a mean over this process's queries (each ranks its own candidates): DDP's average
        # of the ranks' gradients is the gradient of the global mean, as for the alignment.
        ranking = alignment.new_zeros(())
        if "reranker_scores" in batch:
            ranking = reranker_loss(queries, passages, batch["reranker_scores"], weights, dims)
        labels = alignment.new_zeros(())
        if weights.label:
            world, per_rank = accelerator.num_processes, len(queries)
            labels = label_loss(
                student_queries,
                by_candidate(student_passages, world, per_rank),
                teacher_queries,
                by_candidate(teacher_passages, world, per_rank),
                weights,
                dims,
            )
        # DDP averages gradients over ranks; the global similarity and label losses are computed on every rank and
        # each rank's gradient covers only its own rows, so scaling by the world size makes the average the sum.
        loss = alignment + ranking + accelerator.num_processes * (similarity + labels)
        return loss, (alignment + ranking + similarity + labels).detach()

    def terms(self) -> dict[str, float]:
        weights = self.settings.weights
        return super().terms() | {
            name: w
            for name, w in (("similarity_kl", weights.kl), ("mnrl", weights.label), ("reranker", self.reranker))
            if w
        }

    def step_taken(self) -> None:
        self.memory.commit()

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {f"memory.{k}": v for k, v in self.memory.state_dict().items()}

    def load_state_dict(self, tensors: dict[str, torch.Tensor], device: torch.device) -> None:
        memory = {k.removeprefix("memory."): v for k, v in tensors.items() if k.startswith("memory.")}
        self.memory.load_state_dict(memory, device)


PHASES: dict[str, type[Phase]] = {"phase1": AlignmentPhase, "phase2": SimilarityPhase}


def make_phases(settings: list[PhaseSettings], world: int) -> list[Phase]:
    """The phases these settings name, in order."""
    return [PHASES[phase.name](phase, world) for phase in settings]


def check_phase_sizes(phases: list[Phase], data: DistillData, batch_size: int, world: int) -> None:
    """Every phase needs at least one full global batch (batches are never partial)."""
    global_batch = batch_size * world
    for phase in phases:
        if phase.samples(data) < global_batch:
            raise DistillError(
                f"{phase.name} has {phase.samples(data)} samples, fewer than one global batch of {global_batch} "
                f"({batch_size} per process x {world}); lower --batch_size or give more data"
            )


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
            students, teachers = zip(*self.staged)
            self.entries.append((torch.cat(students), torch.cat(teachers)))
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
