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
        """Weights N(0, std), biases zero, in registration order."""
        for name, p in self.named_parameters():
            if name.endswith("weight"):
                nn.init.normal_(p, std=std)
            else:
                nn.init.zeros_(p)

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
    def resolve(cls, cfg: Any) -> type:
        return {"identity": KernelAttention, "elu": EluKernel, "mlp": MLPKernel}[cfg.kernel_map]

    @classmethod
    def row_normalised(cls, cfg: Any) -> bool:
        return False  # kernel maps can be negative: the metric also scores them renormalised

    def feature_map(self, x: torch.Tensor) -> torch.Tensor:
        """The identity (this class); the variants below map q and k first."""
        return x

    def row_sums_to_one(self, a: torch.Tensor) -> torch.Tensor:
        """Identity and MLP features can sum to ~0: only rows whose |sum| exceeds 1 are divided."""
        return a / a.sum(-1, keepdim=True).abs().clamp(min=1.0)

    def probs(self, q: torch.Tensor, k: torch.Tensor, layout: Layout, rows: torch.Tensor,
              scale: float) -> torch.Tensor:
        seen = layout.mask(rows)
        a = (self.feature_map(q) @ self.feature_map(k).transpose(-1, -2)) * scale * seen
        return self.row_sums_to_one(a) if self.normalize else a


class EluKernel(KernelAttention):
    """phi = elu + 1: positive features, so rows are divided by their sum."""

    def feature_map(self, x: torch.Tensor) -> torch.Tensor:
        return F.elu(x) + 1.0

    def row_sums_to_one(self, a: torch.Tensor) -> torch.Tensor:
        return a / (a.sum(-1, keepdim=True) + 1e-8)


class MLPKernel(KernelAttention):
    """phi = a per-layer MLP shared by q and k."""

    def __init__(self, cfg: Any):
        super().__init__(cfg)
        self.phi = KernelMLP(cfg.hd)

    def feature_map(self, x: torch.Tensor) -> torch.Tensor:
        return self.phi(x)
