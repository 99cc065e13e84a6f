"""Softpick (rectified softmax): relu(e^x - 1) / sum |e^x - 1| over the visible keys; rows sum to at most one and
a head can give every key exactly zero."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..registry import ATTENTION_OPS
from .base import AttentionOp


@ATTENTION_OPS.register("softpick")
class Softpick(AttentionOp):
    """relu(e^x - 1) / sum |e^x - 1|: rows sum to at most one."""

    def normalise(self, s: torch.Tensor, seen: torch.Tensor) -> torch.Tensor:
        # shifted by m = max(0, max visible logit) for stability: the ratio is unchanged
        m = s.masked_fill(~seen, float("-inf")).amax(-1, keepdim=True).clamp(min=0).detach()
        e = (torch.exp(s - m) - torch.exp(-m)) * seen
        return F.relu(e) / (e.abs().sum(-1, keepdim=True) + 1e-6 * torch.exp(-m))
