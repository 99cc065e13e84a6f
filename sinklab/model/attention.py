"""Causal self-attention, its pieces chosen by name: the operation (`ops/`), the attention bias (`attn_bias.py`) and
the gate (`gates.py`, at one of the positions G1 .. G5, each named where it applies). The masks, RoPE and position
biases of a sequence come in its `Layout` (`masks.py`); the backend (`backends.py`) runs softmax attention.
The explicit path works on query-row chunks, so the metric's memory is linear in T. In training each chunk's map is
kept for backward (`model.attn_memory=keep_maps`, fastest at short T), or recomputed in backward (`linear`:
`recompute.py`, so training memory is linear in T too; decided here: the chunk is the unit, nothing else is
recomputed); `auto`, the default, is resolved once, by `ModelConfig.memory`. With a KV cache in the layout, the keys
and values of earlier positions come from the cache (an evicting cache stores them before RoPE, so that the kept keys
are rotated at their new places; a dense one after).
An operation with tensors of its own (`AttentionOp.project`: NSA's branch keys and gates, DSA's indexer) gets them
from the same input x, rotated where it says so, through the cache, and as `extra` wherever it computes (`extras`).
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from sinklab.errors import UserError

from .backends import select_backend
from .gates import G1, G2, G3, G4, G5
from .hooks import HookPoint
from .masks import Layout
from .ops.base import AttentionOp
from .positional.rope import RotaryAt
from .recompute import recomputed_rows
from .registry import ATTENTION_OPS, ATTN_BIASES, GATES, HEAD_NORMS, POSITIONS, QK_NORMS, SPARSITIES


class Attention(nn.Module):
    # the explicit path computes this many query rows at a time: without autograd (measurement) it never holds a
    # full (B, H, N, Tk) map; with autograd each chunk's map is kept for backward (attn_memory=keep_maps), as the
    # unchunked path would, or recomputed in backward (attn_memory=linear)
    row_chunk: int = 256

    def __init__(self, cfg, layer: int = 0, local: bool = False):
        super().__init__()
        H, Hkv, hd, d = cfg.n_head, cfg.kv_heads, cfg.hd, cfg.d_model
        self.n_head, self.n_kv, self.hd = H, Hkv, hd
        self.scale = cfg.softmax_scale / math.sqrt(hd)
        # registered first: its parameters come first in the initialisation order
        self.attn_bias = ATTN_BIASES.selected(cfg)(cfg)
        self.q_proj = nn.Linear(d, H * hd, bias=False)
        self.k_proj = nn.Linear(d, Hkv * hd, bias=False)
        self.v_proj = nn.Linear(d, Hkv * hd, bias=False)
        self.o_proj = nn.Linear(H * hd, d, bias=False)
        self.gate_proj = GATES.selected(cfg)(cfg)
        self.op = ATTENTION_OPS.selected(cfg)(cfg)
        self.op.bind_layer(layer)
        self.sparsity = SPARSITIES.selected(cfg)(cfg, layer)  # which visible keys each query attends to
        self.backend = select_backend(cfg)
        # whether the op's fused path runs at all: its fusable(cfg), the one place that says "no fused path"
        self.use_fused = self.backend.fuses and self.op.fusable(cfg)
        self.recompute = cfg.memory == "linear"
        # False in a NoPE layer (model.nope_every) and for an op that takes no RoPE (a recurrent mixer)
        self.rotates = POSITIONS.selected(cfg).rotates(cfg, layer) and self.op.takes_rope
        self.layer = layer  # its index in a KV cache
        self.local = local  # a local layer of model.layer_pattern: it attends through the layout's windowed mask
        self.qk_norm = QK_NORMS.selected(cfg)(cfg)  # before RoPE (model.qk_norm)
        self.head_norm = HEAD_NORMS.selected(cfg)(cfg)  # each head's output, before a V bias, G1 and o_proj
        # q, k, v as the operation sees them (after RoPE, with the bias slot): where measurements record them
        self.hook_q, self.hook_k, self.hook_v = HookPoint(), HookPoint(), HookPoint()
        # the op's own per-token tensors (`extras`, a dict, {} for most ops), before hook_q: a measurement replays
        # the maps from q, k and these
        self.hook_extra = HookPoint()
        # TransformerLens's places (`sinklab.model.hooked` names them, `hook_q` .. there meaning the `_in` ones):
        # q, k, v as projected (after QK-norm and a G2 .. G4 gate), before RoPE, the kv heads' repeat and the bias
        # slot, in its layout (B, N, h, hd); the map's logits and the map over the positions (B, H, N, n_key_pos),
        # the bias slot's share (B, H, N, n_slots): computed only when a hook is attached (`hooked_map`); each
        # head's output, o_proj's input (B, N, H, hd)
        self.hook_q_in, self.hook_k_in, self.hook_v_in = HookPoint(), HookPoint(), HookPoint()
        self.hook_attn_scores, self.hook_pattern, self.hook_slot_pattern = HookPoint(), HookPoint(), HookPoint()
        self.hook_z = HookPoint()

    def extras(self, x: torch.Tensor, layout: Layout) -> dict[str, torch.Tensor]:
        """The op's per-token tensors (`AttentionOp.project`) over every key position: those it names in `rotated`
        take this forward's RoPE, then a KV cache adds its earlier positions' (a dense cache; one that evicts would
        have to re-derive them at new places, and is refused)."""
        extra = self.op.project(x)
        if self.op.recurrent:  # gates of the new positions only: its memory, in the cache, holds the past
            return self.hook_extra(extra)
        cache = layout.cache
        if extra and cache is not None and cache.policy.budget is not None:
            raise UserError(f"model.attn_op={self.op.name} keeps per-token tensors of its own in the KV cache: a cache "
                            f"that evicts (policy {cache.policy.name}) is not supported; allowed: a dense cache")
        rope = layout.rope if self.rotates else None
        for name, t in extra.items():  # (B, h, N, w) each
            if rope is not None and name in self.op.rotated:
                t = rotate_leading(rope, t)
            extra[name] = cache.extend_extra(self.layer, name, t) if cache is not None else t  # (B, h, P, w)
        return self.hook_extra(extra)

    def qkv(self, x: torch.Tensor, layout: Layout):
        """x (B, N, d) -> q (B, H, N, hd), k and v (B, H, n_slots + start + N, hd), RoPE applied before the slot. A
        gate at G4 / G3 / G2 multiplies the query / key / value projection's output, before RoPE and the kv heads'
        repeat. A KV cache adds the `start` positions it holds and keeps the new ones (see cache.py for when it holds
        them rotated)."""
        B, N = x.shape[0], x.shape[1]
        gate = self.gate_proj
        # (B, N, h * hd) -> (B, h, N, hd) views, as einops' "b n (h d) -> b h n d" (no copy)
        q = gate.at(G4, x, self.qk_norm.q(self.q_proj(x).view(B, N, -1, self.hd)).transpose(1, 2))
        k = gate.at(G3, x, self.qk_norm.k(self.k_proj(x).view(B, N, -1, self.hd)).transpose(1, 2))
        v = gate.at(G2, x, self.v_proj(x).view(B, N, -1, self.hd).transpose(1, 2))
        # (B, h, N, hd) <-> TransformerLens's (B, N, h, hd) at the `_in` hook points (views, no copy)
        q, k, v = (hook(t.transpose(1, 2)).transpose(1, 2)
                   for hook, t in ((self.hook_q_in, q), (self.hook_k_in, k), (self.hook_v_in, v)))
        rope = layout.rope if self.rotates else None
        cache = layout.cache
        if self.op.recurrent:  # the new positions only, through the op's convolutions; the cache keeps its memory
            q, k, v = self.op.prepare(q, k, v, cache)
        elif cache is not None and cache.stores_rotated:  # a dense cache: keys keep their place, rotated once
            if rope is not None:
                q, k = rope(q), rope(k)
            k, v = cache.extend(self.layer, k, v)  # (B, Hkv, start + N, hd)
        else:
            if cache is not None:
                k, v = cache.extend(self.layer, k, v)  # un-rotated, (B, Hkv, start + N, hd)
            if rope is not None:
                q, k = rope(q), (layout.rope_keys or rope)(k)
        if self.n_kv != self.n_head:  # grouped-query attention: share each kv head across n_head / n_kv heads
            k = k.repeat_interleave(self.n_head // self.n_kv, dim=1)
            v = v.repeat_interleave(self.n_head // self.n_kv, dim=1)
        k, v = self.attn_bias.extend(k, v)
        return self.hook_q(q), self.hook_k(k), self.hook_v(v)

    def probs(self, q: torch.Tensor, k: torch.Tensor, layout: Layout, rows: torch.Tensor,
              extra: Optional[dict[str, torch.Tensor]] = None) -> torch.Tensor:
        """Explicit attention map for query rows: q (B, H, R, hd), k (B, H, Tk, hd) -> A (B, H, R, Tk); `extra`: the
        op's tensors of this forward (`extras`, recorded at `hook_extra`), for an op that has them."""
        if extra:
            return self.op.probs(q, k, self.own(layout), rows, self.scale, extra)
        return self.op.probs(q, k, self.own(layout), rows, self.scale)

    def own(self, layout: Layout) -> Layout:
        """The layout this layer attends through: the windowed one in a local layer of a pattern, restricted by the
        operation's own (`AttentionOp.restrict`), by the sparsity's pattern or selection (`model.sparsity`) and by
        an intervention's mask that names this layer (`Layout.intervention`, per head where it names heads)."""
        own = self.sparsity.restrict(self.op.restrict(layout.windowed if self.local else layout))
        iv = layout.intervention
        if iv is not None and iv.applies(self.layer):
            own = own.restricted(("intervention", self.layer), iv.head_mask_mod(),
                                 heads=self.n_head if iv.heads is not None else None)
        visible = layout.cache.visible_keys(self.layer) if layout.cache is not None else None
        if visible is None:
            return own
        # a KV cache policy that masks keys (DuoAttention's streaming heads, PyramidKV's free slots): (Hkv, L)
        group = self.n_head // self.n_kv
        return own.restricted(("cache_visible", self.layer), lambda b, h, q, kv: visible[h // group, kv],
                              heads=self.n_head)

    def explicit(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: Layout,
                 extra: Optional[dict[str, torch.Tensor]] = None) -> torch.Tensor:
        """Query rows in chunks: memory O(B * H * row_chunk * Tk), linear in the sequence length (in training too
        when each chunk is recomputed in backward; the op's `extra` tensors take their gradients there too)."""
        extra = extra or {}
        if self.recompute and torch.is_grad_enabled():
            params, names = (*self.op.parameters(), *layout.bias_params), list(extra)
            return recomputed_rows(lambda qr, k_, v_, r0, more: self.rows_output(qr, k_, v_, layout, r0,
                                                                                 dict(zip(names, more))),
                                   self.row_chunk, q, k, v, params, more=tuple(extra.values()))
        chunks = [self.rows_output(q[:, :, r0:r0 + self.row_chunk], k, v, layout, r0, extra)  # (B, H, R, hd) each
                  for r0 in range(0, layout.n_pos, self.row_chunk)]
        return torch.cat(chunks, dim=2)  # (B, H, N, hd)

    def rows_output(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: Layout, r0: int,
                    extra: Optional[dict[str, torch.Tensor]] = None) -> torch.Tensor:
        """The output of query rows r0 .. r0 + R - 1 through their map: q (B, H, R, hd) -> (B, H, R, hd)."""
        rows = layout.rows(r0, r0 + q.shape[2])
        if extra:  # an op with tensors of its own: its branches may have values of their own
            return self.op.attend(q, k, v, self.own(layout), rows, self.scale, extra)
        return self.probs(q, k, layout, rows) @ v

    def forward(self, x: torch.Tensor, layout: Layout) -> torch.Tensor:
        """x (B, N, d) -> (B, N, d), the output after o_proj (and a G5 gate); each head's output goes through the
        op's `output`, the head norm (model.head_norm), a V bias and a G1 gate first. In a training forward the op's
        auxiliary losses join `layout.aux_losses` (the model sums them over its layers)."""
        extra = self.extras(x, layout)
        q, k, v = self.qkv(x, layout)
        o = self.hooked_map(q, k, v, layout, extra) if self.map_hooked else None
        # a recurrent op decodes from its memory in a KV cache, whichever path: its fused form reads it
        if o is None and (self.use_fused or (self.op.recurrent and layout.cache is not None)):
            own, more = self.own(layout), ({"extra": extra} if extra else {})  # an op's own tensors, where it has them
            o = self.op.fused(q, k, v, own, self.scale, self.backend, **more)
        if o is None:
            o = self.explicit(q, k, v, layout, extra)
        # an attention-based cache policy's scores (a recurrent layer holds no keys to score)
        if layout.cache is not None and layout.cache.wants_maps and not self.op.recurrent:
            layout.cache.observe(self.layer, self.probs(q, k, layout, layout.rows())[..., self.attn_bias.n_slots:])
        if self.training and torch.is_grad_enabled():
            for name, loss in self.op.aux_losses(q, k, self.own(layout), self.scale, extra, self.row_chunk).items():
                layout.aux_losses.setdefault(name, []).append(loss)
        o = self.gate_proj.at(G1, x, self.attn_bias.output(self.head_norm(self.op.output(o))))
        z = self.hook_z(o.transpose(1, 2))  # (B, H, N, hd) -> (B, N, H, hd)
        out = self.o_proj(z.flatten(2))  # (B, N, H, hd) -> (B, N, H * hd) -> (B, N, d)
        return self.gate_proj.at(G5, x, out)

    @property
    def map_hooked(self) -> bool:
        """Whether a hook looks at the map's logits, the map or the bias slot's share (one dict check each)."""
        return self.hook_attn_scores.active or self.hook_pattern.active or self.hook_slot_pattern.active

    def hooked_map(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: Layout,
                   extra: dict[str, torch.Tensor]) -> Optional[torch.Tensor]:
        """The whole map of this forward, explicit (as `sinklab.metrics.record` replays it), through the hooks on its
        logits over the positions (`hook_attn_scores`: (B, H, N, n_key_pos), -inf where a key is not seen), on the
        map over the positions (`hook_pattern`, the same shape) and on the bias slot columns (`hook_slot_pattern`:
        (B, H, N, n_slots)). Returns the heads' output map @ v (B, H, N, hd) when a hook replaced one of them, else
        None: the layer's own path computes the output then, so that reading the map changes no number."""
        n, rows, own = self.attn_bias.n_slots, layout.rows(), self.own(layout)
        replaced = False
        if self.hook_attn_scores.active:
            if type(self.op).probs is not AttentionOp.probs:
                raise UserError(f"hook_attn_scores: model.attn_op={self.op.name} has no one matrix of logits; "
                                "allowed: hook_pattern")
            s, seen = self.op.logits(q, k, own, rows, self.scale)  # (B, H, N, n_keys), ((B,) (H,) N, n_keys)
            scores = s.masked_fill(~seen, float("-inf"))[..., n:]
            new = self.hook_attn_scores(scores)
            if new is not scores:  # the keys not seen keep their logits: the op masks them
                kept = torch.where(seen[..., n:], new.to(s.dtype), s[..., n:])
                s, replaced = torch.cat([s[..., :n], kept], -1), True
            a = self.op.normalise(s, seen)
        else:
            a = self.probs(q, k, layout, rows, extra)  # (B, H, N, n_keys)
        slot, pattern = a[..., :n], a[..., n:]
        new_slot = self.hook_slot_pattern(slot) if n else slot
        new_pattern = self.hook_pattern(pattern)
        if not (replaced or new_slot is not slot or new_pattern is not pattern):
            return None
        if type(self.op).attend is not AttentionOp.attend:
            raise UserError(f"a hook replacing the attention map: model.attn_op={self.op.name} does not attend "
                            "through its map (its branches have values of their own); allowed: a hook that "
                            "returns None, or one on hook_z")
        return torch.cat([new_slot, new_pattern], -1).to(v.dtype) @ v  # (B, H, N, n_keys) @ (B, H, n_keys, hd)


def rotate_leading(rope: RotaryAt, t: torch.Tensor) -> torch.Tensor:
    """RoPE on the first min(w, hd) channels of t (B, h, N, w), the rest unrotated: a tensor as wide as a head is
    rotated as the keys are; a narrower one takes the fastest w / 2 rotary pairs, a wider one rotates its first hd
    channels (as DeepSeek-V3.2's indexer rotates a part of its query and key heads)."""
    hd, w = rope.cos.shape[-1], t.shape[-1]
    if w == hd:
        return rope(t)
    half = min(w, hd) // 2  # rotary pairs
    if 2 * half < hd:  # the fastest pairs' tables, each half of the rotate-half layout cut to `half` pairs
        rope = RotaryAt(torch.cat([rope.cos[:, :half]] * 2, -1), torch.cat([rope.sin[:, :half]] * 2, -1))
    return torch.cat([rope(t[..., :2 * half]), t[..., 2 * half:]], dim=-1)
