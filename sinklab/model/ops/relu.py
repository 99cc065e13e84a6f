"""ReLU attention: relu(q.k / sqrt(d_h)) on the visible keys, rows optionally normalised (`model.attn_normalize`).
A known operation without attention sinks: a head can give every key exactly zero (Bondarenko et al. 2023 discuss
such "no-op" heads; arXiv 2601.22966 lists it among the sink-free operations)."""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ..registry import ATTENTION_OPS
from .base import NormalisableOp


@ATTENTION_OPS.register("relu")
class ReLUAttention(NormalisableOp):
    """relu(logit) per key; a row of zeros is allowed, so rows sum to one only when normalised (and not all zero)."""

    @classmethod
    def row_normalised(cls, cfg: Any) -> bool:
        return False  # a row whose logits are all negative stays zero, normalised or not

    def normalise(self, s: torch.Tensor, seen: torch.Tensor) -> torch.Tensor:
        return self.rows_to_one(F.relu(s) * seen)
