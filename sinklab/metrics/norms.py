"""The first token's norms and angles (Gu et al., ICLR 2025, section 3): per layer, means over sequences of
h1_norm_ratio = ||h_1|| / mean_{t>1} ||h_t|| (residual stream), k1_norm_ratio and v1_norm_ratio (keys after RoPE and
values, all heads), cos_q_k1 = mean_{t>1} cos(q_t, k_1) and cos_q_kj = mean_{t>1} mean_{1<j<=t} cos(q_t, k_j). The
key statistics need the queries, keys and values (left out for a Hugging Face layout `sinklab.targets.transformers_recorder`
cannot reproduce). Logged: h1_norm_ratio of the last layer, the others' means over layers, and per layer all five."""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from sinklab.keys import ACT_PREFIX

from .activations import h1_ratio, qkv_stats
from .base import METRICS, LayerMeans, NON_NEGATIVE, Context, Metric, layer_logs, layer_table

NAMES = {"h1": "h1_norm_ratio", "k1": "k1_norm_ratio", "v1": "v1_norm_ratio", "cos1": "cos_q_k1", "cosj": "cos_q_kj"}
KEYS = tuple(NAMES.values())
COLUMNS = {"h1_norm_ratio": ("||h1||/mean", 11), "k1_norm_ratio": ("||k1||/mean", 11),
           "v1_norm_ratio": ("||v1||/mean", 11), "cos_q_k1": ("cos(q,k1)", 9), "cos_q_kj": ("cos(q,kj)", 9)}


@METRICS.register("norms")
class FirstTokenNorms(Metric):
    records = frozenset({"h", "q", "k", "v"})
    bounds = ((r"^act/(layer\d+/)?cos_q_k[1j]$", (-1.0, 1.0)),
              (r"^act/(layer\d+/)?[hkv]1_norm_ratio$", NON_NEGATIVE))
    json_key = "norms"
    headline = ("act/h1_norm_ratio", "act/cos_q_k1")

    def __init__(self, ctx: Context, chunk: int = 128):
        super().__init__(ctx)
        self.means, self.chunk = LayerMeans(), chunk

    def update(self, layer: int, rec: dict[str, torch.Tensor]) -> None:
        values = {"h1": h1_ratio(rec["h"])}
        if all(n in rec for n in ("q", "k", "v")):
            values.update(qkv_stats(rec["q"], rec["k"], rec["v"], self.chunk))
        self.means.add(layer, values)

    def end_batch(self) -> None:
        self.means.end_batch()

    def result(self) -> dict[str, Any]:
        return {key: self.means.mean(name).tolist() for name, key in NAMES.items() if name in self.means}

    @staticmethod
    def flatten(result: dict[str, Any]) -> dict[str, float]:
        out = {}
        if "h1_norm_ratio" in result:
            out[ACT_PREFIX + "h1_norm_ratio"] = float(result["h1_norm_ratio"][-1])
        for key in KEYS[1:]:
            if key in result:
                out[ACT_PREFIX + key] = float(sum(result[key]) / len(result[key]))
        return {**out, **layer_logs(result, KEYS)}

    def json(self, result: dict[str, Any]) -> dict[str, Any]:
        return {key: result[key] for key in KEYS if key in result}

    @classmethod
    def text(cls, part: dict[str, Any], res: dict[str, Any]) -> list[str]:
        """Per layer every ratio and angle measured, then the key statistics' means over layers."""
        lines = ["first-token norms (against the mean of the other tokens') and angles per layer",
                 *layer_table([(head, part[key], width, 3) for key, (head, width) in COLUMNS.items() if key in part])]
        extra = [key for key in KEYS[1:] if key in part]
        if extra:
            lines += ["first-token keys and values (mean over layers): "
                      + ", ".join(f"{key} {float(np.mean(part[key])):.3f}" for key in extra)]
        return lines
