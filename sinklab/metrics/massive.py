"""Massive activations (Sun et al., 2024): per layer the largest |h| of the residual stream over every probe token
and channel (the max over sequences), its token (1-indexed) and channel, the mean over sequences of the median
|h|, and their ratio. Logged: act/massive_top and act/massive_ratio (max over layers), and per layer all five."""
from __future__ import annotations

from typing import Any, Optional

import torch

from sinklab.keys import ACT_PREFIX

from .activations import top_and_median
from .base import METRICS, LayerMeans, NON_NEGATIVE, Context, Metric, layer_logs, layer_table

KEYS = ("massive_top", "massive_median", "massive_ratio", "massive_token", "massive_channel")


@METRICS.register("massive")
class MassiveActivations(Metric):
    records = frozenset({"h"})
    bounds = ((r"^act/(layer\d+/)?massive_(ratio|top|median|channel|token)$", NON_NEGATIVE),)
    json_key = "massive"
    headline = ("act/massive_ratio", "act/massive_top")

    def __init__(self, ctx: Context):
        super().__init__(ctx)
        self.means = LayerMeans()
        self.tops: dict[int, torch.Tensor] = {}  # this batch's (B, 3) per layer
        self.top: Optional[torch.Tensor] = None  # (L, 3): value, token, channel

    def update(self, layer: int, rec: dict[str, torch.Tensor]) -> None:
        stats = top_and_median(rec["h"])
        self.tops[layer] = stats["top"]
        self.means.add(layer, {"median": stats["median"]})

    def end_batch(self) -> None:
        bt = torch.stack([self.tops[i] for i in sorted(self.tops)], 1).cpu()  # (B, L, 3)
        best = bt[bt[..., 0].argmax(0), torch.arange(bt.shape[1])]  # (L, 3): per layer the batch max
        self.top = best if self.top is None else torch.where(best[:, :1] > self.top[:, :1], best, self.top)
        self.tops = {}
        self.means.end_batch()

    def result(self) -> dict[str, Any]:
        top, median = self.top[:, 0].tolist(), self.means.mean("median").tolist()
        return {"massive_top": top, "massive_median": median,
                "massive_ratio": [t / max(m, 1e-12) for t, m in zip(top, median)],
                "massive_token": [int(x) for x in self.top[:, 1].tolist()],
                "massive_channel": [int(x) for x in self.top[:, 2].tolist()]}

    @staticmethod
    def flatten(result: dict[str, Any]) -> dict[str, float]:
        if "massive_top" not in result:
            return {}
        out = {ACT_PREFIX + key: float(max(result[key])) for key in ("massive_top", "massive_ratio")}
        return {**out, **layer_logs(result, KEYS)}

    def json(self, result: dict[str, Any]) -> dict[str, Any]:
        return {key.removeprefix("massive_"): result[key] for key in KEYS}

    @classmethod
    def text(cls, part: dict[str, Any], res: dict[str, Any]) -> list[str]:
        return ["massive activations per layer (residual stream of the real tokens; token 1-indexed)",
                *layer_table([("top |h|", part["top"], 10, 3), ("median", part["median"], 9, 4),
                              ("ratio", part["ratio"], 9, 1), ("token", part["token"], 6, None),
                              ("channel", part["channel"], 8, None)])]
