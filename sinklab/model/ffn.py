"""Feed-forward networks (`model.ffn`): ungated d -> d_ff -> d, or gated act(x W1) * (x W3) W2 (GLU variants)."""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from .registry import FFNS, Component


class MLP(Component, nn.Module):
    """act(x W1) W2."""

    act: Callable[[torch.Tensor], torch.Tensor] = staticmethod(F.relu)
    gated = False

    def __init__(self, d: int, d_ff: int):
        super().__init__()
        self.w1 = nn.Linear(d, d_ff, bias=False)
        self.w3 = nn.Linear(d, d_ff, bias=False) if self.gated else None
        self.w2 = nn.Linear(d_ff, d, bias=False)

    @classmethod
    def build(cls, cfg: Any) -> "MLP":
        return cls(cfg.d_model, cfg.d_ff)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.w1(x))
        if self.gated:
            h = h * self.w3(x)
        return self.w2(h)


class GatedMLP(MLP):
    """act(x W1) * (x W3) W2."""

    gated = True


@FFNS.register("relu")
class ReLU(MLP):
    """relu(x W1) W2."""

    act = staticmethod(F.relu)


@FFNS.register("gelu")
class GELU(MLP):
    """gelu(x W1) W2."""

    act = staticmethod(F.gelu)


@FFNS.register("swish")
class Swish(MLP):
    """silu(x W1) W2."""

    act = staticmethod(F.silu)


@FFNS.register("reglu")
class ReGLU(GatedMLP):
    """relu(x W1) * (x W3) W2."""

    act = staticmethod(F.relu)


@FFNS.register("geglu")
class GeGLU(GatedMLP):
    """gelu(x W1) * (x W3) W2."""

    act = staticmethod(F.gelu)


@FFNS.register("swiglu")
class SwiGLU(GatedMLP):
    """silu(x W1) * (x W3) W2, LLaMA's."""

    act = staticmethod(F.silu)

    @classmethod
    def llama_ok(cls, cfg: Any) -> bool:
        return True
