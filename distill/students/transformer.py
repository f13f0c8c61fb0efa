"""A transformer student: a SentenceTransformer, optionally cut to N evenly spaced layers.

It loads in float32 on the CPU (Accelerate moves it), trains with no dropout on its attention probabilities (the
fused kernel), freezes what the sentence embedding never uses, and takes the faster attention its device allows
(distill/students/attention.py). `--student_num_layers` and `--gradient_checkpointing` are its own options.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.utils.checkpoint
from accelerate.logging import get_logger
from torch import nn

from distill.errors import DistillError
from distill.hub import (
    config_folder,
    declared_dimension,
    declared_max_seq_length,
    hub_snapshot,
    load_sentence_transformer,
    model_shape,
    resolve_model,
)
from distill.students.attention import choose_attention, use_fused_attention
from distill.students.kinds import LoadContext, StudentDescription, StudentFigures, StudentKind

if TYPE_CHECKING:
    from sentence_transformers import SentenceTransformer

    from distill.config.schema import StudentConfig, TeacherConfig
    from distill.tokens import TokenizedTexts

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


class TransformerKind(StudentKind):
    """Any SentenceTransformer built on a transformer: the kind every name falls back to."""

    name = "transformer"
    scope = "a transformer student"
    how = "pass a transformer's name to --student_model"
    options = ("student_num_layers", "gradient_checkpointing")

    def claims(self, name: str) -> bool:
        return True

    def holds(self, model: SentenceTransformer) -> bool:
        return True

    def describe(self, settings: StudentConfig, teacher: TeacherConfig) -> StudentDescription:
        layers = settings.student_num_layers
        return StudentDescription(
            base_model=settings.student_model,
            token_limit=settings.max_seq_length or own_token_limit(settings.student_model),
            done=f"cut to {layers} evenly spaced layers" if layers else "",
        )

    def declared_dim(self, settings: StudentConfig, teacher: TeacherConfig) -> int | None:
        return declared_dimension(resolve_model(settings.student_model))

    def figures(self, settings: StudentConfig, teacher: TeacherConfig) -> StudentFigures:
        folder = config_folder(settings.student_model, None)
        return StudentFigures(folder, model_shape(folder, settings.student_num_layers, settings.trust_remote_code))

    def load(self, settings: StudentConfig, context: LoadContext) -> SentenceTransformer:
        student = load_student(
            settings.student_model,
            settings.student_num_layers,
            settings.max_seq_length,
            settings.trust_remote_code,
            attention_dropout=TRAINING_ATTENTION_DROPOUT,
        )
        freeze_unused_parameters(student)
        path = choose_attention(student, context.device, context.mixed_precision)
        logger.info(f"student attention: {'unpadded' if path.unpadded else 'padded'} batches ({path.reason})")
        if context.gradient_checkpointing:
            enable_gradient_checkpointing(student)  # before Accelerate prepares (and perhaps compiles) the model
        return student

    def texts(self, model: SentenceTransformer) -> Callable[..., TokenizedTexts]:
        """Padded ids; a student switched to unpadded attention (distill/students/attention.py) takes its batch's
        texts end to end."""
        from distill.tokens import FlatTexts, TokenizedTexts

        offset = getattr(model, "position_offset", None)
        return TokenizedTexts if offset is None else partial(FlatTexts, position_offset=offset)

    def onnx_transformer(self, deployable: SentenceTransformer) -> Any | None:
        return deployable[0].auto_model  # the folder's Pooling, Dense and Normalize stay its modules


def own_token_limit(student_model: str) -> int | None:
    """The student's own token limit, read without loading it (`declared_max_seq_length`); None if unknown."""
    path = resolve_model(student_model)
    if not Path(path).is_dir():
        try:
            path = hub_snapshot(path, None, ("sentence_bert_config.json", "tokenizer_config.json", "config.json"))
        except DistillError:  # unknown (offline): the teacher reads up to its own limit
            return None
    return declared_max_seq_length(path)


TRANSFORMER = TransformerKind()
