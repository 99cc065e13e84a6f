"""Attention backends (`model.attn_backend`): which kernel computes softmax attention. The operation (`ops/`) says
what attention is; the backend only how a softmax over the visible keys runs, with the layout's masks and logit
biases and an optional extra logit per head in the denominator. Chosen in one place, `select_backend(cfg)`.

- `sdpa` (default): `F.scaled_dot_product_attention`, with is_causal for plain causal attention, else a dense
  (N, n_keys) boolean mask or additive bias. It has no extra logit: a sink-logit softmax takes the explicit path.
- `flex`: FlexAttention (`torch.nn.attention.flex_attention`, PyTorch 2.5+), for every softmax variant:
  the layout's mask functions as its `mask_mod` (bias slots are the first keys, always visible), ALiBi / relative
  biases as a `score_mod` that looks up a (H, 2P - 1) table by key - query distance (captured by the closure, so a
  learned relative table gets its gradient), and the extra logit s_h (learned sink logit, gpt-oss; softmax-off-by-
  one, s = 0) through the log-sum-exp identity out * sigmoid(lse - s_h), as torchtitan's gpt-oss attention computes
  it: softmax over the keys and s_h is the keys' softmax scaled by Z / (Z + e^s) with log Z = lse. The block mask
  and the bias table are built once per forward for every layer (`Layout.memo`). Decided here: FlexAttention is
  compiled once per process on a GPU (`torch.compile(flex_attention)`) and runs eagerly elsewhere, where torch
  evaluates it densely (a slow reference: right for tests, not for training). Where FlexAttention is unavailable
  (no flex in this torch, no backward on this device as on torch's CPU builds, or no flex under an active torch
  mode such as the FlopCounterMode of Lightning's model summary) the call falls back to `sdpa`, which is today's
  behaviour, with one warning per reason and process.
- `explicit`: every operation through its explicit maps (`Attention.explicit`), the reference the others are
  tested against.
"""
from __future__ import annotations

import functools
import warnings
from typing import Any, Callable, ClassVar, Optional

import torch
import torch.nn.functional as F

from .masks import Layout
from .registry import ATTN_BACKENDS, Component

try:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
except ImportError:  # torch < 2.5
    create_block_mask = flex_attention = None
try:
    from torch.nn.attention.flex_attention import AuxRequest  # return_lse's successor
except ImportError:  # torch < 2.9
    AuxRequest = None


def select_backend(cfg: Any) -> "AttentionBackend":
    """The backend a model runs: the one ModelConfig.backend names (model.attn_backend, or explicit under the legacy
    model.fused=false)."""
    return ATTN_BACKENDS.get(cfg.backend)()


class AttentionBackend(Component):
    """The interface: `softmax(...)` or None where this backend does not compute it (the op takes its explicit
    path); `fuses` False makes every operation take its explicit path."""

    fuses: ClassVar[bool] = True

    def softmax(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: Layout, scale: float,
                sink: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
        """softmax(scale q k^T + bias over the visible keys [, an extra logit sink_h]) @ v: q (B, H, N, hd), k and v
        (B, H, n_keys, hd), sink (H,) -> (B, H, N, hd)."""
        return None


@ATTN_BACKENDS.register("sdpa")
class SDPABackend(AttentionBackend):
    """scaled_dot_product_attention: is_causal, no mask for one new query that sees every key (decoding), else a
    boolean mask, or an additive one with position biases; no extra logit."""

    def softmax(self, q, k, v, layout, scale, sink=None):
        if sink is not None or layout.selector is not None:  # an extra logit; keys selected from the scores
            return None
        if layout.is_plain_causal:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        if layout.sees_every_key:
            return F.scaled_dot_product_attention(q, k, v, scale=scale)
        rows = layout.rows()
        mask, bias = layout.mask(rows), layout.bias(rows)
        if bias is not None:
            mask = bias.to(q.dtype).masked_fill(~mask, float("-inf"))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


@ATTN_BACKENDS.register("flex")
class FlexBackend(SDPABackend):
    """FlexAttention for every softmax variant (module docstring); sdpa where it is unavailable."""

    def softmax(self, q, k, v, layout, scale, sink=None):
        selector = layout.selector
        if selector is not None and not selector.flex_selects:  # keys selected from the scores: the explicit map
            return None
        missing = flex_missing(q, k, v)
        if missing is not None:
            warn_once(f"model.attn_backend=flex falls back to sdpa (the explicit path for a sink logit): {missing}")
            return super().softmax(q, k, v, layout, scale, sink)
        if selector is not None:  # a selection from this layer's q and k: a block mask of its own (B, H)
            block_mask = create_block_mask(selector.flex_mask(q, k, layout), q.shape[0], q.shape[1], layout.n_pos,
                                           layout.n_keys, device=q.device)
            score_mod = distance_score_mod(layout)
        else:
            if "flex" not in layout.memo:  # once per forward, for every layer
                mask = create_block_mask(layout.key_mask_mod(), None, layout.heads, layout.n_pos, layout.n_keys,
                                         device=q.device)
                layout.memo["flex"] = (mask, distance_score_mod(layout))
            block_mask, score_mod = layout.memo["flex"]
        run = compiled_flex() if q.device.type == "cuda" else flex_attention
        if sink is None:
            return run(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale)
        if AuxRequest is not None:
            o, aux = run(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale,
                         return_aux=AuxRequest(lse=True))
            lse = aux.lse
        else:
            o, lse = run(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale, return_lse=True)
        # lse (B, H, N) = log Z over the keys; the extra logit's share e^s / (Z + e^s) is taken out of every row
        keep = torch.sigmoid(lse - sink.to(lse.dtype)[None, :, None])  # Z / (Z + e^s)
        return o * keep[..., None].to(o.dtype)


def distance_score_mod(layout: Layout) -> Optional[Callable]:
    """FlexAttention's score_mod adding the layout's position bias, looked up by key - query distance (zero on the
    bias slots), or None without one."""
    table = layout.bias_by_distance()  # (H, 2P - 1), entry d + P - 1 for distance d = key position - query position
    if table is None:
        return None
    n_slots = layout.n_slots
    offset = layout.n_key_pos - 1 - layout.start - n_slots  # key index - query row + offset = d + P - 1

    def score_mod(score, b, h, q_idx, kv_idx):
        bias = table[h, (kv_idx - q_idx + offset).clamp(min=0)]  # a slot's index may fall below 0: masked next
        return score + torch.where(kv_idx < n_slots, 0.0, bias).to(score.dtype)
    return score_mod


def flex_missing(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Optional[str]:
    """Why FlexAttention cannot run this call, or None."""
    if flex_attention is None:
        return f"torch {torch.__version__} has no torch.nn.attention.flex_attention (torch >= 2.5)"
    if not torch.compiler.is_compiling() and torch._C._len_torch_dispatch_stack() > 0:
        # eager flex raises under a dispatch mode, and the failed attempt breaks later flex calls in the process
        return "a torch dispatch mode is active (e.g. the FlopCounterMode of Lightning's model summary)"
    needs_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    if needs_grad and not flex_trains_on(q.device.type):
        return f"torch {torch.__version__} has no FlexAttention backward on {q.device.type}"
    return None


@functools.lru_cache(maxsize=None)
def flex_trains_on(device_type: str) -> bool:
    """Whether FlexAttention has a backward on this device type, tried once on a tiny input (torch's CPU builds
    refuse it before computing anything)."""
    if device_type == "cuda":
        return True
    x = torch.zeros(1, 1, 16, 16, device=device_type, requires_grad=True)
    try:
        flex_attention(x, x, x)
    except NotImplementedError:
        return False
    return True


@functools.lru_cache(maxsize=None)
def compiled_flex() -> Callable:
    """flex_attention compiled once per process (its fused kernel on a GPU)."""
    return torch.compile(flex_attention)


@functools.lru_cache(maxsize=None)
def warn_once(message: str) -> None:
    warnings.warn(message, stacklevel=4)


@ATTN_BACKENDS.register("explicit")
class ExplicitBackend(AttentionBackend):
    """Every operation through its explicit maps."""

    fuses = False
