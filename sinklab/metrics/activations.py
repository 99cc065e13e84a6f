"""Massive activations (Sun et al., 2024), the first token's norms and angles (Gu et al., section 3), residual
sinks and outliers (`sinklab.metrics.outliers`).

All from one recorded forward: per layer the block output h (residual stream), q, k, v after RoPE, and the
attention module's output. Only real tokens are scored (the bias slot and learned sink tokens are skipped); token
1 is the first real token.

The formulas live in per-batch functions shared by sinklab models (`activation_stats`) and Hugging Face models
(`sinklab.hf`): `hidden_state_stats` (massive activations, ||h_1|| ratio, H_avg, inf-norm and kurtosis),
`qkv_stats` (key and value norm ratios, query-key angles) and `outliers.outlier_stats` of the attention output;
`ActivationStats` averages them over batches into per-layer lists. The same forwards record the gate scores of a
gated model (`sinklab.metrics.gates`).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from einops import rearrange

from .gates import gate_sums, record_gates, stats_from_sums
from .outliers import channel_means, kurtosis, norm_weight_minima, outlier_stats, residual_sink_summary

# per-layer lists returned by `activation_stats` / `ActivationStats.result`, in this order
MASSIVE_KEYS = ("massive_top", "massive_median", "massive_ratio", "massive_token", "massive_channel")
NORM_KEYS = ("h1_norm_ratio", "k1_norm_ratio", "v1_norm_ratio", "cos_q_k1", "cos_q_kj")
OUTLIER_KEYS = ("resid_inf_norm", "resid_kurtosis", "attn_inf_norm", "attn_kurtosis", "attn_top_median")
RESIDUAL_SINK_KEYS = ("resid_sink_top", "resid_sink_channel", "resid_sink_ratio")
NORM_WEIGHT_KEYS = ("attn_norm_min", "ffn_norm_min")
STAT_KEYS = MASSIVE_KEYS + NORM_KEYS + OUTLIER_KEYS + RESIDUAL_SINK_KEYS + NORM_WEIGHT_KEYS
_MEAN_KEYS = {"median": "massive_median", "h1": "h1_norm_ratio", "k1": "k1_norm_ratio", "v1": "v1_norm_ratio",
              "cos1": "cos_q_k1", "cosj": "cos_q_kj", "inf": "resid_inf_norm", "kurt": "resid_kurtosis",
              "chan": "h_avg", "attn_inf": "attn_inf_norm", "attn_median": "attn_median",
              "attn_kurt": "attn_kurtosis"}  # per-sequence value -> its per-layer mean's name


def first_over_rest(norms: torch.Tensor) -> torch.Tensor:
    """norms (B, T) -> norms[:, 0] / mean_{t>1} norms[:, t], shape (B,); NaN when T = 1."""
    return norms[:, 0] / norms[:, 1:].mean(-1)


def hidden_state_stats(h: torch.Tensor) -> dict[str, torch.Tensor]:
    """Residual stream h (B, T, d) of the real tokens -> per sequence:
    top (B, 3): max |h|, its token (1-indexed) and channel (0-indexed); inf (B,): max |h| (Bondarenko's inf-norm);
    median (B,): median |h|; h1 (B,): ||h_1|| / mean_{t>1} ||h_t||; kurt (B,): `outliers.kurtosis`;
    chan (B, d): `outliers.channel_means`."""
    h = h.float()
    d = h.shape[-1]
    flat = rearrange(h.abs(), "b t d -> b (t d)")
    val, pos = flat.max(-1)  # (B,), position in the flattened (t d) axis
    top = torch.stack([val, (pos // d).float() + 1, (pos % d).float()], -1)  # (B, 3)
    return {"top": top, "inf": val, "median": flat.median(-1).values, "h1": first_over_rest(h.norm(dim=-1)),
            "kurt": kurtosis(h), "chan": channel_means(h)}


def attention_output_stats(a: torch.Tensor) -> dict[str, torch.Tensor]:
    """The attention module's output a (B, T, d) of the real tokens -> `outliers.outlier_stats` as attn_inf,
    attn_median, attn_kurt (B,)."""
    return {f"attn_{name}": value for name, value in outlier_stats(a).items()}


def qkv_stats(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunk: int = 128) -> dict[str, torch.Tensor]:
    """Queries, keys (after RoPE) and values of the real tokens, each (B, H, T, hd) with the kv heads of grouped-query
    attention repeated to H -> per sequence (B,):
    k1, v1: ||k_1|| / mean_{t>1} ||k_t|| with the norm over all heads (the concatenated key), the same for v;
    cos1 = mean_{t=2..T} cos(q_t, k_1), cosj = mean_{t=2..T} mean_{1<j<=t} cos(q_t, k_j), both averaged over heads.
    Queries are taken in chunks of `chunk` rows, so memory is O(B * H * chunk * T)."""
    B, H, T, _ = q.shape
    k_norm = rearrange(k.float(), "b h t d -> b t (h d)").norm(dim=-1)  # (B, T)
    v_norm = rearrange(v.float(), "b h t d -> b t (h d)").norm(dim=-1)
    qn, kn = F.normalize(q.float(), dim=-1), F.normalize(k.float(), dim=-1)
    cos1 = torch.zeros(B, H, device=q.device)
    cosj = torch.zeros(B, H, device=q.device)
    keys = torch.arange(T, device=q.device)
    for r0 in range(1, T, chunk):  # queries t = 2..T (0-based 1..T-1): they see token 1 and at least one other
        rows = keys[r0:r0 + chunk]
        cos = qn[:, :, rows] @ kn.transpose(-1, -2)  # (B, H, R, T)
        others = (keys[None, :] > 0) & (keys[None, :] <= rows[:, None])  # (R, T): keys 1 < j <= t
        cos1 += cos[..., 0].sum(-1)
        cosj += ((cos * others).sum(-1) / others.sum(-1)).sum(-1)
    n_queries = T - 1  # 0 when T = 1: the angles are NaN
    return {"k1": first_over_rest(k_norm), "v1": first_over_rest(v_norm),
            "cos1": (cos1 / n_queries).mean(-1), "cosj": (cosj / n_queries).mean(-1)}


class ActivationStats:
    """Accumulates per-layer, per-sequence statistics over batches (`update`) into per-layer lists (`result`):
    the massive top value (with its token and channel) and the attention output's largest |a| are maxima over all
    sequences; medians, norm ratios, angles, inf-norms, kurtoses and H_avg are means over sequences. Statistics
    missing from a batch's layers are left out of the result."""

    def __init__(self):
        self.top: Optional[torch.Tensor] = None  # (L, 3): value, token, channel
        self.sums: dict[str, torch.Tensor] = {}  # name -> (L,) sums over sequences ((L, d) for chan)
        self.attn_top: Optional[torch.Tensor] = None  # (L,): max |attention output| over sequences
        self.n = 0

    def update(self, layers: list[dict[str, torch.Tensor]]) -> None:
        """layers: per layer, the merged dicts of `hidden_state_stats` and (optionally) `qkv_stats` and
        `attention_output_stats` of one batch."""
        bt = torch.stack([s["top"] for s in layers], 1).cpu()  # (B, L, 3)
        best = bt[bt[..., 0].argmax(0), torch.arange(bt.shape[1])]  # (L, 3): per layer the batch max
        self.top = best if self.top is None else torch.where(best[:, :1] > self.top[:, :1], best, self.top)
        names = [name for name in _MEAN_KEYS if all(name in s for s in layers)]
        if self.n and set(names) != set(self.sums):
            raise ValueError(f"statistics {sorted(names)} differ from the first batch's {sorted(self.sums)}")
        for name in names:
            total = torch.stack([s[name] for s in layers], 1).sum(0).cpu()  # (B, L) -> (L,); (B, L, d) -> (L, d)
            self.sums[name] = self.sums[name] + total if name in self.sums else total
        if "attn_inf" in names:
            peak = torch.stack([s["attn_inf"] for s in layers], 1).amax(0).cpu()  # (B, L) -> (L,)
            self.attn_top = peak if self.attn_top is None else torch.maximum(self.attn_top, peak)
        self.n += bt.shape[0]

    def result(self) -> dict[str, list]:
        mean = {_MEAN_KEYS[name]: total / self.n for name, total in self.sums.items()}  # (L,) or (L, d) tensors
        top = self.top[:, 0].tolist()
        out = {
            "massive_top": top,
            "massive_median": mean["massive_median"].tolist(),
            "massive_ratio": [t / max(m, 1e-12) for t, m in zip(top, mean["massive_median"].tolist())],
            "massive_token": [int(x) for x in self.top[:, 1].tolist()],
            "massive_channel": [int(x) for x in self.top[:, 2].tolist()],
        }
        out.update({key: mean[key].tolist() for key in NORM_KEYS + OUTLIER_KEYS if key in mean})
        if self.attn_top is not None:  # as massive_ratio: the largest |a| over sequences / the mean median
            out["attn_top_median"] = (self.attn_top / mean["attn_median"].clamp_min(1e-12)).tolist()
        if "h_avg" in mean:
            out["h_avg"] = mean["h_avg"].tolist()  # (L, d)
            out.update(residual_sink_summary(mean["h_avg"]))
        return out


@torch.no_grad()
def activation_stats(model, tokens: torch.Tensor, batch_size: int = 32, chunk: int = 128) -> dict:
    """Per-layer lists (index = layer) of:
    massive_top, massive_median, massive_ratio, massive_token (1-indexed), massive_channel,
    h1_norm_ratio = ||h_1|| / mean_{t>1} ||h_t||, k1_norm_ratio, v1_norm_ratio (keys after RoPE, all heads),
    cos_q_k1 = mean_{t>1} cos(q_t, k_1), cos_q_kj = mean_{t>1} mean_{1<j<=t} cos(q_t, k_j) (over heads and
    sequences); resid_inf_norm, resid_kurtosis, attn_inf_norm, attn_kurtosis (Bondarenko's, means over sequences),
    attn_top_median (max |a| / median |a|, as massive_ratio); h_avg (L lists of d: mean |h_j| over all probe
    tokens), resid_sink_top, resid_sink_channel, resid_sink_ratio, and the scalar resid_sink_channel_share;
    attn_norm_min, ffn_norm_min and the scalar final_norm_min (`outliers.norm_weight_minima`); for a model with a
    gate, gates: `sinklab.metrics.gates.gate_stats` of the same forwards (gate_mean, gate_low_share,
    gate_first_token over all layers and as layer<l>/...). See `hidden_state_stats`, `qkv_stats`,
    `attention_output_stats`, `sinklab.metrics.outliers` and `sinklab.metrics.gates`."""
    cfg = model.cfg
    S, n_slots = cfg.n_sink_tokens, cfg.n_slots
    acc = ActivationStats()
    with record_gates(model) as gates:  # no hooks, and nothing to add up, without a gate
        gate_totals = torch.zeros(len(gates), 5, dtype=torch.float64, device=tokens.device)  # `gate_sums` per layer
        for start in range(0, tokens.shape[0], batch_size):
            records: list[dict] = []
            model(tokens[start:start + batch_size], records=records)
            # real tokens only: q (B, H, S + T, hd) drops the sinks, k and v (B, H, n_slots + S + T, hd) the slots
            acc.update([{**hidden_state_stats(rec["h"][:, S:]), **attention_output_stats(rec["attn"][:, S:]),
                         **qkv_stats(rec["q"][:, :, S:], rec["k"][:, :, n_slots + S:], rec["v"][:, :, n_slots + S:],
                                     chunk)} for rec in records])
            if gates:  # this batch's scores -> sums, then dropped: memory stays one batch's
                gate_totals += gate_sums(gates)
                for layer in gates:
                    layer.clear()
    out = {**acc.result(), **norm_weight_minima(model)}
    if gates:
        out["gates"] = stats_from_sums(gate_totals)
    return out


_MAX_OVER_LAYERS = ("massive_top", "massive_ratio", "resid_inf_norm", "attn_inf_norm", "attn_top_median",
                    "resid_sink_ratio")
_MEAN_OVER_LAYERS = ("k1_norm_ratio", "v1_norm_ratio", "cos_q_k1", "cos_q_kj", "resid_kurtosis", "attn_kurtosis")


def flatten_activation_stats(stats: dict) -> dict[str, float]:
    """Scalars for logging. Summaries: massive_top, massive_ratio, resid_inf_norm, attn_inf_norm, attn_top_median,
    resid_sink_ratio (max over layers; Bondarenko's "max inf. norm"), h1_norm_ratio (last layer), k1_norm_ratio,
    v1_norm_ratio, cos_q_k1, cos_q_kj, resid_kurtosis, attn_kurtosis (means over layers; Bondarenko's "avg.
    kurtosis"), resid_sink_channel_share, final_norm_min, norm_min (the smallest of every norm's), and the gate
    statistics where there are gates (over all layers and per layer, as `gate_stats` names them). Per layer: every
    statistic of `activation_stats` in STAT_KEYS as layer{i}/<name>. Norms without a weight are left out."""
    out: dict[str, float] = {}
    for key in _MAX_OVER_LAYERS:
        if key in stats:
            out[key] = max(stats[key])
    if "h1_norm_ratio" in stats:
        out["h1_norm_ratio"] = stats["h1_norm_ratio"][-1]
    for key in _MEAN_OVER_LAYERS:
        if key in stats:
            out[key] = sum(stats[key]) / len(stats[key])
    if "resid_sink_channel_share" in stats:
        out["resid_sink_channel_share"] = stats["resid_sink_channel_share"]
    norm_mins = [v for key in NORM_WEIGHT_KEYS for v in stats.get(key, []) if v is not None]
    if stats.get("final_norm_min") is not None:
        out["final_norm_min"] = stats["final_norm_min"]
        norm_mins.append(stats["final_norm_min"])
    if norm_mins:
        out["norm_min"] = min(norm_mins)
    out.update(stats.get("gates", {}))  # already scalars: gate_mean, ..., layer<l>/gate_mean, ...
    for key in STAT_KEYS:
        for layer, value in enumerate(stats.get(key, [])):
            if value is not None:
                out[f"layer{layer}/{key}"] = float(value)
    return {key: float(value) for key, value in out.items()}
