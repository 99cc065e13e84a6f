"""Attention entropy: per layer and head, the mean over real queries i of H_i = -sum_j A[i, j] log A[i, j] in nats,
over every key the query sees (bias slot and sink tokens included), 0 log 0 = 0. A sink head has low entropy (its
mass on one key); a head attending uniformly to its t keys has log t. Maps whose rows do not sum to one (sigmoid,
kernel, ...) are scored renormalised, |A| / sum |A| (as Sink*), so H_i is always in [0, log(i + extra keys)].

Logged: act/attn_entropy (mean over layers, heads, queries and sequences) and act/layer<i>/attn_entropy;
`measure --json`: entropy {mean, by_layer [per layer], by_head [[per head] per layer]}.
"""
from __future__ import annotations

from typing import Any

import torch

from sinklab.keys import ACT_PREFIX

from .base import METRICS, NON_NEGATIVE, Context, Metric, layer_table
from .sink import renormalise


def row_entropy(a: torch.Tensor) -> torch.Tensor:
    """Maps (..., R, n_keys) whose rows sum to one -> (..., R): -sum_j a log a, with 0 log 0 = 0."""
    return -torch.special.xlogy(a, a).sum(-1)


@METRICS.register("entropy")
class AttentionEntropy(Metric):
    records = frozenset({"maps"})
    bounds = ((r"^act/(layer\d+/)?attn_entropy$", NON_NEGATIVE),)
    json_key = "entropy"
    headline = ("act/attn_entropy",)

    def __init__(self, ctx: Context):
        super().__init__(ctx)
        self.sums: dict[int, torch.Tensor] = {}  # layer -> (B, H) sums over query rows of this batch
        self.rows = 0
        self.batches: list[torch.Tensor] = []  # (B, L, H) mean entropy per sequence

    def update_maps(self, layer: int, rows: torch.Tensor, maps: torch.Tensor) -> None:
        a = maps.double()
        if self.ctx.row_normalised is not True:
            a = renormalise(a)
        h = row_entropy(a).sum(-1)  # (B, H, R) -> (B, H)
        self.sums[layer] = self.sums[layer] + h if layer in self.sums else h
        if layer == 0:
            self.rows += rows.numel()

    def end_batch(self) -> None:
        if self.sums:
            self.batches.append(torch.stack([self.sums[i] for i in sorted(self.sums)], 1).cpu() / self.rows)
        self.sums, self.rows = {}, 0

    def result(self) -> dict[str, Any]:
        e = torch.cat(self.batches).float()  # (N, L, H)
        return {"mean": e.mean().item(), "by_layer": e.mean(dim=(0, 2)).tolist(), "by_head": e.mean(0).tolist()}

    @staticmethod
    def flatten(result: dict[str, Any]) -> dict[str, float]:
        return {ACT_PREFIX + "attn_entropy": result["mean"],
                **{f"{ACT_PREFIX}layer{i}/attn_entropy": v for i, v in enumerate(result["by_layer"])}}

    @classmethod
    def text(cls, part: dict[str, Any], res: dict[str, Any]) -> list[str]:
        """Per layer the mean over heads and the lowest and highest head (a sink head is low); over all layers."""
        heads = part["by_head"]  # [[per head] per layer]
        every = [h for layer in heads for h in layer]
        return ["attention entropy per layer (nats, mean over queries and sequences): heads' mean, lowest, highest",
                *layer_table([("mean", part["by_layer"], 7, 3), ("lowest", [min(layer) for layer in heads], 7, 3),
                              ("highest", [max(layer) for layer in heads], 7, 3)],
                             overall=[part["mean"], min(every, default=None), max(every, default=None)])]
