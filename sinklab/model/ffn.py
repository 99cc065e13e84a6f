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


def activation_variant(name: str, base: type, act: Callable[[torch.Tensor], torch.Tensor]) -> type:
    """Register `base` with activation `act` under `name` (a subclass named after it)."""
    doc = f"{act.__name__}(x W1)" + (" * (x W3)" if base.gated else "") + " W2."
    return FFNS.register(name)(type(name, (base,), {"act": staticmethod(act), "__doc__": doc, "__module__": __name__}))


for _name, _base, _act in (("relu", MLP, F.relu), ("gelu", MLP, F.gelu), ("swish", MLP, F.silu),
                           ("reglu", GatedMLP, F.relu), ("geglu", GatedMLP, F.gelu)):
    activation_variant(_name, _base, _act)


@FFNS.register("swiglu")
class SwiGLU(GatedMLP):
    """silu(x W1) * (x W3) W2, LLaMA's."""

    act = staticmethod(F.silu)

    llama = True
