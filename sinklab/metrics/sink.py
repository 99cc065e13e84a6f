"""The attention-sink metric of Gu et al. (ICLR 2025), exact and without materialising (L, H, T, T).

For layer l, head h and an attention map A over T real tokens (1-indexed):
    alpha_k(l, h) = 1/(T-k+1) * sum_{i=k..T} A[i, k]
    Sink_k^eps    = 100 * mean_{l,h} [alpha_k(l, h) > eps]        (per sequence, then averaged over sequences)
Bias slots (K / KV bias) and learned sink tokens are extra keys visible to every query: their score is the mean
attention they receive over all T real queries, reported apart from the first real token. Operations without
row normalisation are also scored on the renormalised map |A| / sum_j |A| (Sink*).

The efficient route walks query rows in chunks and accumulates column sums, so memory grows linearly in T;
`brute_force_alpha` computes the same from full maps and is what the tests compare against.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch


@dataclass
class AttentionScores:
    """Per-sequence scores. alpha: (N, L, H, K) for real tokens 1..K; slot: (N, L, H, n_extra) for the bias slot
    and learned sink tokens (in key order); *_star: the same on the renormalised map (None when rows sum to 1)."""

    alpha: torch.Tensor
    slot: Optional[torch.Tensor] = None
    alpha_star: Optional[torch.Tensor] = None
    slot_star: Optional[torch.Tensor] = None


def sink_rate(alpha: torch.Tensor, eps: float = 0.3) -> torch.Tensor:
    """alpha (N, L, H, K) -> Sink_k^eps in percent, shape (K,): per sequence over (l, h), then mean over N."""
    return 100.0 * (alpha > eps).float().mean(dim=(1, 2)).mean(dim=0)


def column_scores(maps: torch.Tensor, n_extra: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Brute force on full maps. maps (..., T, n_extra + T) over real-token query rows ->
    alpha (..., K) for real tokens and extra (..., n_extra) for slots / sink tokens."""
    T = maps.shape[-2]
    k = min(k, T)
    alpha = torch.stack([maps[..., j:, n_extra + j].sum(-1) / (T - j) for j in range(k)], dim=-1)
    extra = maps[..., :, :n_extra].mean(-2)
    return alpha, extra


def renormalise(a: torch.Tensor) -> torch.Tensor:
    """|A| / sum_j |A| row by row (equals A / sum A for non-negative maps)."""
    a = a.abs()
    return a / a.sum(-1, keepdim=True).clamp_min(1e-12)


def brute_force_alpha(model, tokens: torch.Tensor, k: int = 4) -> AttentionScores:
    """Reference computation from the full explicit attention maps (the materialising route)."""
    n_skip = model.cfg.n_sink_tokens
    n_extra = model.cfg.n_slots + n_skip
    _, probs = model(tokens, return_probs=True)
    maps = torch.stack([p[:, :, n_skip:, :] for p in probs], dim=1)  # (N, L, H, T, n_extra + T)
    alpha, slot = column_scores(maps, n_extra, k)
    out = AttentionScores(alpha=alpha, slot=slot if n_extra else None)
    if not model.cfg.row_normalised:
        out.alpha_star, s = column_scores(renormalise(maps), n_extra, k)
        out.slot_star = s if n_extra else None
    return out


@torch.no_grad()
def attention_scores(model, tokens: torch.Tensor, k: int = 4, batch_size: int = 32,
                     chunk: int = 128) -> AttentionScores:
    """Efficient exact route: one forward per batch records q and k per layer, then query chunks of the explicit
    map are summed into key columns. Memory: O(L * B * T * d) for q/k plus O(B * H * chunk * T) for one chunk."""
    cfg = model.cfg
    S, n_slots = cfg.n_sink_tokens, cfg.n_slots
    n_extra = n_slots + S
    star = not cfg.row_normalised
    outs: dict[str, list] = {"alpha": [], "slot": [], "alpha_star": [], "slot_star": []}
    for start in range(0, tokens.shape[0], batch_size):
        idx = tokens[start:start + batch_size]
        B, T = idx.shape
        K = min(k, T)
        records: list[dict] = []
        model(idx, records=records)
        layout = model.layout(T, idx.device)
        layer_alpha, layer_slot, layer_alpha_s, layer_slot_s = [], [], [], []
        for block, rec in zip(model.blocks, records):
            q, key = rec["q"], rec["k"]  # (B, H, S + T, hd), (B, H, n_slots + S + T, hd)
            H = q.shape[1]
            acc = torch.zeros(B, H, K, dtype=torch.float64, device=idx.device)
            acc_x = torch.zeros(B, H, n_extra, dtype=torch.float64, device=idx.device)
            acc_s, acc_xs = torch.zeros_like(acc), torch.zeros_like(acc_x)
            cols = n_extra + torch.arange(K, device=idx.device)  # key columns of real tokens 1..K
            for r0 in range(0, T, chunk):
                rows = torch.arange(S + r0, S + min(T, r0 + chunk), device=idx.device)  # real query positions
                a = block.attn.probs(q[:, :, rows], key, layout, rows).double()  # (B, H, R, n_keys)
                # only queries i >= k count for token k: row r (0-based real index) contributes to k-1 <= r
                sees = (rows - S)[:, None] >= torch.arange(K, device=idx.device)[None, :]  # (R, K)
                for maps, col_acc, x_acc in ((a, acc, acc_x),) + (((renormalise(a), acc_s, acc_xs),) if star else ()):
                    col_acc += (maps[..., cols] * sees).sum(2)
                    x_acc += maps[..., :n_extra].sum(2)
            denom = (T - torch.arange(K, device=idx.device)).double()
            layer_alpha.append(acc / denom)
            layer_slot.append(acc_x / T)
            layer_alpha_s.append(acc_s / denom)
            layer_slot_s.append(acc_xs / T)
        outs["alpha"].append(torch.stack(layer_alpha, 1))  # (B, L, H, K)
        outs["slot"].append(torch.stack(layer_slot, 1))
        outs["alpha_star"].append(torch.stack(layer_alpha_s, 1))
        outs["slot_star"].append(torch.stack(layer_slot_s, 1))
    cat = {name: torch.cat(v).float() for name, v in outs.items()}
    return AttentionScores(
        alpha=cat["alpha"],
        slot=cat["slot"] if n_extra else None,
        alpha_star=cat["alpha_star"] if star else None,
        slot_star=cat["slot_star"] if star and n_extra else None,
    )


def summarise(scores: AttentionScores, eps: Sequence[float] = (0.3,), slot_names: Optional[list[str]] = None) -> dict:
    """Flat scalars: sink{k} (first eps) and sink{k}@{eps}, sink{k}_star, alpha{k}, slot scores, per-layer values."""
    out: dict[str, float] = {}
    K = scores.alpha.shape[-1]
    for j, e in enumerate(eps):
        rates = sink_rate(scores.alpha, e)
        for kk in range(K):
            out[f"sink{kk + 1}@{e:g}"] = rates[kk].item()
            if j == 0:
                out[f"sink{kk + 1}"] = rates[kk].item()
        if scores.alpha_star is not None:
            rates_s = sink_rate(scores.alpha_star, e)
            for kk in range(K):
                out[f"sink{kk + 1}_star@{e:g}"] = rates_s[kk].item()
                if j == 0:
                    out[f"sink{kk + 1}_star"] = rates_s[kk].item()
        for name, slot in (("slot", scores.slot), ("slot_star", scores.slot_star)):
            if slot is None:
                continue
            names = slot_names or [f"{i}" for i in range(slot.shape[-1])]
            for s_i, s_name in enumerate(names):
                rate = 100.0 * (slot[..., s_i] > e).float().mean(dim=(1, 2)).mean().item()
                out[f"{name}_{s_name}@{e:g}"] = rate
                if j == 0:
                    out[f"{name}_{s_name}"] = rate
    for kk in range(K):
        out[f"alpha{kk + 1}"] = scores.alpha[..., kk].mean().item()
    alpha1_layer = scores.alpha[..., 0].mean(dim=(0, 2))  # (L,)
    sink1_layer = 100.0 * (scores.alpha[..., 0] > eps[0]).float().mean(dim=(0, 2))
    for layer, (a, s) in enumerate(zip(alpha1_layer.tolist(), sink1_layer.tolist())):
        out[f"layer{layer}/alpha1"] = a
        out[f"layer{layer}/sink1"] = s
    return out


def first_token_attention(summary: dict[str, float]) -> dict[str, float]:
    """Qwen's first-token attention (arXiv 2505.06708, reported beside Sink_1): the mean over queries i of
    A[i, 1], overall and per layer, as first_token_attn and layer{i}/first_token_attn. It is alpha_1 exactly (the
    mean over all real queries i = 1..T, query 1 included, averaged over heads and sequences; the paper does not say
    whether it drops query 1), so these are `summarise`'s alpha1 values under Qwen's name, not a second computation."""
    return {name.removesuffix("alpha1") + "first_token_attn": value for name, value in summary.items()
            if name == "alpha1" or name.endswith("/alpha1")}


def slot_names(cfg) -> list[str]:
    """Names of the extra key columns in order: the bias slot, then the learned sink tokens."""
    return (["bias"] if cfg.n_slots else []) + [f"token{i}" for i in range(cfg.n_sink_tokens)]
