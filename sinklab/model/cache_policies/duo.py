"""DuoAttention's per-head split (`sinklab.model.cache_policies`)."""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from sinklab.errors import UserError

from .base import CACHE_POLICIES, CachePolicy


@CACHE_POLICIES.register("duo")
class DuoAttention(CachePolicy):
    """Retrieval heads keep every key, streaming heads the first `first` + the `recent` most recent
    (`sinklab.model.cache_policies`); the budget is that of a streaming head, first + recent (recent: budget - first
    by default)."""

    needs_maps = True
    masks = True
    needs_budget = False  # first + recent
    reference = ("DuoAttention (Xiao et al., arXiv 2410.10819; mit-han-lab/duo-attention): retrieval heads keep "
                 "every key, streaming heads a sink and recent keys, their positions unchanged; not compared with "
                 "kvpress's DuoAttentionPress, which needs the hub (the published head patterns) or BookSum")
    differences = (
        "the retrieval heads: DuoAttention learns a gate per head on synthetic passkey data, and kvpress's "
        "DuoAttentionPress loads those gates or scores heads from the mean query of 50 BookSum samples; sinklab "
        "chooses them per prompt by the attention its queries so far put outside first + recent, or takes them named "
        "(`heads`, e.g. `sinklab eval retrieval --duo-heads measured`: the heads that read the key most)",)

    def __init__(self, budget: Optional[int] = None, first: int = 4, recent: Optional[int] = None,
                 retrieval: float = 0.5, heads: Optional[list] = None):
        if recent is None:  # a streaming head's recent keys: what the budget leaves after the first, else 16
            recent = 16 if budget is None else budget - first
        if first < 0 or recent < 1:
            raise UserError(f"cache policy duo: first {first} must be >= 0 and recent {recent} >= 1 (budget = first "
                            "+ recent: a streaming head's keys)")
        if not 0.0 <= retrieval <= 1.0:
            raise UserError(f"cache policy duo: retrieval {retrieval} must be in [0, 1] (the share of retrieval heads)")
        super().__init__(first + recent if budget is None else budget)
        if self.budget != first + recent:
            raise UserError(f"cache policy duo: budget {self.budget} must equal first + recent = {first + recent} "
                            "(a streaming head's keys; retrieval heads keep every one)")
        self.first, self.recent, self.retrieval = first, recent, retrieval
        self.heads = None if heads is None else [tuple(int(v) for v in h) for h in heads]

    def capacity(self, layer: int, n_layer: int, n_text: Optional[int] = None) -> Optional[int]:
        return None  # retrieval heads keep every key: nothing is gathered away

    def observe(self, state: dict, probs: torch.Tensor) -> None:
        B, Hkv, N, L = probs.shape
        lost = probs.clone()
        lost[..., :self.first] = 0
        q_pos = torch.arange(L - N, L, device=probs.device)[:, None]  # each query's own position
        k_pos = torch.arange(L, device=probs.device)[None, :]
        lost = lost.masked_fill(k_pos >= q_pos - self.recent, 0)  # the recent keys a streaming head sees
        state["lost"] = state.get("lost", 0) + lost.sum((0, 2, 3))  # (Hkv,): summed over the batch too

    def choose(self, states: Sequence[dict]) -> set:
        """(layer, kv head) of the retrieval heads: those named, or the `retrieval` share of the heads whose
        queries put the most attention where a streaming head keeps no key."""
        if self.heads is not None:
            return set(self.heads)
        ranked = sorted(((float(v), layer, h) for layer, state in enumerate(states)
                         for h, v in enumerate(state.get("lost", ()))), reverse=True)
        n = int(round(self.retrieval * len(ranked)))
        return {(layer, h) for _, layer, h in ranked[:n]}

    def mask(self, state: dict, keys: torch.Tensor, layer: int, choice: object) -> torch.Tensor:
        B, Hkv, L, _ = keys.shape
        visible = torch.zeros(B, Hkv, L, dtype=torch.bool, device=keys.device)
        visible[..., :self.first] = True
        visible[..., max(L - self.recent, 0):] = True
        for h in range(Hkv):
            if (layer, h) in choice:
                visible[:, h] = True
        return visible
