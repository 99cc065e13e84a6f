"""Key norms (`sinklab.model.cache_policies`)."""
from __future__ import annotations

import torch

from .base import CACHE_POLICIES, CachePolicy


@CACHE_POLICIES.register("keynorm")
class KeyNorm(CachePolicy):
    """The keys of lowest L2 norm (the cache's keys: before RoPE where they move, after it where they do not; a
    rotation keeps the norm)."""

    reference = ("Devoto et al. 2024, \"A Simple and Effective L2 Norm-Based Strategy for KV Cache Compression\" "
                 "(arXiv 2406.11430), and kvpress 0.5.5's KnormPress, whose kept keys these are "
                 "(tests/model/test_kvpress_parity.py)")
    differences = ("a sinklab cache that moves keys scores them before RoPE, kvpress the rotated ones: a rotation "
                   "keeps the norm, so the kept keys are the same up to rounding (no knob)",)

    def scores(self, state: dict, keys: torch.Tensor, layer: int) -> torch.Tensor:
        return -keys.float().norm(dim=-1)  # (B, Hkv, L)
