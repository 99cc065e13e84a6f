"""sigmoid(q.k / sqrt(d_h) + b) on the visible keys, rows optionally normalised (`model.attn_normalize`)."""
from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ..registry import ATTENTION_OPS
from .base import NormalisableOp


@ATTENTION_OPS.register("sigmoid")
class Sigmoid(NormalisableOp):
    """sigmoid(logit + b) per key, no competition between keys unless rows are normalised."""

    @dataclasses.dataclass
    class Knobs(NormalisableOp.Knobs):
        sigmoid_bias: float = 0.0  # b in sigmoid(q.k / sqrt(d_h) + b), e.g. -log(n)

    def __init__(self, cfg: Any):
        super().__init__(cfg)
        self.bias = cfg.sigmoid_bias

    def normalise(self, s: torch.Tensor, seen: torch.Tensor) -> torch.Tensor:
        return self.rows_to_one(torch.sigmoid(s + self.bias) * seen)
