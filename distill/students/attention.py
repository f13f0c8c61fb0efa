"""Fused attention for transformer students whose transformers class brings none: MPNet.

transformers 5 runs MPNet's attention eagerly (it declares no SDPA, FlashAttention or flex support): scores,
softmax and dropout as separate kernels per layer, over a relative position bias it expands to (batch, heads,
length, length) on every forward. `use_fused_attention` gives a loaded MPNet the same attention through
PyTorch's `scaled_dot_product_attention`, with the bias and the padding mask added once per forward and
passed in as the attention mask, so a GPU runs a fused kernel instead (the efficient-attention kernel, which
also takes the bias's gradient). It patches the instance's forward methods only: the weights, the config and
the exported folder are MPNet's own, and a plain `SentenceTransformer(path)` loads them as ever.

Equal to the eager forward and backward within float32 rounding (tests/test_students.py).
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any

import torch
from torch import nn


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
    mask = position_bias if attention_mask is None else _added(position_bias, attention_mask)
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


def _added(bias: torch.Tensor | None, mask: torch.Tensor) -> torch.Tensor:
    return mask if bias is None else bias + mask
