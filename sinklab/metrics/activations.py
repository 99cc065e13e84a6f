"""Per-batch statistics of recorded activations, shared by the activation metrics (massive activations
`massive.py`, the first token's norms and angles `norms.py`, outliers `outliers.py`, residual sinks
`residual_sinks.py`): per layer the block output h (residual stream), q, k, v after RoPE and the attention module's
output, of the real tokens only (token 1 is the first real token). `LayerMeans` (metrics/base.py) averages per-sequence values over
batches into per-layer means. `activation_stats` / `flatten_activation_stats` are the activation metrics together,
as one dict (for scripts and tests that want them all).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from einops import rearrange

from .outliers import channel_means, kurtosis, lower_median, outlier_stats


def first_over_rest(norms: torch.Tensor) -> torch.Tensor:
    """norms (B, T) -> norms[:, 0] / mean_{t>1} norms[:, t], shape (B,); NaN when T = 1."""
    return norms[:, 0] / norms[:, 1:].mean(-1)


def top_and_median(h: torch.Tensor) -> dict[str, torch.Tensor]:
    """Residual stream h (B, T, d) -> per sequence top (B, 3): max |h|, its token (1-indexed) and channel
    (0-indexed); inf (B,): max |h| (Bondarenko's inf-norm); median (B,): median |h|."""
    d = h.shape[-1]
    flat = rearrange(h.float().abs(), "b t d -> b (t d)")
    val, pos = flat.max(-1)  # (B,), position in the flattened (t d) axis
    top = torch.stack([val, (pos // d).float() + 1, (pos % d).float()], -1)  # (B, 3)
    return {"top": top, "inf": val, "median": lower_median(flat)}


def h1_ratio(h: torch.Tensor) -> torch.Tensor:
    """h (B, T, d) -> (B,): ||h_1|| / mean_{t>1} ||h_t||."""
    return first_over_rest(h.float().norm(dim=-1))


def hidden_state_stats(h: torch.Tensor) -> dict[str, torch.Tensor]:
    """Residual stream h (B, T, d) of the real tokens -> per sequence `top_and_median`, h1 (`h1_ratio`),
    kurt (B,): `outliers.kurtosis`; chan (B, d): `outliers.channel_means`."""
    return {**top_and_median(h), "h1": h1_ratio(h), "kurt": kurtosis(h), "chan": channel_means(h)}


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


ACTIVATION_METRICS = ["massive", "norms", "outliers", "residual_sinks", "gates"]


def activation_stats(model, tokens: torch.Tensor, batch_size: int = 32, chunk: int = 128) -> dict:
    """The activation metrics' per-layer results as one dict (massive_*, h1_norm_ratio, k1_norm_ratio,
    v1_norm_ratio, cos_q_k1, cos_q_kj, resid_inf_norm, resid_kurtosis, attn_inf_norm, attn_kurtosis,
    attn_top_median, h_avg, resid_sink_*, attn_norm_min, ffn_norm_min, final_norm_min, and `gates` for a gated
    model): see each metric's module."""
    from .record import measure_model

    out: dict = {}
    for metric in measure_model(model, tokens, ACTIVATION_METRICS, batch_size=batch_size, chunk=chunk):
        result = metric.result()
        if metric.name == "gates":
            if result:
                out["gates"] = result
        else:
            out.update(result)
    return out


def flatten_activation_stats(stats: dict) -> dict[str, float]:
    """Scalars for logging (without the act/ prefix) of `activation_stats`' dict: each activation metric's `log`."""
    from .base import METRICS

    out: dict[str, float] = {}
    for name in ACTIVATION_METRICS:
        result = stats.get("gates", {}) if name == "gates" else stats
        out.update({k.removeprefix("act/"): v for k, v in METRICS.get(name).flatten(result).items()})
    return out
