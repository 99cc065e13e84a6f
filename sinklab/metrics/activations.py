"""Massive activations (Sun et al., 2024) and the first token's norms and angles (Gu et al., section 3).

All from one recorded forward: per layer the block output h (residual stream), and q, k, v after RoPE.
Only real tokens are scored (the bias slot and learned sink tokens are skipped); token 1 is the first real token.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


@torch.no_grad()
def activation_stats(model, tokens: torch.Tensor, batch_size: int = 32, chunk: int = 128) -> dict:
    """Per-layer lists (index = layer) of:
    massive_top, massive_median, massive_ratio, massive_token (1-indexed), massive_channel,
    h1_norm_ratio = ||h_1|| / mean_{t>1} ||h_t||, k1_norm_ratio, v1_norm_ratio (keys after RoPE, all heads),
    cos_q_k1 = mean_t cos(q_t, k_1), cos_q_kj = mean_t mean_{1<j<=t} cos(q_t, k_j) (over heads and sequences).
    """
    cfg = model.cfg
    S, n_slots = cfg.n_sink_tokens, cfg.n_slots
    sums: dict[str, torch.Tensor] = {}
    top = None
    n_total = 0
    for start in range(0, tokens.shape[0], batch_size):
        idx = tokens[start:start + batch_size]
        B, T = idx.shape
        records: list[dict] = []
        model(idx, records=records)
        stats = {k: [] for k in ("h1", "k1", "v1", "cos1", "cosj", "median")}
        batch_top = []
        for rec in records:
            h = rec["h"][:, S:].float()  # (B, T, d)
            absd = h.abs()
            flat = absd.reshape(B, -1)
            val, pos = flat.max(-1)  # (B,)
            batch_top.append(torch.stack([val, (pos // h.shape[-1]).float() + 1, (pos % h.shape[-1]).float()], -1))
            stats["median"].append(flat.median(-1).values)
            norms = h.norm(dim=-1)  # (B, T)
            stats["h1"].append(norms[:, 0] / norms[:, 1:].mean(-1))
            key = rec["k"][:, :, n_slots + S:].float()  # (B, H, T, hd)
            val_ = rec["v"][:, :, n_slots + S:].float()
            kn = key.transpose(1, 2).flatten(2).norm(dim=-1)  # (B, T) over all heads
            vn = val_.transpose(1, 2).flatten(2).norm(dim=-1)
            stats["k1"].append(kn[:, 0] / kn[:, 1:].mean(-1))
            stats["v1"].append(vn[:, 0] / vn[:, 1:].mean(-1))
            q = F.normalize(rec["q"][:, :, S:].float(), dim=-1)
            kk = F.normalize(key, dim=-1)
            c1, cj, nj = 0.0, 0.0, 0.0
            for r0 in range(1, T, chunk):  # queries t >= 2 (0-based 1..T-1)
                rows = torch.arange(r0, min(T, r0 + chunk), device=idx.device)
                cos = q[:, :, rows] @ kk.transpose(-1, -2)  # (B, H, R, T)
                c1 = c1 + cos[..., 0].sum(-1)  # (B, H)
                vis = (torch.arange(T, device=idx.device)[None, :] <= rows[:, None]) & \
                      (torch.arange(T, device=idx.device)[None, :] > 0)  # keys 1 < j <= t
                cj = cj + ((cos * vis).sum(-1) / vis.sum(-1)).sum(-1)
                nj += len(rows)
            stats["cos1"].append((c1 / nj).mean(-1))
            stats["cosj"].append((cj / nj).mean(-1))
        for name, vals in stats.items():
            s = torch.stack(vals, 1).sum(0)  # (L,)
            sums[name] = sums.get(name, 0) + s
        bt = torch.stack(batch_top, 1)  # (B, L, 3)
        best = bt[bt[..., 0].argmax(0), torch.arange(bt.shape[1])]  # (L, 3): per layer the batch max
        top = best if top is None else torch.where((best[:, :1] > top[:, :1]), best, top)
        n_total += B
    mean = {k: (v / n_total).tolist() for k, v in sums.items()}
    return {
        "massive_top": top[:, 0].tolist(),
        "massive_median": mean["median"],
        "massive_ratio": [t / max(m, 1e-12) for t, m in zip(top[:, 0].tolist(), mean["median"])],
        "massive_token": [int(x) for x in top[:, 1].tolist()],
        "massive_channel": [int(x) for x in top[:, 2].tolist()],
        "h1_norm_ratio": mean["h1"],
        "k1_norm_ratio": mean["k1"],
        "v1_norm_ratio": mean["v1"],
        "cos_q_k1": mean["cos1"],
        "cos_q_kj": mean["cosj"],
    }


def flatten_activation_stats(stats: dict) -> dict[str, float]:
    """Scalars for logging: last layer's massive ratio and the max over layers, mean norm ratios, per layer h1."""
    out = {
        "massive_top": max(stats["massive_top"]),
        "massive_ratio": max(stats["massive_ratio"]),
        "h1_norm_ratio": stats["h1_norm_ratio"][-1],
        "k1_norm_ratio": sum(stats["k1_norm_ratio"]) / len(stats["k1_norm_ratio"]),
        "v1_norm_ratio": sum(stats["v1_norm_ratio"]) / len(stats["v1_norm_ratio"]),
        "cos_q_k1": sum(stats["cos_q_k1"]) / len(stats["cos_q_k1"]),
        "cos_q_kj": sum(stats["cos_q_kj"]) / len(stats["cos_q_kj"]),
    }
    for layer, v in enumerate(stats["h1_norm_ratio"]):
        out[f"layer{layer}/h1_norm_ratio"] = v
    for layer, v in enumerate(stats["massive_ratio"]):
        out[f"layer{layer}/massive_ratio"] = v
    return out
