"""elu(q.k / sqrt(d_h)) + 1 on the visible keys, rows optionally normalised (`model.attn_normalize`)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..registry import ATTENTION_OPS
from .base import NormalisableOp


@ATTENTION_OPS.register("elu")
class EluPlusOne(NormalisableOp):
    """elu(logit) + 1 per key (positive), rows optionally normalised."""

    def normalise(self, s: torch.Tensor, seen: torch.Tensor) -> torch.Tensor:
        return self.rows_to_one((F.elu(s) + 1.0) * seen)
