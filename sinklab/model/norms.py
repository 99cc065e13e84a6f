"""Norms (`model.norm`) and where they sit in a block (`model.norm_position`: the block classes are in
transformer.py)."""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .registry import NORMS, Component


class Norm(Component):
    """A norm over the last dimension, built as cls(d, eps)."""

    @classmethod
    def build(cls, cfg: Any) -> nn.Module:
        return cls(cfg.d_model, cfg.norm_eps)


@NORMS.register("rms")
class RMSNorm(Norm, nn.Module):
    """x / rms(x) * weight (LLaMA's)."""

    def __init__(self, d: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))

    llama = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


@NORMS.register("layer")
class LayerNorm(Norm, nn.LayerNorm):
    """LayerNorm without a bias (the reference study's)."""

    def __init__(self, d: int, eps: float = 1e-5):
        super().__init__(d, eps=eps, bias=False)
