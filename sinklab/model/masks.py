"""Which key each query sees, composed from small mask functions, and the per-sequence `Layout`.

Mask functions take FlexAttention's `mask_mod` signature (batch, head, q_idx, kv_idx) -> bool and broadcast over
index tensors, so the same functions build the explicit path's boolean mask and a fused kernel's block mask; they
are composed with FlexAttention's own `and_masks` / `or_masks` (which need batch and head as tensors).
Sequence layout inside a layer: keys are [bias slots (0 or 1)] + [sink tokens (S)] + [real tokens (T)]; queries are
the S + T sequence positions; mask functions index sequence positions (the slots are prepended, always visible).
With a KV cache (`cache.py`) the queries are the new positions start .. start + n_pos - 1 and the keys every position
0 .. start + n_pos - 1 the cache holds, numbered by their place in the cache.
An intervention's mask obeyed in some layers or by some heads only is a `LayerMask`: the layout keeps it
(`Layout.intervention`) and each layer it names restricts its own layout by it (`Attention.own`).
"""
from __future__ import annotations

import functools
import operator
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional, Union

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import and_masks, or_masks

MaskMod = Callable[[Any, Any, torch.Tensor, torch.Tensor], torch.Tensor]


def causal(b, h, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
    return kv_idx <= q_idx


def sliding_window(window: int) -> MaskMod:
    """Only the `window` most recent positions, the query's own included."""
    def mask(b, h, q_idx, kv_idx):
        return q_idx - kv_idx < window
    return mask


def first_positions(n: int) -> MaskMod:
    """The first `n` positions (StreamingLLM's attention sinks in an A-shape mask)."""
    def mask(b, h, q_idx, kv_idx):
        return kv_idx < n
    return mask


def strided_heads(stride: int, n_local: int) -> MaskMod:
    """Heads 0 .. n_local - 1 see the `stride` most recent positions, the others every `stride`-th position back
    from the query (the Sparse Transformer's two strided heads)."""
    def mask(b, h, q_idx, kv_idx):
        back = q_idx - kv_idx
        return torch.where(h < n_local, back < stride, back % stride == 0)
    return mask


def prefix_block(start: int, end: int) -> MaskMod:
    """Queries in [start, end) see every key before `end` (a prefix LM's bidirectional prefix)."""
    def mask(b, h, q_idx, kv_idx):
        return (q_idx >= start) & (q_idx < end) & (kv_idx < end)
    return mask


def sink_tokens_visible(n_sink: int) -> MaskMod:
    """The first `n_sink` positions (learned sink tokens) stay visible to every later query."""
    def mask(b, h, q_idx, kv_idx):
        return (kv_idx < n_sink) & (kv_idx <= q_idx)
    return mask


def compose_mask(n_sink: int, prefix_len: int, window: Optional[int]) -> MaskMod:
    """causal, cut to the window; the prefix block and the sink tokens added back (sink-token rows stay causal)."""
    mask = causal if window is None else and_masks(causal, sliding_window(window))
    if prefix_len:
        mask = or_masks(mask, prefix_block(n_sink, n_sink + prefix_len))
    if n_sink and window is not None:
        mask = or_masks(mask, sink_tokens_visible(n_sink))
    return mask


@dataclass(frozen=True)
class LayerMask:
    """An intervention's mask function `mask_mod`, obeyed only in the layers `layers` (0-based; None: every layer) and
    only by the query heads `heads` (None: every head); the other layers and heads see the keys the model's own mask
    lets them see. Taken wherever a plain mask function is (`Transformer.forward`'s extra_mask, `Target.masked`)."""

    mask_mod: MaskMod
    layers: Optional[frozenset[int]] = None
    heads: Optional[frozenset[int]] = None

    def __post_init__(self):
        for name in ("layers", "heads"):
            value = getattr(self, name)
            if value is not None:
                if not value:
                    raise ValueError(f"LayerMask.{name}: empty; None for every one")
                object.__setattr__(self, name, frozenset(int(i) for i in value))

    @property
    def everywhere(self) -> bool:
        """Every layer and every head obey it: a plain mask function."""
        return self.layers is None and self.heads is None

    def applies(self, layer: int) -> bool:
        return self.layers is None or layer in self.layers

    def head_mask_mod(self) -> MaskMod:
        """`mask_mod` for the chosen heads, every key for the others; h an index tensor (a fused kernel's scalar, or
        `Layout.mask`'s arange(H)[:, None, None]) that the result broadcasts with."""
        base, heads = self.mask_mod, sorted(self.heads or ())
        if not heads:
            return base

        def mask(b, h, q_idx, kv_idx):
            other = functools.reduce(operator.and_, (h != head for head in heads))  # h is none of the chosen
            return base(b, h, q_idx, kv_idx) | other
        return mask


def split_extra(extra: Union[MaskMod, LayerMask, None]) -> tuple[Optional[MaskMod], Optional[LayerMask]]:
    """An intervention's mask as (the mask function every layer and head obeys, the LayerMask some layers or heads
    obey): a LayerMask on every layer and head is the plain mask function."""
    if isinstance(extra, LayerMask):
        return (extra.mask_mod, None) if extra.everywhere else (None, extra)
    return extra, None


LogitBias = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (q_pos (R,), k_pos (N,)) -> (H, R, N)


@dataclass
class Layout:
    """Which key each query may see, the additive logit bias and RoPE, for the n_pos query positions of a forward
    (sink tokens + real tokens) after the `start` positions a KV cache already holds."""

    n_pos: int  # query positions of this forward: sink tokens + real tokens
    n_sink: int
    n_slots: int  # K / KV bias slots prepended to the keys
    mask_mod: MaskMod
    plain_causal: bool  # mask_mod is `causal` and nothing is prepended: a fused kernel's is_causal
    logit_bias: Optional[LogitBias]  # ALiBi / relative positions
    rope: Optional[Callable[[torch.Tensor], torch.Tensor]]  # rotates q or k (B, H, N, hd)
    device: torch.device
    start: int = 0  # positions held by a KV cache before this forward's queries
    rope_keys: Optional[Callable[[torch.Tensor], torch.Tensor]] = None  # RoPE of the keys 0 .. start + n_pos - 1
    cache: Optional[Any] = None  # the KV cache (cache.KVCache) the layers read and extend, or None
    bias_params: tuple = ()  # the parameters logit_bias reads (a learned relative table): they take its gradient
    memo: dict = field(default_factory=dict, repr=False)  # what a backend builds once per forward for every layer
    # the local layers' layout under model.layer_pattern: the same positions, cache and RoPE, the window's mask
    windowed: Optional["Layout"] = field(default=None, repr=False)
    # None: every head sees the same keys; H: mask_mod depends on the head (a fixed sparse pattern per head, e.g.
    # strided heads), and `mask` gives (H, R, n_keys)
    heads: Optional[int] = None
    # a selection of keys per query from the scores (sinklab.model.sparsity: top-k, MoBA), applied by the
    # operation's explicit map on top of `mask`; fused kernels decline a layout with one
    selector: Optional[Any] = None
    # the positional encoding's rotation of positions 0 .. n - 1 (`PositionalEncoding.rotary(n)`, None without RoPE):
    # for an op that rotates keys of its own at positions it picks (NSA's compressed blocks, at their last token)
    rotary_at: Optional[Callable[[int], Any]] = field(default=None, repr=False)
    # name -> the layers' auxiliary losses of this forward (`AttentionOp.aux_losses`), one dict shared by the
    # layout's variants (windowed, restricted): the model sums them (`Transformer.aux_losses`)
    aux_losses: dict = field(default_factory=dict, repr=False)
    # an intervention's mask that some layers or heads obey only (a `LayerMask`): each layer it names restricts its
    # own layout by it (`Attention.own`); None: none, or one every layer obeys (in `mask_mod` already)
    intervention: Optional[LayerMask] = None

    @property
    def n_key_pos(self) -> int:
        """Key positions (sink and real tokens, cached ones included)."""
        return self.start + self.n_pos

    @property
    def n_keys(self) -> int:
        return self.n_slots + self.n_key_pos

    def rows(self, r0: int = 0, r1: Optional[int] = None) -> torch.Tensor:
        """Positions of this forward's query rows r0 .. r1 - 1 (all by default)."""
        r1 = self.n_pos if r1 is None else min(r1, self.n_pos)
        return torch.arange(self.start + r0, self.start + r1, device=self.device)

    @property
    def is_plain_causal(self) -> bool:
        """Causal over the keys, nothing else: a fused kernel's is_causal (queries and keys aligned, no cache)."""
        return self.plain_causal and self.n_slots == 0 and self.logit_bias is None and self.start == 0

    @property
    def sees_every_key(self) -> bool:
        """One new query under a plain causal mask (decoding with a cache): it sees every key, no mask needed."""
        return self.plain_causal and self.logit_bias is None and self.n_pos == 1

    def mask(self, rows: torch.Tensor) -> torch.Tensor:
        """rows: (R,) query positions -> (R, n_keys) bool, True where the query sees the key; (H, R, n_keys) where
        the mask depends on the head (`heads`). Either broadcasts against maps (B, H, R, n_keys)."""
        b = torch.zeros((), dtype=torch.long, device=self.device)  # every batch row sees the same keys
        keys = torch.arange(self.n_key_pos, device=self.device)
        if self.heads is None:
            h = torch.zeros((), dtype=torch.long, device=self.device)
            seen = self.mask_mod(b, h, rows[:, None], keys[None, :])  # (R, n_key_pos)
        else:
            h = torch.arange(self.heads, device=self.device)[:, None, None]
            seen = self.mask_mod(b, h, rows[None, :, None], keys[None, None, :])
            seen = seen.expand(self.heads, len(rows), self.n_key_pos)  # (H, R, n_key_pos)
        if self.n_slots:
            slots = torch.ones(*seen.shape[:-1], self.n_slots, dtype=torch.bool, device=self.device)
            seen = torch.cat([slots, seen], -1)
        return seen

    def restricted(self, key: Any, mask_mod: MaskMod, heads: Optional[int] = None,
                   selector: Optional[Any] = None) -> "Layout":
        """This layout with `mask_mod` obeyed on top (a sparse pattern) and a `selector` choosing among the keys it
        leaves, built once per forward and `key` (every layer with the same pattern shares it, and so its fused
        kernel's block mask)."""
        if key not in self.memo:
            self.memo[key] = replace(self, mask_mod=and_masks(self.mask_mod, mask_mod), plain_causal=False,
                                     memo={}, windowed=None, heads=heads or self.heads,
                                     selector=selector or self.selector)
        return self.memo[key]

    def key_mask_mod(self) -> MaskMod:
        """`mask_mod` over this forward's query rows 0 .. n_pos - 1 and key indices 0 .. n_keys - 1 (the bias slots
        first, always visible): the indices a fused kernel (FlexAttention) passes, mapped to positions."""
        n_slots, start, mod = self.n_slots, self.start, self.mask_mod

        def mask(b, h, q_idx, kv_idx):
            return (kv_idx < n_slots) | mod(b, h, q_idx + start, (kv_idx - n_slots).clamp(min=0))
        return mask

    def bias_by_distance(self) -> Optional[torch.Tensor]:
        """(H, 2 P - 1) logit bias by key - query distance d = -(P - 1) .. P - 1 at entry d + P - 1, P = n_key_pos:
        what a fused kernel looks up instead of building (H, R, n_keys). ALiBi and T5 relative biases depend on the
        positions only through d, so the row of the last position against keys 0 .. 2 P - 2 holds every distance."""
        if self.logit_bias is None:
            return None
        P = self.n_key_pos
        last = torch.tensor([P - 1], device=self.device)
        return self.logit_bias(last, torch.arange(2 * P - 1, device=self.device))[:, 0]  # (H, 1, 2P - 1) -> (H, 2P - 1)

    def bias(self, rows: torch.Tensor) -> Optional[torch.Tensor]:
        """(H, R, n_keys) additive logit bias from ALiBi / relative positions, zero on the bias slot."""
        if self.logit_bias is None:
            return None
        b = self.logit_bias(rows, torch.arange(self.n_key_pos, device=self.device))
        return F.pad(b, (self.n_slots, 0)) if self.n_slots else b
