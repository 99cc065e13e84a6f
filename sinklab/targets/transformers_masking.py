"""Interventions on a transformers causal LM (`sinklab eval intervene`: `sinklab.evals.interventions` says what each
is), through transformers' own extension points.

- A dropped key (mask_first, mask_random): an attention function registered with transformers' `AttentionInterface`
  (and the eager mask with `AttentionMaskInterface`) under the name `sinklab_masked`, which adds -inf where the mask
  function drops a key to the additive mask the model built for the layer (its causal mask, or its sliding window on
  a sliding layer) and then calls the family's own eager attention (`eager_attention_forward` of its modeling
  module: logit soft-capping, learned sink logits and the like stay as they are). The model is switched to it only
  inside `masked_attention` and back to eager after.
- Activations set (zero, mean): a forward hook on the decoder layer that rewrites its output hidden states.
`sinklab.targets.transformers_lm.TransformersTarget` opens them as `masked` and `set_output`.
"""
from __future__ import annotations

import contextlib
import sys
from typing import Iterator

import torch
from torch import nn

from sinklab.errors import UserError

MASKED = "sinklab_masked"
_current: dict = {}  # the mask function of the open `masked_attention`, read by the registered attention


def masked_eager(module: nn.Module, query, key, value, attention_mask, **kwargs):
    """The family's eager attention with the keys the open mask function drops masked out."""
    eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if eager is None:
        raise UserError(f"{type(module).__name__}: no eager_attention_forward in its modeling module; masking a key "
                        "is not supported for this architecture")
    mask_fn = _current.get("mask")
    if mask_fn is not None:
        T_q, T_k = query.shape[-2], key.shape[-2]
        q_idx = torch.arange(T_k - T_q, T_k, device=query.device)[:, None]  # (T_q, 1) positions of the queries
        kv_idx = torch.arange(T_k, device=query.device)[None, :]  # (1, T_k)
        keep = mask_fn(None, None, q_idx, kv_idx) & (kv_idx <= q_idx)  # (T_q, T_k), causal
        low = torch.finfo(query.dtype).min
        base = attention_mask[..., :T_k] if attention_mask is not None else \
            torch.zeros(1, 1, T_q, T_k, dtype=query.dtype, device=query.device)
        attention_mask = base.masked_fill(~keep, low)  # (B, 1, T_q, T_k) additive
    return eager(module, query, key, value, attention_mask, **kwargs)


def register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register(MASKED, masked_eager)
    AttentionMaskInterface.register(MASKED, eager_mask)


@contextlib.contextmanager
def masked_attention(model: nn.Module, mask_fn) -> Iterator[None]:
    """Inside, every attention of `model` drops the keys `mask_fn(b, h, q_idx, kv_idx)` is False for (None: none)."""
    if mask_fn is None:
        yield
        return
    register()
    _current["mask"] = mask_fn
    model.set_attn_implementation(MASKED)
    try:
        yield
    finally:
        model.set_attn_implementation("eager")
        _current.pop("mask", None)


@contextlib.contextmanager
def set_layer_output(layer: nn.Module, position: int, channels: list[int], values: torch.Tensor) -> Iterator[None]:
    """Inside, the decoder layer's output hidden states have h[:, position, channels] = values."""
    def hook(_module, _inputs, output):
        h = output[0] if isinstance(output, (tuple, list)) else output
        h = h.clone()
        h[:, position, channels] = values.to(h.dtype)
        return (h, *output[1:]) if isinstance(output, (tuple, list)) else h

    handle = layer.register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()
