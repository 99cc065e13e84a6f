"""The dense cache, StreamingLLM's first + recent keys and a window (`sinklab.model.cache_policies`)."""
from __future__ import annotations

from typing import Optional

import torch

from sinklab.errors import UserError

from .base import CACHE_POLICIES, CachePolicy, newest

# where a policy that moves keys differs from kvpress's presses (a press leaves each key where it came in)
POSITIONS = ("positions: a kept key moves to its place in the cache and RoPE is re-rotated there, as the StreamingLLM "
             "code does; a kvpress press leaves every key at the position it came in at unless wrapped in its "
             "KeyRerotationPress (no knob; the keys kept are the same either way)")


@CACHE_POLICIES.register("dense")
class Dense(CachePolicy):
    """Never evicts (a budget given is ignored: None)."""

    needs_budget = False
    reference = "no eviction: the full forward's keys and values"

    def __init__(self, budget: Optional[int] = None):
        super().__init__(None)


@CACHE_POLICIES.register("streaming")
class Streaming(CachePolicy):
    """The first `first` text keys and the most recent budget - first (StreamingLLM)."""

    reference = ("StreamingLLM (Xiao et al., arXiv 2309.17453; the mit-han-lab/streaming-llm code's "
                 "StartRecentKVCache) and kvpress 0.5.5's StreamingLLMPress (n_sink = first), whose kept keys are "
                 "these (tests/model/test_kvpress_parity.py)")
    differences = (POSITIONS,)

    def __init__(self, budget: int, first: int = 4):
        super().__init__(budget)
        if not 0 <= first <= budget:
            raise UserError(f"cache policy {self.name}: first {first} must be in [0, budget {budget}]")
        self.first = first

    def keep(self, state: dict, keys: torch.Tensor, layer: int, n: int) -> torch.Tensor:
        L = keys.shape[2]
        idx = torch.cat([torch.arange(self.first, device=keys.device), newest(L, n - self.first, keys)])
        return idx.expand(*keys.shape[:2], n)  # (B, Hkv, n)


@CACHE_POLICIES.register("window")
class Window(Streaming):
    """The most recent `budget` keys (window attention)."""

    reference = ("window attention, StreamingLLM's baseline (arXiv 2309.17453); kvpress 0.5.5's StreamingLLMPress "
                 "with n_sink=0 keeps these keys (tests/model/test_kvpress_parity.py)")
    differences = (POSITIONS,)

    def __init__(self, budget: int):
        super().__init__(budget, first=0)
