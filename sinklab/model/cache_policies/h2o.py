"""H2O's heavy hitters (`sinklab.model.cache_policies`)."""
from __future__ import annotations

import torch

from sinklab.errors import UserError

from .base import CACHE_POLICIES, CachePolicy, grown, newest, with_kept


@CACHE_POLICIES.register("h2o")
class HeavyHitters(CachePolicy):
    """The attention each key has received, summed over the queries (state `acc`; with `normalize`, divided by
    state `seen`, how many queries saw the key), plus the most recent `recent` share of the budget (H2O)."""

    needs_maps = True
    rules = ("normalize",)
    reference = ("H2O (Zhang et al., arXiv 2306.14048; FMInference/H2O): heavy hitters by the attention summed over "
                 "the queries, and recent keys; kvpress 0.5.5's ObservedAttentionPress keeps the keys of "
                 "recent=0 normalize=true (tests/model/test_kvpress_parity.py)")
    differences = (
        "normalize=false (the default, H2O's sum): a key's score is the attention summed over every query that saw "
        "it, so earlier keys, seen by more queries, gather more; kvpress's ObservedAttentionPress divides each sum "
        "by how many queries see the key (the mean attention it receives): normalize=true",
        "recent (default 0.5): H2O's recent keys as a share of the budget; kvpress's press keeps none: recent=0",
        "the decoding protocol evicts after every token with the sums so far, as H2O's generation does; kvpress "
        "compresses once, after the prompt (sinklab's prefill protocol)")

    def __init__(self, budget: int, recent: float = 0.5, normalize: bool = False):
        super().__init__(budget)
        if not 0.0 <= recent < 1.0:
            raise UserError(f"cache policy {self.name}: recent {recent} must be in [0, 1) (the recent share of the "
                            "budget; the rest are heavy hitters)")
        self.one_of("normalize", normalize, (False, True))
        self.recent, self.normalize = recent, normalize

    def observe(self, state: dict, probs: torch.Tensor) -> None:
        B, Hkv, N, L = probs.shape
        state["acc"] = grown(state.get("acc"), (B, Hkv, L), probs) + probs.sum(2)  # (B, Hkv, L)
        if self.normalize:  # the N queries are the last N places; text key j (of L) is seen by min(N, L - j)
            seen = (L - torch.arange(L, device=probs.device)).clamp(max=N).to(probs.dtype)
            state["seen"] = grown(state.get("seen"), (B, Hkv, L), probs) + seen

    def scores(self, state: dict, keys: torch.Tensor, layer: int) -> torch.Tensor:
        n_recent = int(self.recent * self.budget)
        acc = state["acc"] / state["seen"] if self.normalize else state["acc"]
        return with_kept(acc, newest(keys.shape[2], n_recent, keys))
