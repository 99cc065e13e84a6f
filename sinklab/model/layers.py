"""Norms and feed-forward networks, chosen by name."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def make_norm(kind: str, d: int, eps: float) -> nn.Module:
    return RMSNorm(d, eps) if kind == "rms" else nn.LayerNorm(d, eps=eps, bias=False)


_ACT = {"relu": F.relu, "gelu": F.gelu, "swish": F.silu, "reglu": F.relu, "geglu": F.gelu, "swiglu": F.silu}


class FeedForward(nn.Module):
    """Ungated (relu / gelu / swish: d -> d_ff -> d) or gated (reglu / geglu / swiglu: act(x W1) * (x W3) W2)."""

    def __init__(self, kind: str, d: int, d_ff: int):
        super().__init__()
        self.act = _ACT[kind]
        self.gated = kind.endswith("glu")
        self.w1 = nn.Linear(d, d_ff, bias=False)
        self.w3 = nn.Linear(d, d_ff, bias=False) if self.gated else None
        self.w2 = nn.Linear(d_ff, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.w1(x))
        if self.gated:
            h = h * self.w3(x)
        return self.w2(h)
