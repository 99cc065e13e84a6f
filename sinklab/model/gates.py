"""Gates on the attention output (`model.gate`): o * sigmoid(x W_g), per head (one scalar per head and token) or
elementwise (one per channel), with x the attention block's (normed) input, as the query's (Qwen's G1 position)."""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .registry import GATES, Component


@GATES.register("none")
class NoGate(Component, nn.Module):
    """No gate: the heads' outputs go to the output projection as they are."""

    def __init__(self, cfg: Any):
        super().__init__()

    llama = True

    def forward(self, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        return o


@GATES.register("headwise")
class HeadwiseGate(Component, nn.Linear):
    """One gate per head: x (B, N, d) -> (B, H, N, 1)."""

    def __init__(self, cfg: Any):
        nn.Linear.__init__(self, cfg.d_model, self.width(cfg), bias=False)
        self.hd = cfg.hd

    @staticmethod
    def width(cfg: Any) -> int:
        return cfg.n_head

    def gate(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(F.linear(x, self.weight)).transpose(1, 2).unsqueeze(-1)  # (B, N, H) -> (B, H, N, 1)

    def forward(self, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        """x (B, N, d) the block's normed input, o (B, H, N, hd) the heads' outputs."""
        return o * self.gate(x)


@GATES.register("elementwise")
class ElementwiseGate(HeadwiseGate):
    """One gate per channel: x (B, N, d) -> (B, H, N, hd)."""

    @staticmethod
    def width(cfg: Any) -> int:
        return cfg.n_head * cfg.hd

    def gate(self, x: torch.Tensor) -> torch.Tensor:
        g = torch.sigmoid(F.linear(x, self.weight))  # (B, N, H * hd)
        return g.view(g.shape[0], g.shape[1], -1, self.hd).transpose(1, 2)  # (B, H, N, hd)
