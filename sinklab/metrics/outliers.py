"""Residual sinks (arXiv 2601.22966, "A Unified View of Attention and Residual Sinks") and activation outliers
(Bondarenko et al. 2023, "Quantizable Transformers").

The `outliers` metric (registered here) and per-batch functions of the recorded forward, shared with the
`residual_sinks` metric (`residual_sinks.py`):
- `channel_means`: per sequence, each channel's mean |h_j| over the real tokens. Averaged over sequences (all of the
  same length) it is the paper's H_avg over all probe tokens; `residual_sink_summary` reduces it to the top
  channel, its ratio to the median channel, and how many layers share the top channel.
- `outlier_stats`: Bondarenko's inf-norm and kurtosis of one sequence's activations, and their median magnitude.
- `norm_weight_minima`: the smallest |weight| of every norm (RMSNorm's "collapse" in the residual-sink paper).

Choices the papers leave open, and the ones made here:
- Attention output: the output of the attention module, after the output projection (and after any gate), as
  Bondarenko's code hooks `self_attn.out_proj`; not the heads before o_proj.
- Kurtosis: as Bondarenko's code, over the flattened (T, d) activations of one sequence, mu_4 / (s^4 + 1e-6) with s
  the unbiased standard deviation (not the excess: a Gaussian gives 3), then averaged over sequences. Their
  inf-norm is likewise per sequence (max |x| over its tokens and channels), averaged over sequences.
- Norm weights: the minimum of |w| (a weight that changed sign is not collapsed; |w| near 0 is the collapse), over
  the 1-D parameters named `weight` in the norm's module (its own, or those of a norm it wraps); None for a norm
  without one.
"""
from __future__ import annotations

from typing import Any, Optional

import numpy as np
import torch
from einops import rearrange
from torch import nn

from sinklab.keys import ACT_PREFIX

from .base import METRICS, LayerMeans, NON_NEGATIVE, Context, Metric, layer_logs, layer_table

KURTOSIS_EPS = 1e-6  # Bondarenko's


def kurtosis(x: torch.Tensor) -> torch.Tensor:
    """x (B, ...) -> (B,): mu_4 / (s^4 + eps) of each sequence's values, s^2 the unbiased variance."""
    flat = x.reshape(x.shape[0], -1).float()  # (B, n)
    centred = flat - flat.mean(-1, keepdim=True)
    sq = centred * centred  # squared twice rather than ** 4: five times faster in float32 on a CPU
    var = sq.sum(-1) / (flat.shape[1] - 1)
    return (sq * sq).mean(-1) / (var * var + KURTOSIS_EPS)


def lower_median(x: torch.Tensor) -> torch.Tensor:
    """x (..., n) -> (...): the median over the last axis, the lower of the two middle values for an even n, NaN in
    a row with a NaN; the values of `x.median(-1).values`. On the CPU in float32 / float64 it is numpy's
    `partition` (introselect), about ten times faster there than torch.median, which was the largest single cost of
    the training callback's measurement (a median over each sequence's T x d activations, per layer); elsewhere
    torch.median."""
    n = x.shape[-1]
    if x.device.type != "cpu" or x.dtype not in (torch.float32, torch.float64) or n == 0 or x.numel() == 0:
        return x.median(-1).values
    k = (n - 1) // 2  # the lower middle, as torch.median
    values = x.detach().numpy()
    middle = np.partition(values, k, axis=-1)[..., k]  # numpy orders NaN last, torch.median returns it
    return torch.from_numpy(np.where(np.isnan(values).any(-1), np.nan, middle).astype(values.dtype, copy=False))


def outlier_stats(x: torch.Tensor) -> dict[str, torch.Tensor]:
    """Activations x (B, T, d) of the real tokens -> per sequence (B,): inf (max |x|), median (median |x|, the lower
    one for an even count, as torch.median), kurt (`kurtosis`)."""
    flat = rearrange(x.float().abs(), "b t d -> b (t d)")
    return {"inf": flat.amax(-1), "median": lower_median(flat), "kurt": kurtosis(x)}


def channel_means(h: torch.Tensor) -> torch.Tensor:
    """Residual stream h (B, T, d) -> (B, d): mean_t |h_t,j| per sequence."""
    return h.float().abs().mean(1)


def residual_sink_summary(h_avg: torch.Tensor) -> dict[str, list]:
    """H_avg (L, d) -> per layer resid_sink_top (the largest H_avg_j), resid_sink_channel (its j, 0-indexed),
    resid_sink_ratio (top / median_j H_avg_j, the lower median), and resid_sink_channel_share: the share of layers
    whose top channel is the most common top channel (1 when every layer has the same one; the smallest channel on
    a tie, as torch.mode)."""
    top, channel = h_avg.max(-1)  # (L,), (L,)
    median = h_avg.median(-1).values
    share = (channel == channel.mode().values).float().mean()
    return {"resid_sink_top": top.tolist(), "resid_sink_channel": channel.tolist(),
            "resid_sink_ratio": (top / median.clamp_min(1e-12)).tolist(),
            "resid_sink_channel_share": share.item()}


def weight_min(norm: nn.Module) -> Optional[float]:
    """min |w| over the 1-D parameters named `weight` under `norm`; None when it has none (e.g. nn.Identity)."""
    weights = [p for name, p in norm.named_parameters() if name.rsplit(".", 1)[-1] == "weight" and p.dim() == 1]
    return min(w.detach().abs().min().item() for w in weights) if weights else None


def norm_weight_minima(model) -> dict:
    """attn_norm_min and ffn_norm_min: per layer, `weight_min` of the block's norm1 (before attention; after it in a
    post-norm block) and norm2 (around the FFN); final_norm_min: of the final norm (None in post-norm models)."""
    return {"attn_norm_min": [weight_min(b.norm1) for b in model.blocks],
            "ffn_norm_min": [weight_min(b.norm2) for b in model.blocks],
            "final_norm_min": weight_min(model.norm)}


KEYS = ("resid_inf_norm", "resid_kurtosis", "attn_inf_norm", "attn_kurtosis", "attn_top_median")
MAX_OVER_LAYERS = ("resid_inf_norm", "attn_inf_norm", "attn_top_median")  # Bondarenko's "max inf. norm"
MEAN_OVER_LAYERS = ("resid_kurtosis", "attn_kurtosis")  # Bondarenko's "avg. kurtosis"


@METRICS.register("outliers")
class Outliers(Metric):
    """Per layer, means over sequences of the residual stream's and the attention output's inf-norm and kurtosis,
    and attn_top_median: the largest |a| over sequences / the mean median |a| (as massive_ratio)."""

    records = frozenset({"h", "attn"})
    bounds = ((r"^act/(layer\d+/)?(resid|attn)_(inf_norm|kurtosis|top_median)$", NON_NEGATIVE),)
    json_key = "outliers"
    headline = ("act/resid_kurtosis", "act/attn_kurtosis")
    NAMES = {"inf": "resid_inf_norm", "kurt": "resid_kurtosis", "attn_inf": "attn_inf_norm",
             "attn_median": "attn_median", "attn_kurt": "attn_kurtosis"}

    def __init__(self, ctx: Context):
        super().__init__(ctx)
        self.means = LayerMeans()
        self.peaks: dict[int, torch.Tensor] = {}  # this batch's max |a| per sequence, per layer
        self.attn_top: Optional[torch.Tensor] = None  # (L,): max |a| over sequences

    def update(self, layer: int, rec: dict[str, torch.Tensor]) -> None:
        h = rec["h"]
        values = {"inf": rearrange(h.float().abs(), "b t d -> b (t d)").amax(-1), "kurt": kurtosis(h)}
        if "attn" in rec:
            a = {f"attn_{name}": v for name, v in outlier_stats(rec["attn"]).items()}
            values.update(a)
            self.peaks[layer] = a["attn_inf"]
        self.means.add(layer, values)

    def end_batch(self) -> None:
        self.means.end_batch()
        if self.peaks and "attn_inf" in self.means:
            peak = torch.stack([self.peaks[i] for i in sorted(self.peaks)], 1).amax(0).cpu()  # (B, L) -> (L,)
            self.attn_top = peak if self.attn_top is None else torch.maximum(self.attn_top, peak)
        self.peaks = {}

    def result(self) -> dict[str, Any]:
        out = {key: self.means.mean(name).tolist() for name, key in self.NAMES.items()
               if name in self.means and key != "attn_median"}
        if self.attn_top is not None:
            out["attn_top_median"] = (self.attn_top / self.means.mean("attn_median").clamp_min(1e-12)).tolist()
        return out

    @staticmethod
    def flatten(result: dict[str, Any]) -> dict[str, float]:
        out = {ACT_PREFIX + key: float(max(result[key])) for key in MAX_OVER_LAYERS if key in result}
        out.update({ACT_PREFIX + key: float(sum(result[key]) / len(result[key]))
                    for key in MEAN_OVER_LAYERS if key in result})
        return {**out, **layer_logs(result, KEYS)}

    def json(self, result: dict[str, Any]) -> dict[str, Any]:
        return {key: result[key] for key in KEYS if key in result}

    @classmethod
    def text(cls, part: dict[str, Any], res: dict[str, Any]) -> list[str]:
        columns = (("|h| inf", "resid_inf_norm", 9, 3), ("kurt h", "resid_kurtosis", 8, 1),
                   ("|a| inf", "attn_inf_norm", 9, 3), ("kurt a", "attn_kurtosis", 8, 1),
                   ("a top/med", "attn_top_median", 9, 1))
        return ["outliers per layer (means over sequences; h: residual stream, a: attention output)",
                *layer_table([(head, part.get(key) or [], width, prec) for head, key, width, prec in columns])]
