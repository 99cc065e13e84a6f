"""Linear-attention kernels: phi(q) phi(k)^T / sqrt(d_h) on the visible keys, with phi = elu + 1, the identity or a
per-layer MLP (`model.kernel_map`), rows optionally normalised. No logits, so no ALiBi / relative bias."""
from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..masks import Layout
from ..registry import ATTENTION_OPS
from .base import NormalisableOp


class KernelMLP(nn.Module):
    """Per-layer feature map Linear - ReLU - Linear shared by q and k."""

    def __init__(self, hd: int):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(hd, hd), nn.ReLU(), nn.Linear(hd, hd))

    def init_parameters(self, std: float, bias_std: float) -> None:
        for name, p in self.named_parameters():
            nn.init.normal_(p, std=std) if name.endswith("weight") else nn.init.zeros_(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


@ATTENTION_OPS.register("kernel")
class KernelAttention(NormalisableOp):
    """phi(q) phi(k)^T on the visible keys (linear attention), phi chosen by kernel_map."""

    has_logits = False

    @dataclasses.dataclass
    class Knobs(NormalisableOp.Knobs):
        kernel_map: str = dataclasses.field(default="elu", metadata={"choices": ("identity", "elu", "mlp")})

    @classmethod
    def row_normalised(cls, cfg: Any) -> bool:
        return False  # kernel maps can be negative: the metric also scores them renormalised

    def __init__(self, cfg: Any):
        super().__init__(cfg)
        self.kernel_map = cfg.kernel_map
        if cfg.kernel_map == "mlp":
            self.phi = KernelMLP(cfg.hd)

    def feature_map(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel_map == "elu":
            return F.elu(x) + 1.0
        if self.kernel_map == "mlp":
            return self.phi(x)
        return x

    def probs(self, q: torch.Tensor, k: torch.Tensor, layout: Layout, rows: torch.Tensor,
              scale: float) -> torch.Tensor:
        seen = layout.mask(rows)
        a = (self.feature_map(q) @ self.feature_map(k).transpose(-1, -2)) * scale * seen
        if not self.normalize:
            return a
        total = a.sum(-1, keepdim=True)
        # elu + 1 features are positive; identity and MLP features can sum to ~0, so only large sums divide
        return a / (total + 1e-8) if self.kernel_map == "elu" else a / total.abs().clamp(min=1.0)
