"""SnapKV's pooled window votes, and PyramidKV's per-layer budgets over them (`sinklab.model.cache_policies`)."""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

from sinklab.errors import UserError

from .base import CACHE_POLICIES, CachePolicy, grown, newest, with_kept

POOLINGS = ("reference", "sinklab")  # SnapKV's `pooling` knob: the reference code's rule, or sinklab's earlier one
SCHEDULES = ("pyramidkv", "kvpress")  # PyramidKV's `schedule` knob: whose per-layer sizes


@CACHE_POLICIES.register("snapkv")
class SnapKV(CachePolicy):
    """The attention of the last `window` queries (state `rows`, (B, Hkv, window, L)), summed (the votes) and
    average-pooled over `kernel` keys; the window's keys always kept. `pooling` says which keys are pooled and how the
    edges count: "reference" (the default), the votes of the keys before the window only, the zero padding counted in
    the mean, as the SnapKV, PyramidKV and kvpress code pool; "sinklab", every key's votes, the window's included,
    the padding left out of the mean (sinklab's rule before the knob)."""

    needs_maps = True
    rules = ("pooling",)
    reference = ("SnapKV (Li et al., arXiv 2404.14469; the FasterDecoding/SnapKV code's snapkv_utils.py) and kvpress "
                 "0.5.5's SnapKVPress, whose kept keys pooling=reference keeps (tests/model/test_kvpress_parity.py)")
    differences = (
        "pooling=sinklab (not the default; sinklab's rule until the knob came, which the retrieval results of "
        "experiments/cpu/RESULTS.md section 12 used): the window's votes are pooled with the keys before it, and "
        "the zero padding is left out of the mean, where the reference code divides by the kernel at the edges too. "
        "With a kernel of 5 the reference rule divides the first key's votes and its two neighbours' by 5, sinklab's "
        "by 3, so the first text token (a sink) survives far more often under sinklab's rule",
        "votes are summed over the window's queries and over a GQA group's query heads; kvpress averages both (the "
        "same order of keys, so the same keys up to rounding)",
        "window 8 by default (the SnapKV and kvpress code: 64), scaled to contexts of 64-128 tokens",
        "under the decoding protocol the rule runs after every token on the last `window` queries seen; SnapKV "
        "compresses once, after the prompt (sinklab's prefill protocol)")

    def __init__(self, budget: int, window: int = 8, kernel: int = 5, pooling: str = "reference"):
        super().__init__(budget)
        if not 1 <= window <= budget:
            raise UserError(f"cache policy {self.name}: window {window} must be in [1, budget {budget}] (its keys "
                            "are always kept)")
        if kernel < 1 or kernel % 2 == 0:
            raise UserError(f"cache policy {self.name}: kernel {kernel} must be an odd number >= 1")
        self.one_of("pooling", pooling, POOLINGS)
        self.window, self.kernel, self.pooling = window, kernel, pooling

    def observe(self, state: dict, probs: torch.Tensor) -> None:
        B, Hkv, N, L = probs.shape
        rows = grown(state.get("rows"), (B, Hkv, 0 if state.get("rows") is None else state["rows"].shape[2], L), probs)
        state["rows"] = torch.cat([rows, probs], dim=2)[:, :, -self.window:]  # (B, Hkv, <= window, L)

    def pooled(self, state: dict) -> torch.Tensor:
        """(B, Hkv, L) the pooled votes (`pooling`); the reference rule leaves the window's keys at +inf."""
        votes = state["rows"].sum(2)  # (B, Hkv, L)
        B, Hkv, L = votes.shape
        past = L if self.pooling == "sinklab" else max(L - self.window, 0)  # the keys pooled
        if past == 0:
            return votes.new_full(votes.shape, math.inf)
        pooled = F.avg_pool1d(votes[..., :past].reshape(B * Hkv, 1, past), self.kernel, stride=1,
                              padding=self.kernel // 2, count_include_pad=self.pooling == "reference")
        return F.pad(pooled.view(B, Hkv, past), (0, L - past), value=math.inf)

    def scores(self, state: dict, keys: torch.Tensor, layer: int) -> torch.Tensor:
        return with_kept(self.pooled(state), newest(keys.shape[2], self.window, keys))


@CACHE_POLICIES.register("pyramidkv")
class PyramidKV(SnapKV):
    """SnapKV under per-layer budgets that shrink linearly with depth (`schedule`). "pyramidkv" (the default, the
    PyramidKV code's sizes): beyond the window, layer l keeps max - l * step keys, from max at the first layer to
    min = (budget - window) // beta at the last, their mean over the layers (budget - window), the window on top;
    where max is more than the prompt holds, max is what it holds and min rises to keep the mean. "kvpress" (kvpress's
    PyramidKVPress): the same pyramid over the whole budget, the window inside it (min = budget / beta), and SnapKV's
    uniform budget wherever min < window."""

    rules = ("pooling", "schedule")
    prefill_only = True  # its per-layer budgets are set once, after the prompt
    per_layer = True
    reference = ("PyramidKV (Cai et al., arXiv 2406.02069; the PyramidKV / KVCache-Factory code's "
                 "pyramidkv_utils.py, PyramidKVCluster) for the per-layer sizes, SnapKV's scores; kvpress 0.5.5's "
                 "PyramidKVPress, whose kept keys schedule=kvpress pooling=reference keeps "
                 "(tests/model/test_kvpress_parity.py)")
    differences = (
        *SnapKV.differences,
        "schedule=pyramidkv (the default) is the PyramidKV code's, the window on top of the pyramid, but its step "
        "between layers is real-valued and rounded per layer where the code floors it (so the mean is the budget), "
        "and the code's short-prompt cases are left out (shorter than 2 (budget - window): SnapKV's uniform budget; "
        "shorter than the budget: nothing evicted)",
        "schedule=kvpress is kvpress's PyramidKVPress: the window inside the pyramid (its last layer keeps "
        "budget / beta keys, the window included, before the clamp to the prompt), SnapKV's uniform budget "
        "wherever that is below the window (at kvpress's window 64 and beta 20, a budget under 1280 unless the "
        "prompt is short enough to clamp max), and with one layer its max, not the budget")

    def __init__(self, budget: int, window: int = 8, kernel: int = 5, beta: float = 20.0, pooling: str = "reference",
                 schedule: str = "pyramidkv"):
        super().__init__(budget, window, kernel, pooling)
        if beta < 1:
            raise UserError(f"cache policy {self.name}: beta {beta} must be >= 1 (the first layer's share over the "
                            "last's)")
        self.one_of("schedule", schedule, SCHEDULES)
        self.beta, self.schedule = beta, schedule

    def capacity(self, layer: int, n_layer: int, n_text: Optional[int] = None) -> int:
        if self.schedule == "kvpress":
            return self.kvpress_capacity(layer, n_layer, n_text)
        if n_layer == 1:
            return self.budget
        spare = self.budget - self.window
        low = int(spare / self.beta)
        high = 2 * spare - low
        if n_text is not None and high > n_text - self.window:  # the first layers cannot keep more than there is
            high = n_text - self.window
            low = 2 * spare - high
        step = (high - low) / (n_layer - 1)
        return self.window + int(round(high - layer * step))

    def kvpress_capacity(self, layer: int, n_layer: int, n_text: Optional[int]) -> int:
        """kvpress's PyramidKVPress.get_layer_budget with q_len (1 - compression_ratio) = budget, q_len = n_text (None:
        a bound for every prompt, twice the budget: a layer keeps at most max <= 2 budget - window)."""
        if n_text is None:
            return 2 * self.budget
        low = self.budget / self.beta
        high = 2 * self.budget - low
        if high >= n_text - self.window:
            high = n_text - self.window
            low = 2 * self.budget - high
        if not n_text >= high >= low >= self.window:
            return self.budget  # kvpress falls back to SnapKV's uniform budget
        step = (high - low) / (n_layer - 1) if n_layer > 1 else 0.0
        return round(high - layer * step)
