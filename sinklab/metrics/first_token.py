"""Qwen's first-token attention (arXiv 2505.06708, reported beside Sink_1): the mean over queries i of A[i, 1],
overall and per layer. It is alpha_1 exactly (the mean over all real queries i = 1..T, query 1 included, averaged
over heads and sequences; the paper does not say whether it drops query 1): the `sink` metric's column sums, logged
under Qwen's name (act/first_token_attn, act/layer<i>/first_token_attn)."""
from __future__ import annotations

from dataclasses import replace
from typing import Any

from sinklab.keys import ACT_PREFIX

from .base import ANY, METRICS, Context
from .sink import SinkMetric


@METRICS.register("first_token_attn")
class FirstTokenAttention(SinkMetric):
    bounds = ((r"^act/(layer\d+/)?first_token_attn$", ANY),)  # as sink/alpha: unbounded for kernel maps
    json_key = "first_token_attn"
    headline = ("act/first_token_attn",)

    def __init__(self, ctx: Context):
        # the sink metric's sums for the first k tokens (the same reductions: bit for bit its alpha_1), no Sink*
        super().__init__(replace(ctx, row_normalised=True))

    def log(self, result: dict[str, Any]) -> dict[str, float]:
        j = self.json(result)
        return {ACT_PREFIX + "first_token_attn": j["mean"],
                **{f"{ACT_PREFIX}layer{i}/first_token_attn": v for i, v in enumerate(j["by_layer"])}}

    def json(self, result: dict[str, Any]) -> dict[str, Any]:
        alpha = result["scores"].alpha  # (N, L, H, 1)
        return {"mean": alpha[..., 0].mean().item(), "by_layer": alpha[..., 0].mean(dim=(0, 2)).tolist()}

    @classmethod
    def text(cls, part: dict[str, Any], res: dict[str, Any]) -> list[str]:
        """The mean over layers (per layer it is the sink metric's alpha_1 table's mean column)."""
        return [f"first-token attention (alpha_1) {part['mean']:.4f}"]
