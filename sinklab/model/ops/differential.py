"""Differential attention (Ye et al., "Differential Transformer", ICLR 2025, arXiv 2410.05258, eq. 1-3):

    A = softmax(Q1 K1^T / sqrt(d)) - lambda softmax(Q2 K2^T / sqrt(d)),   O = (1 - lambda_init) RMSNorm(A V)
    lambda = exp(lq1 . lk1) - exp(lq2 . lk2) + lambda_init,   lambda_init = 0.8 - 0.6 exp(-0.3 (l - 1))

for layer l = 1 .. L; Q = [Q1; Q2] and K = [K1; K2] split each head's channels in two halves of d = hd / 2 and V keeps
its hd = 2d channels, so a model keeps its heads' widths and parameter count (the paper halves the heads instead:
its h = d_model / 2d heads of 2d-wide values are our n_head heads of width hd). Rows sum to 1 - lambda, not one, and
may be negative: the sink metric also scores the renormalised map |A| / sum |A| (Sink*), as for the other
unnormalised operations.

As in the paper and its reference code (microsoft/unilm, Diff-Transformer): the four lambda vectors (d channels each)
are shared by the heads of a layer and drawn from N(0, 0.1); the output norm is an RMSNorm over each head's 2d
channels (learned gain shared by the heads, eps `model.norm_eps`), scaled by the fixed 1 - lambda_init.

Decided here (the paper leaves it open or its setup differs):
- RoPE: sinklab rotates each head's hd channels as pairs (j, j + hd/2) (rotate-half). A half takes whole pairs, so
  its logits depend on the distance only: Q1 / K1 take the even-numbered pairs, whose frequencies are exactly those of
  a d-wide RoPE head (the paper's); Q2 / K2 the odd ones. Hence hd must be a multiple of 4.
- The scale is the model's (`softmax_scale / sqrt(hd)`) times sqrt(2), i.e. 1 / sqrt(d) for the d-wide halves.
- A V bias (`model.attn_bias=v`) is added after the output norm (the norm belongs to the operation); a K / KV bias
  slot is split into halves like every key.
- The fused path runs both softmax maps through SDPA (`model.attn_backend=sdpa`), as the reference's two
  flash-attention calls; FlexAttention and the explicit backend take the explicit maps.
"""
from __future__ import annotations

import math
from typing import Any, Optional

import torch
from torch import nn

from ..backends import AttentionBackend
from ..masks import Layout
from ..registry import ATTENTION_OPS, ConfigError
from .base import AttentionOp


def lambda_init(layer: int) -> float:
    """The paper's depth schedule, layer counted from 0 here (the paper's l - 1): 0.2 at the first layer, -> 0.8."""
    return 0.8 - 0.6 * math.exp(-0.3 * layer)


def halves(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., hd) -> the two halves (..., hd/2) of whole rotary pairs: even-numbered pairs, odd-numbered pairs."""
    # channel c = a * hd/2 + 2 m + p belongs to pair j = 2 m + p (a: which member of the pair); half p keeps p
    pairs = x.unflatten(-1, (2, x.shape[-1] // 4, 2))  # (..., 2, hd/4, 2)
    return pairs[..., 0].flatten(-2), pairs[..., 1].flatten(-2)  # (..., hd/2) each, still rotate-half ordered


@ATTENTION_OPS.register("differential")
class DifferentialAttention(AttentionOp):
    """Two softmax maps per head, subtracted with a learned lambda; the output RMS-normed per head, x (1 - l_init)."""

    def __init__(self, cfg: Any):
        super().__init__(cfg)
        d = cfg.hd // 2
        self.lambda_q1, self.lambda_k1, self.lambda_q2, self.lambda_k2 = (nn.Parameter(torch.zeros(d))
                                                                          for _ in range(4))
        self.subln = nn.RMSNorm(cfg.hd, eps=cfg.norm_eps)
        self.lambda_init = lambda_init(0)
        self.init_parameters()

    def bind_layer(self, layer: int) -> None:
        self.lambda_init = lambda_init(layer)

    @classmethod
    def validate(cls, cfg: Any) -> None:
        if cfg.hd % 4:
            raise ConfigError(f"model.attn_op=differential splits each head's queries and keys into two halves of "
                              f"whole rotary pairs: the head width {cfg.hd} (model.head_dim or d_model / n_head) must "
                              "be a multiple of 4")

    @classmethod
    def fusable(cls, cfg: Any) -> bool:
        return cfg.backend == "sdpa"

    def init_parameters(self, std: float = 0.0, bias_std: float = 0.0) -> None:
        """The reference's init, whatever the model's std: lambda vectors N(0, 0.1), the norm's gain 1."""
        for p in (self.lambda_q1, self.lambda_k1, self.lambda_q2, self.lambda_k2):
            nn.init.normal_(p, std=0.1)
        nn.init.ones_(self.subln.weight)

    def lam(self) -> torch.Tensor:
        """lambda = exp(lq1 . lk1) - exp(lq2 . lk2) + lambda_init, a scalar."""
        return (torch.exp(self.lambda_q1 @ self.lambda_k1) - torch.exp(self.lambda_q2 @ self.lambda_k2)
                + self.lambda_init)

    def fused(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: Layout, scale: float,
              backend: AttentionBackend) -> Optional[torch.Tensor]:
        (q1, q2), (k1, k2) = halves(q), halves(k)
        o1 = backend.softmax(q1, k1, v, layout, scale * math.sqrt(2))  # (B, H, N, hd)
        o2 = backend.softmax(q2, k2, v, layout, scale * math.sqrt(2))
        return None if o1 is None or o2 is None else o1 - self.lam().to(o1.dtype) * o2

    takes_selection = False  # its own probs: no per-key logits for a sparsity to select from

    def probs(self, q: torch.Tensor, k: torch.Tensor, layout: Layout, rows: torch.Tensor,
              scale: float) -> torch.Tensor:
        """q (B, H, R, hd), k (B, H, n_keys, hd) -> A1 - lambda A2 (B, H, R, n_keys), zero where not seen."""
        seen = layout.mask(rows)  # (R, n_keys)
        bias = layout.bias(rows)
        maps = []
        for qh, kh in zip(halves(q), halves(k)):
            s = (qh @ kh.transpose(-1, -2)) * (scale * math.sqrt(2))  # (B, H, R, n_keys)
            if bias is not None:
                s = s + bias.to(s.dtype)
            maps.append(torch.softmax(s.masked_fill(~seen, float("-inf")), dim=-1))
        return maps[0] - self.lam().to(maps[1].dtype) * maps[1]

    def output(self, o: torch.Tensor) -> torch.Tensor:
        """The heads' outputs (B, H, N, hd) -> (1 - lambda_init) RMSNorm(o), per head over its hd channels."""
        return self.subln(o) * (1.0 - self.lambda_init)
