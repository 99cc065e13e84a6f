"""Query/key norms (`model.qk_norm`): `none` (LLaMA's), or `rms`, QK-norm as OLMo 2, Qwen3 and Gemma 3 have it.

`rms`: an RMSNorm with a learned scale over the head dimension of every query head and every key head, applied to
the q and k projections before RoPE: q_h <- q_h / rms(q_h) * w_q, k_h <- k_h / rms(k_h) * w_k (w_q, w_k of size
head_dim, shared by the heads, initialised to one; eps model.norm_eps). This is Qwen3's form (`Qwen3Attention`:
q_norm / k_norm over head_dim, before the rotary embedding). OLMo 2 normalises the whole projection (all heads
together, a scale per channel of d_model); the per-head form is the one asked for here. Decided here: with a gate at
G3 / G4 (`model.gate_position`), the norm comes first and the gate multiplies the normalised keys / queries (the
other order would undo a head-wise gate). The logits of a head are then bounded by |w_q| |w_k| * scale: the softmax
can no longer grow one key's logit without bound, which is why QK-norm is said to tame attention-logit growth.

LLaMA has no QK-norm: export-hf refuses `qk_norm=rms` (`llama_ok`).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .registry import QK_NORMS, Component


@QK_NORMS.register("none")
class NoQKNorm(Component, nn.Module):
    """queries and keys as projected (LLaMA's)"""

    llama = True

    def __init__(self, cfg: Any):
        super().__init__()

    def q(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., hd) per head -> the same, normalised where a norm is selected."""
        return x

    k = q


@QK_NORMS.register("rms")
class RMSQKNorm(NoQKNorm):
    """RMSNorm with a learned scale over each head's queries and keys, before RoPE (OLMo 2 / Qwen3 QK-norm)"""

    llama = False

    def __init__(self, cfg: Any):
        super().__init__(cfg)
        self.q_norm = nn.RMSNorm(cfg.hd, eps=cfg.norm_eps)
        self.k_norm = nn.RMSNorm(cfg.hd, eps=cfg.norm_eps)

    def q(self, x: torch.Tensor) -> torch.Tensor:
        return self.q_norm(x)

    def k(self, x: torch.Tensor) -> torch.Tensor:
        return self.k_norm(x)
