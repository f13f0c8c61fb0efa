"""The student stage: a SentenceTransformer (optionally pruned to N layers), plus a projection in projection mode.

`build_student` loads it, freezes what the embedding never uses, and fits the projection (projection mode) or
the rotation and the teacher's PCA basis (Matryoshka mode with a basis) on a sample of the teacher's vectors.

`DistillationModel` is the one module Accelerate prepares (DDP wraps student and projection together):
it maps tokenized features to the student's own embedding and to the embedding the loss compares with
the teacher (projected to the teacher's dimension, or the student's own in Matryoshka mode).
"""

from __future__ import annotations

from collections import OrderedDict
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.utils.checkpoint
from accelerate import Accelerator
from accelerate.logging import get_logger
from accelerate.utils import send_to_device
from torch import nn

from distill.batching import TokenizedTexts, map_sharded
from distill.config import Config, ModelConfig
from distill.distributed import machine_share, main_decides, progress_bar
from distill.errors import DistillError
from distill.hub import declared_dimension, load_sentence_transformer, resolve_model
from distill.students import is_static, is_static_model, texts_for
from distill.students.attention import choose_attention, use_fused_attention
from distill.students.static import DEFAULT_DIM as STATIC_DIM
from distill.students.static import Distilling, load_static_student
from distill.teachers import check_teacher, local_model
from distill.teachers.local import teacher_dtype

if TYPE_CHECKING:
    from sentence_transformers import SentenceTransformer

    from distill.teacher import TeacherVectors

logger = get_logger(__name__)

LAYER_CONTAINERS = ("encoder.layer", "encoder.layers", "layers", "transformer.layer", "h", "block", "encoder.block")


# Where transformers configs keep the dropout on attention probabilities: BERT, RoBERTa, XLM-R, MPNet, ELECTRA,
# DeBERTa use the first; Llama, Qwen, Mistral, DistilBERT, ModernBERT the second.
ATTENTION_DROPOUT_FIELDS = ("attention_probs_dropout_prob", "attention_dropout")

# The student trains with no dropout on its attention probabilities: the fused attention kernel (see load_student).
TRAINING_ATTENTION_DROPOUT = 0.0


def load_student(
    name: str,
    num_layers: int | None = None,
    max_seq_length: int | None = None,
    trust_remote_code: bool = False,
    attention_dropout: float | None = None,
) -> SentenceTransformer:
    """Load the student on the CPU (Accelerate moves it), keeping `num_layers` evenly spaced layers.

    `attention_dropout` replaces the dropout on attention probabilities while the student trains (None keeps
    the model's own). At 0, PyTorch's scaled_dot_product_attention runs its fused kernel instead of
    materialising the (batch x heads x length x length) probabilities and their dropout mask: on the demo,
    15% less phase-2 time and about 300 MiB less per 32 x 128-token step on a CPU, at the same quality over
    three seeds (docs/QUALITY.md). The loaded config keeps the model's own value, and so does the exported one.
    """
    path = resolve_model(name)
    overrides = None if attention_dropout is None else dict.fromkeys(ATTENTION_DROPOUT_FIELDS, attention_dropout)
    # float32 whatever the checkpoint's dtype: the optimizer keeps float32 weights, mixed precision is autocast's
    student = load_sentence_transformer(
        path, "cpu", trust_remote_code=trust_remote_code, dtype=torch.float32, config_kwargs=overrides
    )
    if overrides:
        _restore_config_fields(student, overrides, trust_remote_code)
    if num_layers is not None:
        prune_layers(student, num_layers)
    if max_seq_length is not None:
        student.max_seq_length = max_seq_length
    use_fused_attention(student)  # MPNet: fused attention in place of transformers' eager one
    return student


def _restore_config_fields(student: SentenceTransformer, overrides: dict, trust_remote_code: bool) -> None:
    """Put the config fields that `overrides` set back to the checkpoint's values (absent ones removed).

    The modules were built with the overrides and keep them; only what the config records (and what the
    exported model's config.json says) goes back to the original.
    """
    from transformers import AutoConfig

    for module in student:
        backbone = getattr(module, "auto_model", None)
        if backbone is None:
            continue
        original = AutoConfig.from_pretrained(backbone.config._name_or_path, trust_remote_code=trust_remote_code)
        for field in overrides:
            if hasattr(original, field):
                setattr(backbone.config, field, getattr(original, field))
            elif hasattr(backbone.config, field):
                delattr(backbone.config, field)


def _layer_list(backbone: nn.Module) -> tuple[nn.Module, str, nn.ModuleList]:
    for dotted in LAYER_CONTAINERS:
        parent, *path = [backbone, *dotted.split(".")]
        owner = parent
        for attr in path[:-1]:
            owner = getattr(owner, attr, None)
            if owner is None:
                break
        layers = getattr(owner, path[-1], None) if owner is not None else None
        if isinstance(layers, nn.ModuleList):
            return owner, path[-1], layers
    raise DistillError(
        f"cannot find the encoder layers of a {type(backbone).__name__} to prune; "
        "drop --student_num_layers or use a BERT/MPNet/RoBERTa-style student"
    )


def evenly_spaced(total: int, keep: int) -> list[int]:
    """`keep` layer indices spread over `total`, always including the first and the last."""
    if keep == 1:
        return [total - 1]
    return sorted({int(round(i * (total - 1) / (keep - 1))) for i in range(keep)})


def prune_layers(student: SentenceTransformer, num_layers: int) -> list[int]:
    """Keep `num_layers` evenly spaced encoder layers of the student's transformer, in place."""
    backbone = student[0].auto_model
    owner, attr, layers = _layer_list(backbone)
    if num_layers > len(layers):
        raise DistillError(
            f"student_num_layers: the student has {len(layers)} layers, cannot keep {num_layers}; "
            f"pass a number from 1 to {len(layers)}"
        )
    kept = evenly_spaced(len(layers), num_layers)
    setattr(owner, attr, nn.ModuleList([layers[i] for i in kept]))
    backbone.config.num_hidden_layers = len(kept)
    layer_types = getattr(backbone.config, "layer_types", None)  # ModernBERT, Qwen, Gemma, Mistral: one per layer
    if isinstance(layer_types, (list, tuple)) and len(layer_types) == len(layers):
        backbone.config.layer_types = [layer_types[i] for i in kept]
    for new_index, layer in enumerate(getattr(owner, attr)):  # decoder layers keep their cache slot index
        attention = getattr(layer, "self_attn", None)
        if attention is not None and hasattr(attention, "layer_idx"):
            attention.layer_idx = new_index
    return kept


def enable_gradient_checkpointing(student: nn.Module) -> list[nn.Module]:
    """Recompute the student's layer activations in the backward pass; returns the modules it acts on.

    Each layer's activations are recomputed in the backward pass instead of kept: less memory for about a
    third more compute, same gradients. Non-reentrant checkpointing works under DDP and replays dropout
    with the RNG state of the forward pass. It acts only in training mode, so evaluation and the exported
    model (which keeps no such flag in its config) are unaffected. Backbones that Hugging Face can
    checkpoint use its own switch; others (MPNet, for one, in transformers 5) get each block of their
    repeated layers (a ModuleList of one class) wrapped in `torch.utils.checkpoint`.
    """
    backbones: list[nn.Module] = []
    blocks: list[nn.Module] = []
    covered: set[nn.Module] = set()  # inside a backbone or block already checkpointed: left alone
    for module in student.modules():  # outermost first
        if module in covered:
            continue
        if getattr(module, "supports_gradient_checkpointing", False):
            enable = getattr(module, "activation_checkpointing_enable", None)  # its name from transformers 5.x
            if enable is not None:
                enable(activation_checkpointing_kwargs={"use_reentrant": False})
            else:
                module.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            backbones.append(module)
        elif isinstance(module, nn.ModuleList) and _repeated(module):
            for block in module:
                _checkpoint_forward(block)
            blocks.extend(module)
        else:
            continue
        covered.update(module.modules())
    if not backbones and not blocks:
        found = ", ".join(type(m).__name__ for m in student.children()) or type(student).__name__
        raise DistillError(
            f"gradient_checkpointing: the student ({found}) has no repeated layers to checkpoint; drop "
            "--gradient_checkpointing or use a student built on a Hugging Face transformer"
        )
    return backbones + blocks


def _repeated(layers: nn.ModuleList) -> bool:
    """A stack of transformer layers: two or more blocks of one class that hold parameters."""
    kinds = {type(block) for block in layers}
    return len(layers) > 1 and len(kinds) == 1 and any(True for _ in layers[0].parameters())


def _checkpoint_forward(block: nn.Module) -> None:
    """Run `block` under non-reentrant checkpointing when training; its parameters and state_dict are unchanged."""
    forward = block.forward

    def checkpointed(*args: Any, **kwargs: Any) -> Any:
        if block.training and torch.is_grad_enabled():
            return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False, **kwargs)
        return forward(*args, **kwargs)

    block.forward = checkpointed


def embedding_dim(student: SentenceTransformer) -> int:
    getter = getattr(student, "get_embedding_dimension", None) or student.get_sentence_embedding_dimension
    dim = getter()
    if not dim:
        raise DistillError("the student does not report an embedding dimension; use a SentenceTransformer student")
    return int(dim)


class DistillationModel(nn.Module):
    """Student (+ projection), the one module Accelerate prepares.

    forward(*feature_sets) -> [(student_embedding, target_embedding)] per feature set: one DDP forward may
    encode queries and passages of different padded lengths. The target embedding is what the loss
    compares with the teacher: the projection's output in projection mode, the student's own otherwise.
    """

    def __init__(self, student: SentenceTransformer, projection: nn.Module | None = None) -> None:
        super().__init__()
        self.student = student
        self.projection = projection  # a sentence-transformers Dense, so export reuses it as it is
        self.student_dim = embedding_dim(student)

    def forward(self, *feature_sets: dict[str, torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        outputs = []
        for features in feature_sets:
            embedding = self.student(dict(features))["sentence_embedding"]  # (batch, student_dim)
            target = embedding
            if self.projection is not None:
                target = self.projection({"sentence_embedding": embedding})["sentence_embedding"]  # (batch, t_dim)
            outputs.append((embedding, target))
        return outputs


def dense_module() -> type[nn.Module]:
    try:
        from sentence_transformers.sentence_transformer.modules import Dense
    except ImportError:  # sentence-transformers < 6
        from sentence_transformers.models import Dense
    return Dense


def normalize_module() -> nn.Module:
    try:
        from sentence_transformers.sentence_transformer.modules import Normalize
    except ImportError:  # sentence-transformers < 6
        from sentence_transformers.models import Normalize
    return Normalize()


def linear_dense(weight: torch.Tensor, bias: torch.Tensor | None = None) -> nn.Module:
    """A sentence-transformers Dense computing `x @ weight (+ bias)`, no activation; weight is (in_dim, out_dim)."""
    extra = {} if bias is None else {"init_bias": bias.float().contiguous()}
    return dense_module()(
        weight.shape[0],
        weight.shape[1],
        bias=bias is not None,
        activation_function=nn.Identity(),
        init_weight=weight.T.float().contiguous(),
        **extra,
    )


def least_squares_projection(
    student_embeddings: torch.Tensor, teacher_embeddings: torch.Tensor, bias: bool = True
) -> nn.Module:
    """A linear Dense layer (with a bias, unless `bias` is False) fitted to send student vectors to teacher
    vectors, by ridge least squares.

    A projection initialised this way starts from the best linear fit rather than noise, so the first
    steps train the student instead of undoing a random map.
    """
    x = student_embeddings.double()
    y = teacher_embeddings.double()
    if bias:  # (n, s+1): the last column fits the bias
        x = torch.cat([x, torch.ones(len(x), 1, dtype=x.dtype)], dim=1)
    ridge = 1e-3 * torch.eye(x.shape[1], dtype=x.dtype) * (x.pow(2).sum() / len(x))
    solution = torch.linalg.solve(x.T @ x + ridge, x.T @ y)  # (s(+1), t)
    return linear_dense(solution[:-1], solution[-1]) if bias else linear_dense(solution)


def orthogonal_projection(student_embeddings: torch.Tensor, teacher_embeddings: torch.Tensor) -> nn.Module:
    """A bias-free Dense with orthonormal columns (student_dim -> teacher_dim) fitted by orthogonal Procrustes.

    Unlike the least-squares fit it keeps every cosine of the student's own space, so the projected student
    ranks exactly as the student does, while pointing into the teacher's space (for asymmetric search). It is
    scaled so the projected vectors are as long as the teacher's (root mean square): 1 for unit vectors on both
    sides, and for a student without a final Normalize the alignment loss is not spent on its norms.
    """
    if student_embeddings.shape[1] > teacher_embeddings.shape[1]:
        raise DistillError(
            f"an orthogonal projection cannot map {student_embeddings.shape[1]} dimensions into the teacher's "
            f"{teacher_embeddings.shape[1]}; fit a least-squares projection instead"
        )
    rotation = orthogonal_procrustes(student_embeddings, teacher_embeddings)
    scale = _rms_norm(teacher_embeddings) / _rms_norm(student_embeddings).clamp(min=1e-12)
    return linear_dense(rotation * scale.float())


def _rms_norm(vectors: torch.Tensor) -> torch.Tensor:
    return vectors.double().pow(2).sum(dim=1).mean().sqrt()


def pca_basis(vectors: np.ndarray, chunk_size: int = 8192) -> np.ndarray:
    """(dim, dim) orthonormal basis of `vectors`' rows, directions of largest second moment first.

    Uncentred (cosine similarity is about directions from the origin), accumulated over row chunks so a
    memory-mapped cache is never read whole; each column's sign is fixed (largest entry positive) so the
    basis is a deterministic function of the data.
    """
    dim = vectors.shape[1]
    moment = np.zeros((dim, dim), dtype=np.float64)
    for start in range(0, len(vectors), chunk_size):
        rows = np.asarray(vectors[start : start + chunk_size], dtype=np.float64)
        moment += rows.T @ rows
    _, eigenvectors = np.linalg.eigh(moment)  # ascending eigenvalues
    basis = eigenvectors[:, ::-1]
    signs = np.sign(basis[np.abs(basis).argmax(axis=0), np.arange(dim)])
    return (basis * signs).astype(np.float32)


def orthogonal_procrustes(source: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """W with orthonormal rows (source_dim x target_dim, source_dim <= target_dim) minimising |source W - target|.

    A rotation when both dimensions are equal.
    """
    u, _, vh = torch.linalg.svd(source.double().T @ target.double(), full_matrices=False)
    return (u @ vh).float()


def add_rotation(student: SentenceTransformer, rotation: torch.Tensor) -> None:
    """Append a fixed rotation (a bias-free sentence-transformers Dense, frozen) to the student's embedding.

    It goes after pooling and before a final Normalize, so the saved student applies it and loads as it is.
    A rotation changes no cosine: it only decides which coordinates come first when the vector is truncated.
    """
    dense = linear_dense(rotation)
    dense.requires_grad_(False)
    modules = list(student)
    normalize = type(normalize_module())
    at = len(modules) - 1 if modules and isinstance(modules[-1], normalize) else len(modules)
    student._modules = OrderedDict((str(i), m) for i, m in enumerate([*modules[:at], dense, *modules[at:]]))


def check_dimensions(student_dim: int, teacher_dim: int, use_projection: bool, teacher: str = "teacher") -> None:
    if not use_projection and teacher_dim < student_dim:
        raise DistillError(
            f"Matryoshka mode truncates the {teacher}'s {teacher_dim}-d embeddings to the student's {student_dim} "
            f"dimensions, but the {teacher} is narrower; pass --use_projection True, or a student of at most "
            f"{teacher_dim} dimensions"
        )


def matryoshka_dims(student_dim: int, requested: list[int] | None) -> list[int]:
    """The dimensions the MRL loss trains, largest first; defaults to dim, dim/2, dim/4."""
    dims = requested or [student_dim, student_dim // 2, student_dim // 4]
    too_big = [d for d in dims if d > student_dim]
    if too_big:
        raise DistillError(
            f"matryoshka_dims {too_big} exceed the student's {student_dim} dimensions; pass dims up to {student_dim}"
        )
    return sorted({d for d in dims if d > 0} | {student_dim}, reverse=True)


PROJECTION_FIT_SAMPLES = 4096

PCA_FIT_SAMPLES = 32768  # rows of the teacher's vectors its principal axes are computed from (a 3584-d teacher: ~1 min)


def load_student_kind(accelerator: Accelerator, config: Config) -> SentenceTransformer:
    """The student --student_model names: a static table (distilled by model2vec, each machine's processes
    sharing the vocabulary, kept for the next run), or a transformer cut to its layers."""
    model = config.model
    if is_static(model.student_model):
        cache_dir = Path(config.output.teacher_cache_dir)
        how = Distilling(
            device=str(accelerator.device),
            dtype=teacher_dtype(model.teacher_dtype, accelerator.device),
            tokenizer=model.student_tokenizer,
            share=machine_share(accelerator),
            wait=accelerator.wait_for_everyone,
        )
        return load_static_student(model.student_model, model.teacher_model, model.student_dim, cache_dir, how)
    student = load_student(
        model.student_model,
        model.student_num_layers,
        model.max_seq_length,
        model.trust_remote_code,
        attention_dropout=TRAINING_ATTENTION_DROPOUT,
    )
    freeze_unused_parameters(student)
    path = choose_attention(student, accelerator.device, accelerator.mixed_precision)
    logger.info(f"student attention: {'unpadded' if path.unpadded else 'padded'} batches ({path.reason})")
    if config.performance.gradient_checkpointing:
        enable_gradient_checkpointing(student)  # before Accelerate prepares (and perhaps compiles) the model
    return student


def build_student(
    accelerator: Accelerator,
    config: Config,
    teacher_dim: int,
    fit_texts: list[str],
    fit_targets: np.ndarray | None,
) -> tuple[DistillationModel, list[int] | None, np.ndarray | None]:
    """The student stage: the student; a fitted projection in projection mode, MRL dims (and basis) otherwise.

    Returns (model, Matryoshka dims or None, teacher basis or None). The basis (teacher_dim x student_dim,
    orthonormal columns) is what the teacher's vectors are multiplied by before truncation in MRL mode. The
    projection, rotation and basis are fitted on `fit_texts` and the teacher's vectors of them, `fit_targets`.
    """
    student = load_student_kind(accelerator, config)
    student.to(accelerator.device)
    student_dim = embedding_dim(student)
    target = "phase-1 teacher" if config.model.phase1_teacher_model else "teacher"
    check_dimensions(student_dim, teacher_dim, config.model.use_projection, target)
    texts, targets = fit_texts, fit_targets
    assert targets is not None, "a projection or basis needs the teacher's vectors of the fitting texts"
    sample = np.random.default_rng(config.training.seed).permutation(len(texts))[:PROJECTION_FIT_SAMPLES]
    sample.sort()
    tokens = texts_for(student)(student.tokenizer, [texts[i] for i in sample], student.max_seq_length)
    student_vectors, _ = encode_student(accelerator, DistillationModel(student), tokens, 2 * config.training.batch_size)
    sampled_targets = np.asarray(targets[sample], dtype=np.float32)
    if config.model.use_projection:
        # an orthonormal map keeps every cosine of the student (docs/QUALITY.md); a student wider than its teacher
        # has none, and gets the least-squares fit: without a bias for a table, whose export folds the projection
        # in after the table's own Normalize (distill/students/static.py)
        wide = partial(least_squares_projection, bias=not is_static_model(student))
        fit = orthogonal_projection if student_dim <= teacher_dim else wide
        projection = fit(torch.from_numpy(student_vectors), torch.from_numpy(sampled_targets))  # fitted on the CPU
        return DistillationModel(student, projection.to(accelerator.device)), None, None
    # MRL with a PCA basis: the teacher's coordinates ordered by variance, so its truncations keep the most;
    # the student gets the fixed rotation that best lines its own space up with that basis.
    basis = fit_basis(accelerator, targets, student_dim, config.training.seed)
    rotated = torch.nn.functional.normalize(torch.from_numpy(sampled_targets @ basis), dim=-1)
    add_rotation(student, orthogonal_procrustes(torch.from_numpy(student_vectors), rotated).to(accelerator.device))
    return DistillationModel(student), matryoshka_dims(student_dim, config.model.matryoshka_dims), basis


def fit_basis(accelerator: Accelerator, targets: np.ndarray, student_dim: int, seed: int) -> np.ndarray:
    """The first `student_dim` principal axes of a seeded sample of `targets` (dim x student_dim, orthonormal)."""
    rows = np.sort(np.random.default_rng(seed).permutation(len(targets))[:PCA_FIT_SAMPLES])
    return main_decides(accelerator, lambda: pca_basis(targets[rows])[:, :student_dim])


def phase_bases(
    accelerator: Accelerator,
    config: Config,
    model: DistillationModel,
    basis: np.ndarray | None,
    teacher: TeacherVectors,
) -> dict[str, np.ndarray | None]:
    """The teacher basis each phase (and the evaluation, as phase 2) reads its targets in.

    `basis` is the one `build_student` fitted on phase 1's targets. Where `phase1_teacher_model` gives phase 1
    another target than the teacher, the teacher gets its own basis, fitted on its phase-2 passages: phase 2
    compares similarities only, so the two spaces need not match.
    """
    if not config.model.phase1_teacher_model:
        return {"phase1": basis, "phase2": basis}
    student_dim = embedding_dim(model.student)
    check_dimensions(student_dim, teacher.dim, use_projection=False)
    own = None
    if basis is not None and teacher.passages is not None:
        own = fit_basis(accelerator, teacher.passages, student_dim, config.training.seed)
    return {"phase1": basis, "phase2": own}


def encode_student(
    accelerator: Accelerator, model: DistillationModel, texts: TokenizedTexts, batch_size: int
) -> tuple[np.ndarray, np.ndarray]:
    """(student-space, target-space) vectors of `texts`, computed sharded across processes."""
    model.eval()
    device = accelerator.device

    def encode(indices: list[int]) -> torch.Tensor:
        features = send_to_device(texts.features(indices), device)  # ints (FlatTexts' longest text) stay
        with torch.no_grad(), accelerator.autocast():
            student, target = model(features)[0]
        return torch.cat([student.float(), target.float()], dim=1)

    hint = f"lower --max_seq_length (the student reads up to {texts.max_length} tokens)"
    bar = progress_bar(accelerator, len(texts.lengths), "student: evaluation texts", unit="text", leave=False)
    with bar:
        both = map_sharded(accelerator, texts.lengths, batch_size, encode, too_long_hint=hint, progress=bar.update)
    assert both is not None  # no sink: the vectors come back
    return both[:, : model.student_dim], both[:, model.student_dim :]


def check_declared_dimensions(model_config: ModelConfig) -> None:
    """Matryoshka mode: teacher at least as wide as the student, --matryoshka_dims no wider, from the folders' configs.

    Checked before the teacher encodes (hours, for a large one), not after.
    """
    check_teacher(model_config)
    if model_config.use_projection:
        return
    teacher = local_model(model_config)  # an endpoint's or a file's width is known once it answers
    teacher_dim = declared_dimension(resolve_model(teacher, model_config.teacher_revision)) if teacher else None
    if is_static(model_config.student_model):
        folder = Path(model_config.student_model).expanduser().is_dir()  # its table's width is read when loaded
        student_dim = None if folder else model_config.student_dim or STATIC_DIM  # a distilled table is this wide
    else:
        student_dim = declared_dimension(resolve_model(model_config.student_model))
    if teacher_dim and student_dim:
        check_dimensions(student_dim, teacher_dim, use_projection=False)
    if student_dim:
        matryoshka_dims(student_dim, model_config.matryoshka_dims)


def freeze_unused_parameters(student: SentenceTransformer) -> None:
    """Freeze parameters the sentence embedding never uses (e.g. BERT's pooler): DDP fails on them otherwise."""
    features = student.preprocess(["a probe sentence", "another one"])
    features.pop("modality", None)
    student.train()
    student(features)["sentence_embedding"].sum().backward()
    for parameter in student.parameters():
        if parameter.grad is None:
            parameter.requires_grad_(False)
        parameter.grad = None
