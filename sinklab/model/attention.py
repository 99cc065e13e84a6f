"""Causal self-attention with every attention ablation behind a switch.

Sequence layout inside a layer: keys are [bias slot (0 or 1)] + [sink tokens (S)] + [real tokens (T)];
queries are the S + T sequence positions. `Layout` builds the mask and additive position bias for any set of
query rows, so the explicit path (and the metric) can work on query chunks with memory linear in T.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig


@dataclass
class Layout:
    """Which key each query may see, and the additive logit bias, for a sequence of n_sink + T positions."""

    n_pos: int  # sink tokens + real tokens
    n_sink: int
    n_slots: int  # K / KV bias slots prepended to the keys
    prefix_len: int
    window: Optional[int]
    pos_bias: Optional[nn.Module]  # ALiBi / RelativeBias: (q_pos, k_pos) -> (H, R, Tk)
    device: torch.device

    @property
    def n_keys(self) -> int:
        return self.n_slots + self.n_pos

    @property
    def is_plain_causal(self) -> bool:
        return self.n_slots == 0 and self.prefix_len == 0 and self.window is None and self.pos_bias is None

    def mask(self, rows: torch.Tensor) -> torch.Tensor:
        """rows: (R,) query positions -> (R, n_keys) bool, True where the query sees the key."""
        i = rows[:, None]
        j = torch.arange(self.n_pos, device=self.device)[None, :]
        seen = j <= i
        if self.window is not None:
            seen = seen & (i - j < self.window)
        if self.prefix_len:  # real prefix rows see the whole prefix; sink-token rows stay causal
            end = self.n_sink + self.prefix_len
            seen = seen | ((i >= self.n_sink) & (i < end) & (j < end))
        if self.n_sink and self.window is not None:  # learned sink tokens stay visible through the window
            seen = seen | ((j < self.n_sink) & (j <= i))
        if self.n_slots:
            seen = torch.cat([torch.ones(len(rows), self.n_slots, dtype=torch.bool, device=self.device), seen], 1)
        return seen

    def bias(self, rows: torch.Tensor) -> Optional[torch.Tensor]:
        """(H, R, n_keys) additive logit bias from ALiBi / relative positions, zero on the bias slot."""
        if self.pos_bias is None:
            return None
        b = self.pos_bias(rows, torch.arange(self.n_pos, device=self.device))
        return F.pad(b, (self.n_slots, 0)) if self.n_slots else b


class KernelMLP(nn.Module):
    """Per-layer feature map Linear - ReLU - Linear shared by q and k."""

    def __init__(self, hd: int):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(hd, hd), nn.ReLU(), nn.Linear(hd, hd))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class Attention(nn.Module):
    # the explicit path computes this many query rows at a time: without autograd (measurement) it never holds a
    # full (B, H, N, Tk) map; with autograd each chunk's map is kept for backward, as the unchunked path would
    row_chunk: int = 256

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        H, Hkv, hd, d = cfg.n_head, cfg.kv_heads, cfg.hd, cfg.d_model
        self.n_head, self.n_kv, self.hd = H, Hkv, hd
        self.scale = cfg.softmax_scale / math.sqrt(hd)
        self.q_proj = nn.Linear(d, H * hd, bias=False)
        self.k_proj = nn.Linear(d, Hkv * hd, bias=False)
        self.v_proj = nn.Linear(d, Hkv * hd, bias=False)
        self.o_proj = nn.Linear(H * hd, d, bias=False)
        nb = 1 if cfg.attn_bias_shared else H  # bias heads
        if cfg.attn_bias in ("k", "kv"):
            self.k_bias = nn.Parameter(torch.zeros(nb, hd))
        if cfg.attn_bias == "kv":
            self.v_bias = nn.Parameter(torch.zeros(nb, hd))
        if cfg.attn_bias == "k" and cfg.attn_bias_fixed_value_scale is not None:
            g = torch.Generator().manual_seed(1234 + cfg.attn_bias_fixed_value_seed)
            direction = torch.randn(hd, generator=g)
            self.register_buffer("v_fixed", cfg.attn_bias_fixed_value_scale * direction / direction.norm())
        if cfg.attn_bias == "v":
            self.v_out_bias = nn.Parameter(torch.zeros(nb, hd))
        if cfg.sink_logit == "learned":
            self.sink_logit = nn.Parameter(torch.zeros(H))
        if cfg.gate != "none":
            self.gate_proj = nn.Linear(d, H if cfg.gate == "headwise" else H * hd, bias=False)
        if cfg.attn_op == "kernel" and cfg.kernel_map == "mlp":
            self.phi = KernelMLP(hd)

    # ------------------------------------------------------------------ pieces
    def qkv(self, x: torch.Tensor, rope: Optional[Callable[[torch.Tensor], torch.Tensor]]):
        """x (B, N, d) -> q (B, H, N, hd), k and v (B, H, n_slots + N, hd), RoPE applied before the slot."""
        B, N = x.shape[0], x.shape[1]
        # (B, N, h * hd) -> (B, h, N, hd) views, as einops' "b n (h d) -> b h n d" (no copy)
        q = self.q_proj(x).view(B, N, -1, self.hd).transpose(1, 2)
        k = self.k_proj(x).view(B, N, -1, self.hd).transpose(1, 2)
        v = self.v_proj(x).view(B, N, -1, self.hd).transpose(1, 2)
        if rope is not None:
            q, k = rope(q), rope(k)
        if self.n_kv != self.n_head:  # grouped-query attention: share each kv head across n_head / n_kv heads
            k = k.repeat_interleave(self.n_head // self.n_kv, dim=1)
            v = v.repeat_interleave(self.n_head // self.n_kv, dim=1)
        if self.cfg.attn_bias in ("k", "kv"):
            kb = self.k_bias.expand(self.n_head, self.hd)[None, :, None, :].expand(B, -1, -1, -1).to(k.dtype)
            if self.cfg.attn_bias == "kv":
                vb = self.v_bias.expand(self.n_head, self.hd)
            elif hasattr(self, "v_fixed"):
                vb = self.v_fixed.expand(self.n_head, self.hd)
            else:
                vb = torch.zeros(self.n_head, self.hd, device=v.device)
            vb = vb[None, :, None, :].expand(B, -1, -1, -1).to(v.dtype)
            k, v = torch.cat([kb, k], dim=2), torch.cat([vb, v], dim=2)  # (B, H, 1 + N, hd)
        return q, k, v

    def probs(self, q: torch.Tensor, k: torch.Tensor, layout: Layout, rows: torch.Tensor) -> torch.Tensor:
        """Explicit attention map for query rows: q (B, H, R, hd), k (B, H, Tk, hd) -> A (B, H, R, Tk)."""
        cfg = self.cfg
        seen = layout.mask(rows)  # (R, Tk)
        if cfg.attn_op == "kernel":
            phi_q, phi_k = self.feature_map(q), self.feature_map(k)
            a = (phi_q @ phi_k.transpose(-1, -2)) * self.scale * seen
            if cfg.attn_normalize:
                total = a.sum(-1, keepdim=True)
                a = a / (total + 1e-8) if cfg.kernel_map == "elu" else a / total.abs().clamp(min=1.0)
            return a
        s = (q @ k.transpose(-1, -2)) * self.scale  # (B, H, R, Tk)
        bias = layout.bias(rows)
        if bias is not None:
            s = s + bias.to(s.dtype)
        if cfg.attn_op == "softmax":
            s = s.masked_fill(~seen, float("-inf"))
            if cfg.sink_logit == "none":
                return torch.softmax(s, dim=-1)
            extra = self.sink_logit if cfg.sink_logit == "learned" else torch.zeros(self.n_head, device=s.device)
            extra = extra.to(s.dtype)[None, :, None, None].expand(*s.shape[:-1], 1)
            return torch.softmax(torch.cat([s, extra], dim=-1), dim=-1)[..., :-1]
        if cfg.attn_op == "softpick":
            # rectified softmax: relu(e^x - 1) / sum |e^x - 1| over the visible keys, shifted by m for stability
            m = s.masked_fill(~seen, float("-inf")).amax(-1, keepdim=True).clamp(min=0).detach()
            e = (torch.exp(s - m) - torch.exp(-m)) * seen
            return F.relu(e) / (e.abs().sum(-1, keepdim=True) + 1e-6 * torch.exp(-m))
        if cfg.attn_op == "sigmoid":
            a = torch.sigmoid(s + cfg.sigmoid_bias) * seen
        else:  # elu + 1
            a = (F.elu(s) + 1.0) * seen
        if cfg.attn_normalize:
            a = a / (a.sum(-1, keepdim=True) + 1e-8)
        return a

    def feature_map(self, x: torch.Tensor) -> torch.Tensor:
        if self.cfg.kernel_map == "elu":
            return F.elu(x) + 1.0
        if self.cfg.kernel_map == "mlp":
            return self.phi(x)
        return x

    # ------------------------------------------------------------------ forward
    def forward(self, x: torch.Tensor, layout: Layout, rope: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
                record: Optional[dict] = None, return_probs: bool = False):
        """x (B, N, d) -> (B, N, d). `record` receives q, k, v; `return_probs` forces the explicit path."""
        q, k, v = self.qkv(x, rope)
        if record is not None:
            record.update(q=q, k=k, v=v)
        probs = None
        if self.cfg.can_fuse and not return_probs:
            if layout.is_plain_causal:
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
            else:
                rows = torch.arange(layout.n_pos, device=x.device)
                mask, bias = layout.mask(rows), layout.bias(rows)
                if bias is not None:
                    mask = bias.to(q.dtype).masked_fill(~mask, float("-inf"))
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)
        elif return_probs:
            probs = self.probs(q, k, layout, torch.arange(layout.n_pos, device=x.device))  # (B, H, N, Tk)
            o = probs @ v  # (B, H, N, hd)
        else:  # query rows in chunks: memory O(B * H * row_chunk * Tk), linear in the sequence length
            chunks = []
            for r0 in range(0, layout.n_pos, self.row_chunk):
                rows = torch.arange(r0, min(r0 + self.row_chunk, layout.n_pos), device=x.device)
                a = self.probs(q[:, :, r0:r0 + len(rows)], k, layout, rows)  # (B, H, R, Tk)
                chunks.append(a @ v)  # (B, H, R, hd)
            o = torch.cat(chunks, dim=2)  # (B, H, N, hd)
        if self.cfg.attn_bias == "v":
            o = o + self.v_out_bias.expand(self.n_head, self.hd)[None, :, None, :]
        if self.cfg.gate != "none":
            g = torch.sigmoid(self.gate_proj(x))  # (B, N, H) or (B, N, H * hd)
            g = g.transpose(1, 2).unsqueeze(-1) if self.cfg.gate == "headwise" else \
                g.view(g.shape[0], g.shape[1], -1, self.hd).transpose(1, 2)  # (B, H, N, 1 or hd)
            o = o * g
        out = self.o_proj(o.transpose(1, 2).flatten(2))  # (B, H, N, hd) -> (B, N, H * hd)
        return (out, probs) if return_probs else out
