"""Interventions on a transformers causal LM (`sinklab eval intervene`: `sinklab.evals.interventions` says what each
is), through transformers' own extension points.

- A dropped key (mask_first, mask_random) and a zeroed value (zero_value_first): an attention function registered
  with transformers' `AttentionInterface` (and the eager mask with `AttentionMaskInterface`) under the name
  `sinklab_masked`, which adds -inf where the mask function drops a key to the additive mask the model built for the
  layer (its causal mask, or its sliding window on a sliding layer), sets the value of the chosen position to 0,
  and then calls the family's own eager attention (`eager_attention_forward` of its modeling module: logit
  soft-capping, learned sink logits and the like stay as they are). A `LayerMask` applies in the layers it names
  (the attention module's `layer_idx`) and, where it names query heads, as a (B, H, T_q, T_k) mask. The model is
  switched to it only inside `masked_attention` / `zeroed_value` and back after.
- Activations set (zero, mean): a forward hook on the decoder layer that rewrites its output hidden states.
`sinklab.targets.transformers_lm.TransformersTarget` opens them as `masked`, `zero_value` and `set_output`.
"""
from __future__ import annotations

import contextlib
import sys
from typing import Any, Iterable, Iterator, Optional

import torch
from torch import nn

from sinklab.errors import UserError
from sinklab.model.masks import split_extra

MASKED = "sinklab_masked"
# what the open `masked_attention` / `zeroed_value` set, read by the registered attention: "mask" (a mask function or
# a LayerMask), "zero_value" ((layers or None, position))
_current: dict = {}


def layer_index(module: nn.Module) -> int:
    """The attention module's layer (`layer_idx`, 0-based), for an intervention in some layers only."""
    layer = getattr(module, "layer_idx", None)
    if layer is None:
        raise UserError(f"{type(module).__name__}: no layer_idx; an intervention in some layers only is not "
                        "supported for this architecture")
    return int(layer)


def keep_mask(mask: Any, module: nn.Module, query: torch.Tensor, T_k: int) -> Optional[torch.Tensor]:
    """Which keys each query keeps under the open mask in this layer: (T_q, T_k), (H, T_q, T_k) for a LayerMask that
    names heads, causal; None where it does not apply here."""
    mask_fn, per_layer = split_extra(mask)
    if per_layer is not None:
        if per_layer.layers is not None and not per_layer.applies(layer_index(module)):
            return None
        mask_fn = per_layer.head_mask_mod()
    if mask_fn is None:
        return None
    T_q, device = query.shape[-2], query.device
    q_idx = torch.arange(T_k - T_q, T_k, device=device)[:, None]  # (T_q, 1) positions of the queries
    kv_idx = torch.arange(T_k, device=device)[None, :]  # (1, T_k)
    causal = kv_idx <= q_idx
    if per_layer is None or per_layer.heads is None:
        return mask_fn(None, None, q_idx, kv_idx) & causal  # (T_q, T_k)
    h = torch.arange(query.shape[1], device=device)[:, None, None]
    return (mask_fn(None, h, q_idx[None], kv_idx[None]) & causal).expand(query.shape[1], T_q, T_k)


def masked_eager(module: nn.Module, query, key, value, attention_mask, **kwargs):
    """The family's eager attention with the keys the open mask function drops masked out and the open zeroed
    value set to 0."""
    eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if eager is None:
        raise UserError(f"{type(module).__name__}: no eager_attention_forward in its modeling module; masking a key "
                        "is not supported for this architecture")
    T_q, T_k = query.shape[-2], key.shape[-2]
    keep = keep_mask(_current.get("mask"), module, query, T_k)
    if keep is not None:
        base = attention_mask[..., :T_k] if attention_mask is not None else \
            torch.zeros(1, 1, T_q, T_k, dtype=query.dtype, device=query.device)
        if keep.dim() == 3:  # per head: (B, H, T_q, T_k)
            base = base.expand(base.shape[0], keep.shape[0], T_q, T_k)
        attention_mask = base.masked_fill(~keep, torch.finfo(query.dtype).min)  # additive
    zero = _current.get("zero_value")
    if zero is not None and (zero[0] is None or layer_index(module) in zero[0]):
        value = value.clone()
        value[:, :, zero[1]] = 0  # (B, Hkv, T_k, hd): the position's value in every kv head
    return eager(module, query, key, value, attention_mask, **kwargs)


def register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register(MASKED, masked_eager)
    AttentionMaskInterface.register(MASKED, eager_mask)


@contextlib.contextmanager
def interface_open(model: nn.Module, name: str, value: Any) -> Iterator[None]:
    """Inside, `model` attends through `masked_eager` with _current[name] = value; both as they were after."""
    register()
    before, implementation = _current.get(name), model.config._attn_implementation
    _current[name] = value
    model.set_attn_implementation(MASKED)
    try:
        yield
    finally:
        model.set_attn_implementation(implementation)
        if before is None:
            _current.pop(name, None)
        else:
            _current[name] = before


@contextlib.contextmanager
def masked_attention(model: nn.Module, mask_fn) -> Iterator[None]:
    """Inside, every attention of `model` drops the keys `mask_fn(b, h, q_idx, kv_idx)` is False for (None: none; a
    LayerMask: the attentions of its layers, for its heads)."""
    if mask_fn is None:
        yield
        return
    with interface_open(model, "mask", mask_fn):
        yield


def zeroed_value(model: nn.Module, layers: Optional[Iterable[int]], position: int):
    """Inside, the attentions of `layers` (None: every one) take the value of `position` as 0 in every head."""
    return interface_open(model, "zero_value", (None if layers is None else frozenset(layers), position))


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
