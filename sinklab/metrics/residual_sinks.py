"""Residual sinks (arXiv 2601.22966): per layer H_avg = mean |h_j| over every probe token, its top channel, the
top's ratio to the median channel, the share of layers that share the top channel, and (sinklab models) the
smallest |weight| of every norm ("collapse"). See `sinklab.metrics.outliers` for the formulas and choices.
Logged: act/resid_sink_ratio (max over layers), act/resid_sink_channel_share, act/final_norm_min, act/norm_min (the
smallest of every norm's), and per layer resid_sink_top, resid_sink_channel, resid_sink_ratio, attn_norm_min,
ffn_norm_min."""
from __future__ import annotations

from typing import Any

import torch

from sinklab.keys import ACT_PREFIX

from .base import METRICS, LayerMeans, NON_NEGATIVE, UNIT, Context, Metric, layer_logs, layer_table
from .outliers import channel_means, norm_weight_minima, residual_sink_summary

PER_LAYER = ("resid_sink_top", "resid_sink_channel", "resid_sink_ratio", "attn_norm_min", "ffn_norm_min")
# the JSON's residual_sinks object (resid_sink_ dropped from the names)
JSON_KEYS = ("h_avg", "resid_sink_top", "resid_sink_channel", "resid_sink_ratio", "resid_sink_channel_share",
             "attn_norm_min", "ffn_norm_min", "final_norm_min")


@METRICS.register("residual_sinks")
class ResidualSinks(Metric):
    records = frozenset({"h"})
    bounds = ((r"^act/resid_sink_channel_share$", UNIT),  # share of layers with the most common top channel
              (r"^act/(layer\d+/)?resid_sink_(top|channel|ratio)$", NON_NEGATIVE),  # H_avg's top channel
              (r"^act/(layer\d+/)?(attn_|ffn_|final_)?norm_min$", NON_NEGATIVE))  # min |weight| of a norm
    json_key = "residual_sinks"
    headline = ("act/resid_sink_ratio", "act/norm_min")

    def __init__(self, ctx: Context):
        super().__init__(ctx)
        self.means = LayerMeans()

    def update(self, layer: int, rec: dict[str, torch.Tensor]) -> None:
        self.means.add(layer, {"chan": channel_means(rec["h"])})

    def end_batch(self) -> None:
        self.means.end_batch()

    def result(self) -> dict[str, Any]:
        h_avg = self.means.mean("chan")  # (L, d)
        out = {"h_avg": h_avg.tolist(), **residual_sink_summary(h_avg)}
        if self.ctx.model is not None:
            out.update(norm_weight_minima(self.ctx.model))
        return out

    @staticmethod
    def flatten(result: dict[str, Any]) -> dict[str, float]:
        out = {}
        if "resid_sink_ratio" in result:
            out[ACT_PREFIX + "resid_sink_ratio"] = float(max(result["resid_sink_ratio"]))
        if "resid_sink_channel_share" in result:
            out[ACT_PREFIX + "resid_sink_channel_share"] = float(result["resid_sink_channel_share"])
        mins = [v for key in ("attn_norm_min", "ffn_norm_min") for v in result.get(key, []) if v is not None]
        if result.get("final_norm_min") is not None:
            out[ACT_PREFIX + "final_norm_min"] = float(result["final_norm_min"])
            mins.append(result["final_norm_min"])
        if mins:
            out[ACT_PREFIX + "norm_min"] = float(min(mins))
        return {**out, **layer_logs(result, PER_LAYER)}

    def json(self, result: dict[str, Any]) -> dict[str, Any]:
        return {key.removeprefix("resid_sink_"): result[key] for key in JSON_KEYS if key in result}

    @classmethod
    def text(cls, part: dict[str, Any], res: dict[str, Any]) -> list[str]:
        """Per layer the top channel of H_avg, its ratio to the median channel and (sinklab models) the norms' min
        |w|; the share of layers with the most common top channel, and the final norm's min |w|."""
        norms = [(head, part[key], width, 4) for head, key, width in
                 (("min|w| attn", "attn_norm_min", 11), ("min|w| ffn", "ffn_norm_min", 10)) if key in part]
        which = "; min |w| of the norms" if norms else ""
        lines = [f"residual sinks per layer (top channel of H_avg = mean |h_j| over tokens{which})",
                 *layer_table([("channel", part["channel"], 8, None), ("top/med", part["ratio"], 8, 1), *norms]),
                 f"top channel shared by {100 * part['channel_share']:.0f}% of layers"]
        if part.get("final_norm_min") is not None:
            lines.append(f"final norm min|w| {part['final_norm_min']:.4f}")
        return lines
