"""Per-head output norms (`model.head_norm`): `none` (LLaMA's), or `rms`, an RMSNorm over each head's output before
the output projection (issue 37, after arXiv 2605.06611, "head-wise RMSNorm on each head's output": it removes the
sink's cause and speeds up pretraining, as that paper reports).

`rms`: o_h <- o_h / rms(o_h) * w_h for every head h and token, the RMS over the head's hd channels (eps
model.norm_eps), w of shape (n_head, hd): a learned scale per head and channel, initialised to one.

Where, decided here (the paper's exact placement is not confirmed): on the attention-weighted sum as the operation
outputs it (`AttentionOp.output`: after differential attention's own per-head norm and (1 - lambda_init) scale),
before a V bias (`model.attn_bias=v`, added after the norm as differential attention adds it after its own), before
a G1 gate (`model.gate`, gates.py: the gate multiplies the normalised output, so a head-wise gate can still close a
head; the other order would undo it) and before o_proj. Every operation has that output, so the norm composes with
all of them (softmax and its variants, sigmoid, kernel, NSA's and DSA's mixed branches). Differential attention
already norms each head's output (one gain shared by the heads, times the fixed 1 - lambda_init); with `rms` a
second norm follows: it divides out that constant factor and the overall size of the shared gain (not the shape of
the gain over the channels), and its own scale per head and channel is the output's size.

LLaMA has no output norm: export-hf refuses `head_norm=rms` (`llama_ok`).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .registry import HEAD_NORMS, Component


@HEAD_NORMS.register("none")
class NoHeadNorm(Component, nn.Module):
    """each head's output as the attention computes it (LLaMA's)"""

    llama = True

    def __init__(self, cfg: Any):
        super().__init__()

    def forward(self, o: torch.Tensor) -> torch.Tensor:
        """o (B, H, N, hd) -> the same, normalised per head where a norm is selected."""
        return o


@HEAD_NORMS.register("rms")
class HeadRMSNorm(NoHeadNorm):
    """RMSNorm over each head's output (hd channels) before the output projection, a learned scale per head and
    channel (arXiv 2605.06611)"""

    llama = False

    def __init__(self, cfg: Any):
        super().__init__(cfg)
        self.eps = cfg.norm_eps
        self.weight = nn.Parameter(torch.ones(cfg.n_head, cfg.hd))  # (H, hd)

    def init_parameters(self, std: float, bias_std: float) -> None:
        """A norm's scale starts at one (not the N(0, init_std) of the model's matrices)."""
        nn.init.ones_(self.weight)

    def forward(self, o: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(o, (o.shape[-1],), eps=self.eps) * self.weight[:, None, :].to(o.dtype)
