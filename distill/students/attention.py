"""Faster attention for transformer students: fused attention for MPNet, unpadded batches for the others.

transformers 5 runs MPNet's attention eagerly (it declares no SDPA, FlashAttention or flex support): scores,
softmax and dropout as separate kernels per layer, over a relative position bias it expands to (batch, heads,
length, length) on every forward. `use_fused_attention` gives a loaded MPNet the same attention through
PyTorch's `scaled_dot_product_attention`, with the bias and the padding mask added once per forward and
passed in as the attention mask, so a GPU runs a fused kernel instead (the efficient-attention kernel, which
also takes the bias's gradient). It patches the instance's forward methods only: the weights, the config and
the exported folder are MPNet's own, and a plain `SentenceTransformer(path)` loads them as ever.

Equal to the eager forward and backward within float32 rounding (tests/test_attention.py).

`use_unpadded_batches` trains a student whose transformers class takes its attention from transformers'
attention interface (BERT, RoBERTa, XLM-R, ModernBERT...) on unpadded batches: the batch's texts end to end
as one sequence, each attending to itself only (`FlatTexts`, sentence-transformers' pooling of such
"flattened" outputs). No layer then spends work on padding. On a CUDA GPU the attention is PyTorch's own
variable-length FlashAttention (`torch.nn.attention.varlen.varlen_attn`); elsewhere each text's attention
runs on its own, which serves the tests. `choose_attention` switches a run's student only where that kernel is
known to run (a CUDA GPU of compute capability 8.0+, bf16 or fp16 autocast, torch 2.9+, no windowed layers)
and says why not otherwise. Padded batches (evaluation, `encode`) take transformers' SDPA path as
ever. sentence-transformers unpads only for models loaded with the flash-attn package, and only in `encode`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn

UNPADDED = "distill_unpadded"  # the name of the attention function and mask function registered with transformers


def use_fused_attention(model: nn.Module) -> int:
    """Switch every MPNet encoder in `model` to fused attention, in place; the number of encoders switched."""
    from transformers.models.mpnet.modeling_mpnet import MPNetEncoder, MPNetSelfAttention

    switched = 0
    for module in model.modules():
        if isinstance(module, MPNetEncoder) and not getattr(module, "fused_attention", False):
            module.forward = partial(_encoder_forward, module)
            for block in module.modules():
                if isinstance(block, MPNetSelfAttention):
                    block.forward = partial(_attention_forward, block)
            module.fused_attention = True
            switched += 1
    return switched


def _encoder_forward(
    encoder: nn.Module,
    hidden_states: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    output_attentions: bool = False,
    output_hidden_states: bool = False,
    return_dict: bool = False,
    **kwargs: Any,
) -> Any:
    """MPNetEncoder.forward with the position bias made once, unexpanded, and the padding mask folded into it."""
    from transformers.modeling_outputs import BaseModelOutput

    if output_attentions:
        raise ValueError("fused attention computes no attention probabilities; load the model afresh to get them")
    bias = _position_bias(encoder, hidden_states.shape[1], hidden_states.device)  # (1, heads, length, length)
    if attention_mask is not None:  # additive, (batch, 1, length, length) or broadcastable to it
        bias = bias + attention_mask
    states = [hidden_states]
    for layer in encoder.layer:
        hidden_states = layer(hidden_states, None, bias, **kwargs)[0]
        states.append(hidden_states)
    all_states = tuple(states) if output_hidden_states else None
    if not return_dict:
        return tuple(v for v in (hidden_states, all_states) if v is not None)
    return BaseModelOutput(last_hidden_state=hidden_states, hidden_states=all_states)


def _position_bias(encoder: nn.Module, length: int, device: torch.device) -> torch.Tensor:
    """MPNet's relative position bias for one text of `length` tokens, (1, heads, length, length): every text of
    a batch shares it, so it is not copied per text as `compute_position_bias` does."""
    positions = torch.arange(length, dtype=torch.long, device=device)
    buckets = encoder.relative_position_bucket(positions[None, :] - positions[:, None], num_buckets=32)
    return encoder.relative_attention_bias(buckets).permute(2, 0, 1).unsqueeze(0)


def _attention_forward(
    attention: nn.Module,
    hidden_states: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    position_bias: torch.Tensor | None = None,
    output_attentions: bool = False,
    **kwargs: Any,
) -> tuple[torch.Tensor]:
    """MPNetSelfAttention.forward through scaled_dot_product_attention; `position_bias` holds the padding mask too."""
    shape = (*hidden_states.shape[:-1], -1, attention.attention_head_size)
    q, k, v = (getattr(attention, name)(hidden_states).view(shape).transpose(1, 2) for name in "qkv")
    mask = position_bias  # `_encoder_forward` folds the padding mask into it and passes no attention_mask
    if attention_mask is not None:
        mask = attention_mask if mask is None else mask + attention_mask
    if mask is not None and mask.dtype != q.dtype:  # mixed precision: the kernel takes a mask of its inputs' dtype
        mask = mask.to(q.dtype)
    context = nn.functional.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=mask,
        dropout_p=attention.dropout.p if attention.training else 0.0,
        scale=1.0 / math.sqrt(attention.attention_head_size),
    )
    context = context.transpose(1, 2).reshape(*hidden_states.shape[:-1], attention.all_head_size)
    return (attention.o(context),)


@dataclass(frozen=True)
class AttentionPath:
    """How the student's attention runs in training: unpadded (FlashAttention's variable-length kernel) or padded
    (transformers' SDPA), and why. results.json keeps it as `attention`."""

    unpadded: bool
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return {"unpadded": self.unpadded, "reason": self.reason}


MIN_CAPABILITY = (8, 0)  # FlashAttention's kernels: Ampere and later
HALF_PRECISIONS = ("bf16", "fp16")  # FlashAttention computes in these only


def attention_path(
    backbone: nn.Module | None,
    device_type: str,
    mixed_precision: str,
    capability: tuple[int, int] | None,
    has_varlen: bool,
) -> AttentionPath:
    """Whether a student trains on unpadded batches: only where every condition of the variable-length kernel
    holds. `backbone` is the student's transformers model (None for a student without one), `mixed_precision`
    Accelerate's ("no", "bf16", "fp16"), `capability` the CUDA device's compute capability, `has_varlen` whether
    the installed torch has `torch.nn.attention.varlen.varlen_attn` with a `scale` argument (`has_varlen`)."""
    config = getattr(backbone, "config", None)
    if backbone is None or config is None or getattr(config, "is_decoder", False):
        return AttentionPath(False, "the student is no transformer encoder")
    if not getattr(backbone, "_supports_attention_backend", False):  # MPNet, among others: no attention interface
        return AttentionPath(False, f"{type(backbone).__name__} takes no attention function from transformers")
    if _windowed(config):  # ModernBERT's local layers: the kernel would attend globally where they attend locally
        return AttentionPath(False, "the student has layers with windowed (local) attention")
    if device_type != "cuda":
        return AttentionPath(False, f"the variable-length kernel runs on CUDA GPUs, not on {device_type}")
    if mixed_precision not in HALF_PRECISIONS:
        return AttentionPath(False, "the variable-length kernel takes bf16 or fp16; pass --mixed_precision bf16")
    if capability is None or tuple(capability) < MIN_CAPABILITY:
        shown = "unknown" if capability is None else ".".join(map(str, capability))
        return AttentionPath(False, f"the variable-length kernel needs compute capability 8.0+, this GPU has {shown}")
    if not has_varlen:
        return AttentionPath(
            False, f"torch {torch.__version__} has no torch.nn.attention.varlen.varlen_attn taking scale"
        )
    return AttentionPath(True, "unpadded batches through FlashAttention's variable-length kernel")


def _windowed(config: Any) -> bool:
    layer_types = getattr(config, "layer_types", None) or ()
    return any(kind != "full_attention" for kind in layer_types) or getattr(config, "sliding_window", None) is not None


def has_varlen() -> bool:
    """Whether the installed torch has PyTorch's variable-length attention as `_unpadded_attention` calls it: the
    module first appears in torch 2.9, whose `varlen_attn` takes no `scale` yet."""
    import inspect

    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return False
    return "scale" in inspect.signature(varlen_attn).parameters


def choose_attention(student: nn.Module, device: torch.device, mixed_precision: str) -> AttentionPath:
    """Decide the student's attention for training on `device` under `mixed_precision`, switch it to unpadded
    batches where that is known to run, and keep the decision on the student (`student.attention_path`)."""
    backbone = getattr(next(iter(student), None), "auto_model", None)
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    path = attention_path(backbone, device.type, mixed_precision, capability, has_varlen())
    if path.unpadded:
        use_unpadded_batches(student)
    student.attention_path = path
    return path


def use_unpadded_batches(student: nn.Module) -> bool:
    """Switch `student` to unpadded batches when its first module is a transformer that supports them; whether it
    does. Its forward then takes `FlatTexts` features as well as padded ones. `choose_attention` decides whether
    a run should; this is the switch itself (the tests use it on a CPU, where each text's attention runs alone)."""
    module = next(iter(student), None)
    backbone = getattr(module, "auto_model", None)
    config = getattr(backbone, "config", None)
    if backbone is None or config is None or config.is_decoder:
        return False
    if not getattr(backbone, "_supports_attention_backend", False):  # MPNet, among others: no attention interface
        return False
    _register()
    backbone.set_attn_implementation(UNPADDED)
    student.position_offset = _position_offset(backbone)  # what FlatTexts adds to each text's positions
    return True


def _position_offset(backbone: nn.Module) -> int:
    """RoBERTa-family embeddings count positions from padding_idx + 1; BERT's from 0 (as sentence-transformers'
    `_infer_flatten_position_offset`)."""
    for module in backbone.modules():
        padding_idx = getattr(module, "padding_idx", None)
        if isinstance(padding_idx, int) and isinstance(getattr(module, "position_embeddings", None), nn.Embedding):
            return padding_idx + 1
    return 0


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface, sdpa_mask

    if UNPADDED not in ALL_MASK_ATTENTION_FUNCTIONS:
        AttentionInterface.register(UNPADDED, _unpadded_attention)
        AttentionMaskInterface.register(UNPADDED, partial(_mask, sdpa_mask))


def _mask(sdpa_mask: Any, attention_mask: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor | None:
    """No mask for an unpadded batch (each text's extent is in its `cu_seq_lens_q`); SDPA's for a padded one."""
    return None if attention_mask is None else sdpa_mask(attention_mask=attention_mask, **kwargs)


def _unpadded_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    max_length_q: int | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention within each text of an unpadded batch: query, key, value (1, heads, tokens, head_dim)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if cu_seq_lens_q is None:  # a padded batch
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)[0], None
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # (tokens, heads, head_dim)
    if q.is_cuda and dropout == 0.0 and q.dtype in (torch.float16, torch.bfloat16):  # FlashAttention's only dtypes
        from torch.nn.attention.varlen import varlen_attn

        out = varlen_attn(q, k, v, cu_seq_lens_q, cu_seq_lens_q, max_length_q, max_length_q, scale=scaling)
    else:
        bounds = cu_seq_lens_q.tolist()
        parts = [
            nn.functional.scaled_dot_product_attention(
                *(t[a:b].transpose(0, 1) for t in (q, k, v)), dropout_p=dropout, scale=scaling
            ).transpose(0, 1)
            for a, b in zip(bounds[:-1], bounds[1:])
        ]
        out = torch.cat(parts)
    return out.unsqueeze(0), None  # (1, tokens, heads, head_dim), as transformers' attention functions return
