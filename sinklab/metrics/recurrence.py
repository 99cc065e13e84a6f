"""The decay and writing statistics of a model's recurrent layers (Gated DeltaNet, gated linear attention:
sinklab/model/ops/recurrent.py), beside the sink metric, which scores their effective attention.

Per recurrent layer l and head h, over the real tokens t of the probe set (each sequence's mean, then the mean over
sequences):
    alpha(l, h)      the mean decay alpha_t = exp(-A softplus(a(x_t) + dt_bias)): 1 keeps the memory, 0 erases it
    beta(l, h)       the mean writing strength beta_t = sigmoid(b(x_t)) (Gated DeltaNet only: the delta rule's)
    half_life(l, h)  ln 2 / mean_t(-ln alpha_t): the tokens after which the memory's decay alone halves what it held,
                     at the layer's average rate (what an attention sink would have to outlive)

Applies to sinklab models with a recurrent layer only; a softmax layer has no entry (null in the JSON lists).
Logged (recur/...): alpha, beta, half_life (the means over the recurrent layers and their heads) and
recur/layer<i>/{alpha, beta, half_life}; `measure --json`: recurrence {alpha, beta, half_life, by_layer {...},
by_head {... (L, H) grids, nulls in a softmax layer's row}}.
"""
from __future__ import annotations

import math
from typing import Any, Optional

import torch

from .base import METRICS, NON_NEGATIVE, UNIT, Context, Metric, layer_table

PREFIX = "recur/"
STATS = ("alpha", "beta", "half_life")


def recurrent_layers(model: Any) -> list[int]:
    """The indices of a sinklab model's layers whose attention op is recurrent."""
    return [i for i, block in enumerate(model.blocks) if block.attn.op.recurrent]


@METRICS.register("recurrence")
class RecurrenceMetric(Metric):
    """alpha, beta and the half-life of the recurrent layers' memory (module docstring)."""

    records = frozenset({"op_tensors"})
    needs_model = True
    bounds = ((r"^recur/(layer\d+/)?(alpha|beta)$", UNIT), (r"^recur/(layer\d+/)?half_life$", NON_NEGATIVE))
    json_key = "recurrence"
    headline = ("recur/alpha", "recur/half_life")

    @classmethod
    def applies(cls, ctx: Context) -> bool:
        return ctx.model is not None and bool(recurrent_layers(ctx.model))

    def __init__(self, ctx: Context):
        super().__init__(ctx)
        self.layers = recurrent_layers(ctx.model)
        self.sums: dict[tuple[int, str], torch.Tensor] = {}  # (layer, stat) -> (B, H) per-sequence means
        self.batches: list[dict[tuple[int, str], torch.Tensor]] = []

    def update(self, layer: int, rec: dict[str, Any]) -> None:
        tensors = rec.get("op_tensors") or {}
        if layer not in self.layers:
            return
        log_alpha = tensors["decay"][..., 0].double()  # (B, H, T)
        self.sums[layer, "alpha"] = log_alpha.exp().mean(-1)  # (B, H)
        self.sums[layer, "neg_log_alpha"] = -log_alpha.mean(-1)
        if "beta" in tensors:
            self.sums[layer, "beta"] = tensors["beta"][..., 0].double().mean(-1)

    def end_batch(self) -> None:
        if self.sums:
            self.batches.append({key: v.cpu() for key, v in self.sums.items()})
        self.sums = {}

    def result(self) -> dict[str, Any]:
        L = len(self.ctx.model.blocks)
        none = [None] * self.ctx.n_head  # a softmax layer's row of the grids
        by_head: dict[str, list] = {s: [none] * L for s in STATS}
        for layer in self.layers:
            per = {name: torch.cat([b[layer, name] for b in self.batches]).mean(0)  # (H,): the mean over sequences
                   for name in ("alpha", "neg_log_alpha", "beta") if (layer, name) in self.batches[0]}
            by_head["alpha"][layer] = per["alpha"].tolist()
            by_head["half_life"][layer] = [half_life(v) for v in per["neg_log_alpha"].tolist()]
            by_head["beta"][layer] = per["beta"].tolist() if "beta" in per else none
        by_layer = {s: [mean(h) for h in by_head[s]] for s in STATS}
        overall = {s: mean([v for h in by_head[s] if h is not None for v in h]) for s in STATS}
        return {**overall, "by_layer": by_layer, "by_head": by_head}

    @staticmethod
    def flatten(result: dict[str, Any]) -> dict[str, float]:
        out = {PREFIX + s: result[s] for s in STATS if result[s] is not None}
        for s in STATS:
            out.update({f"{PREFIX}layer{i}/{s}": v for i, v in enumerate(result["by_layer"][s]) if v is not None})
        return out

    @classmethod
    def text(cls, part: dict[str, Any], res: dict[str, Any]) -> list[str]:
        layers = part["by_layer"]
        return ["recurrent layers (mean over heads, tokens and sequences; - for a softmax layer): decay alpha, "
                "writing strength beta, half-life of the memory in tokens",
                *layer_table([("alpha", layers["alpha"], 7, 3), ("beta", layers["beta"], 7, 3),
                              ("half-life", layers["half_life"], 9, 1)],
                             overall=[part["alpha"], part["beta"], part["half_life"]])]


def half_life(neg_log_alpha: float) -> Optional[float]:
    """ln 2 / mean(-ln alpha) in tokens; None where the memory does not decay (strict JSON has no infinity)."""
    return math.log(2) / neg_log_alpha if neg_log_alpha > 0 else None


def mean(values: Optional[list]) -> Optional[float]:
    """The mean of the numbers of a list (None entries left out), None for none."""
    numbers = [v for v in values or () if v is not None]
    return sum(numbers) / len(numbers) if numbers else None
