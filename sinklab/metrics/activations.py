"""Massive activations (Sun et al., 2024) and the first token's norms and angles (Gu et al., section 3).

All from one recorded forward: per layer the block output h (residual stream), and q, k, v after RoPE.
Only real tokens are scored (the bias slot and learned sink tokens are skipped); token 1 is the first real token.

The formulas live in two per-batch functions shared by sinklab models (`activation_stats`) and Hugging Face
models (`sinklab.hf`): `hidden_state_stats` (massive activations, ||h_1|| ratio) and `qkv_stats` (key and value
norm ratios, query-key angles); `ActivationStats` averages them over batches into per-layer lists.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from einops import rearrange

# per-layer lists returned by `activation_stats` / `ActivationStats.result`, in this order
MASSIVE_KEYS = ("massive_top", "massive_median", "massive_ratio", "massive_token", "massive_channel")
NORM_KEYS = ("h1_norm_ratio", "k1_norm_ratio", "v1_norm_ratio", "cos_q_k1", "cos_q_kj")
STAT_KEYS = MASSIVE_KEYS + NORM_KEYS
_MEAN_KEYS = {"median": "massive_median", "h1": "h1_norm_ratio", "k1": "k1_norm_ratio", "v1": "v1_norm_ratio",
              "cos1": "cos_q_k1", "cosj": "cos_q_kj"}  # per-sequence value -> its per-layer mean's name


def first_over_rest(norms: torch.Tensor) -> torch.Tensor:
    """norms (B, T) -> norms[:, 0] / mean_{t>1} norms[:, t], shape (B,); NaN when T = 1."""
    return norms[:, 0] / norms[:, 1:].mean(-1)


def hidden_state_stats(h: torch.Tensor) -> dict[str, torch.Tensor]:
    """Residual stream h (B, T, d) of the real tokens -> per sequence:
    top (B, 3): max |h|, its token (1-indexed) and channel (0-indexed); median (B,): median |h|;
    h1 (B,): ||h_1|| / mean_{t>1} ||h_t||."""
    h = h.float()
    d = h.shape[-1]
    flat = rearrange(h.abs(), "b t d -> b (t d)")
    val, pos = flat.max(-1)  # (B,), position in the flattened (t d) axis
    top = torch.stack([val, (pos // d).float() + 1, (pos % d).float()], -1)  # (B, 3)
    return {"top": top, "median": flat.median(-1).values, "h1": first_over_rest(h.norm(dim=-1))}


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
    the massive top value (with its token and channel) is the max over all sequences; medians, norm ratios and
    angles are means over sequences. Statistics missing from a batch's layers are left out of the result."""

    def __init__(self):
        self.top: Optional[torch.Tensor] = None  # (L, 3): value, token, channel
        self.sums: dict[str, torch.Tensor] = {}  # name -> (L,) sums over sequences
        self.n = 0

    def update(self, layers: list[dict[str, torch.Tensor]]) -> None:
        """layers: per layer, the merged dicts of `hidden_state_stats` and (optionally) `qkv_stats` of one batch."""
        bt = torch.stack([s["top"] for s in layers], 1).cpu()  # (B, L, 3)
        best = bt[bt[..., 0].argmax(0), torch.arange(bt.shape[1])]  # (L, 3): per layer the batch max
        self.top = best if self.top is None else torch.where(best[:, :1] > self.top[:, :1], best, self.top)
        names = [name for name in _MEAN_KEYS if all(name in s for s in layers)]
        if self.n and set(names) != set(self.sums):
            raise ValueError(f"statistics {sorted(names)} differ from the first batch's {sorted(self.sums)}")
        for name in names:
            total = torch.stack([s[name] for s in layers], 1).sum(0).cpu()  # (B, L) -> (L,)
            self.sums[name] = self.sums[name] + total if name in self.sums else total
        self.n += bt.shape[0]

    def result(self) -> dict[str, list]:
        mean = {_MEAN_KEYS[name]: (total / self.n).tolist() for name, total in self.sums.items()}
        top = self.top[:, 0].tolist()
        out = {
            "massive_top": top,
            "massive_median": mean["massive_median"],
            "massive_ratio": [t / max(m, 1e-12) for t, m in zip(top, mean["massive_median"])],
            "massive_token": [int(x) for x in self.top[:, 1].tolist()],
            "massive_channel": [int(x) for x in self.top[:, 2].tolist()],
        }
        out.update({key: mean[key] for key in NORM_KEYS if key in mean})
        return out


@torch.no_grad()
def activation_stats(model, tokens: torch.Tensor, batch_size: int = 32, chunk: int = 128) -> dict:
    """Per-layer lists (index = layer) of:
    massive_top, massive_median, massive_ratio, massive_token (1-indexed), massive_channel,
    h1_norm_ratio = ||h_1|| / mean_{t>1} ||h_t||, k1_norm_ratio, v1_norm_ratio (keys after RoPE, all heads),
    cos_q_k1 = mean_{t>1} cos(q_t, k_1), cos_q_kj = mean_{t>1} mean_{1<j<=t} cos(q_t, k_j) (over heads and
    sequences). See `hidden_state_stats` and `qkv_stats`."""
    cfg = model.cfg
    S, n_slots = cfg.n_sink_tokens, cfg.n_slots
    acc = ActivationStats()
    for start in range(0, tokens.shape[0], batch_size):
        records: list[dict] = []
        model(tokens[start:start + batch_size], records=records)
        # real tokens only: q (B, H, S + T, hd) drops the sink tokens, k and v (B, H, n_slots + S + T, hd) the slots
        acc.update([{**hidden_state_stats(rec["h"][:, S:]),
                     **qkv_stats(rec["q"][:, :, S:], rec["k"][:, :, n_slots + S:], rec["v"][:, :, n_slots + S:],
                                 chunk)} for rec in records])
    return acc.result()


def flatten_activation_stats(stats: dict) -> dict[str, float]:
    """Scalars for logging. Summaries: massive_top and massive_ratio (max over layers), h1_norm_ratio (last layer),
    k1_norm_ratio, v1_norm_ratio, cos_q_k1, cos_q_kj (means over layers). Per layer: every statistic of
    `activation_stats` as layer{i}/<name> (massive_top, ..., massive_token, massive_channel, ..., cos_q_kj)."""
    out: dict[str, float] = {}
    if "massive_top" in stats:
        out["massive_top"] = max(stats["massive_top"])
        out["massive_ratio"] = max(stats["massive_ratio"])
    if "h1_norm_ratio" in stats:
        out["h1_norm_ratio"] = stats["h1_norm_ratio"][-1]
    for key in ("k1_norm_ratio", "v1_norm_ratio", "cos_q_k1", "cos_q_kj"):
        if key in stats:
            out[key] = sum(stats[key]) / len(stats[key])
    for key in STAT_KEYS:
        for layer, value in enumerate(stats.get(key, [])):
            out[f"layer{layer}/{key}"] = float(value)
    return out
