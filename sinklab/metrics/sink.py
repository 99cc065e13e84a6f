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

import re
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np
import torch

from sinklab.keys import SINK_PREFIX

from .base import ANY, METRICS, PERCENT, Context, Metric, cell
from .record import slot_names  # noqa: F401  (sinklab.metrics exports it from here)


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


def seen_column_sums(maps: torch.Tensor, rows: torch.Tensor, n_extra: int, K: int) -> torch.Tensor:
    """A chunk of query rows' share of alpha_1..K's numerators: maps (B, H, R, n_extra + T) whose rows are the real
    query positions `rows` (R,) (0-based) -> (B, H, K), the sums over the rows i >= k of key column k (real tokens
    k = 1..K), in the maps' dtype."""
    sees = rows[:, None] >= torch.arange(K, device=maps.device)[None, :]  # (R, K): query i counts for k <= i
    return (maps[..., n_extra:n_extra + K] * sees).sum(2)


def renormalise(a: torch.Tensor) -> torch.Tensor:
    """|A| / sum_j |A| row by row (equals A / sum A for non-negative maps)."""
    a = a.abs()
    return a / a.sum(-1, keepdim=True).clamp_min(1e-12)


def brute_force_alpha(model, tokens: torch.Tensor, k: int = 4) -> AttentionScores:
    """Reference computation from the full explicit attention maps (the materialising route)."""
    from .record import attention_maps

    n_skip = model.cfg.n_sink_tokens
    n_extra = model.cfg.n_slots + n_skip
    maps = torch.stack([p[:, :, n_skip:, :] for p in attention_maps(model, tokens)], dim=1)  # (N, L, H, T, n_extra + T)
    alpha, slot = column_scores(maps, n_extra, k)
    out = AttentionScores(alpha=alpha, slot=slot if n_extra else None)
    if not model.cfg.row_normalised:
        out.alpha_star, s = column_scores(renormalise(maps), n_extra, k)
        out.slot_star = s if n_extra else None
    return out


def attention_scores(model, tokens: torch.Tensor, k: int = 4, batch_size: int = 32,
                     chunk: int = 128, extra_mask=None) -> AttentionScores:
    """Efficient exact route (the `sink` metric): one forward per batch records q and k per layer, then query chunks
    of the explicit map are summed into key columns. Memory: O(B * T * d) for one layer's q / k plus
    O(B * H * chunk * T) for one chunk."""
    from .record import measure_model

    (metric,) = measure_model(model, tokens, ["sink"], k=k, batch_size=batch_size, chunk=chunk, extra_mask=extra_mask)
    return metric.scores()


SINK_K = re.compile(rf"{re.escape(SINK_PREFIX)}sink\d+")  # Sink_k's log key (sink/sink1, ...), first eps
SLOT_KEY = re.compile(rf"^{re.escape(SINK_PREFIX)}(slot(?:_[A-Za-z0-9_]+)?)$")  # a slot score's (sink/slot_bias, ...)
MAX_HEADS = 16  # heads shown in `sinklab measure`'s alpha_1 table


@METRICS.register("sink")
class SinkMetric(Metric):
    """Sink_k^eps, alpha_k, Sink* and the slot scores (module docstring), from the maps in row chunks: per layer and
    batch the columns of real tokens 1..K (counting query rows i >= k) and of the extra keys are summed in float64."""

    records = frozenset({"maps"})
    # the exact names `summarise` logs: Sink_k, Sink*_k and the slot scores (bias, token<i>, sink_logit) in %, at the
    # first eps or @eps; alpha_k, the mean attention on token k: [0, 1] for softmax, any for kernels
    bounds = ((r"^sink/(layer\d+/)?(sink\d+(_star)?|slot(_star)?_\w+)(@[0-9.e+-]+)?$", PERCENT),
              (r"^sink/(layer\d+/)?alpha\d+$", ANY))
    headline = ("sink/sink1", "sink/alpha1")

    def __init__(self, ctx: Context):
        super().__init__(ctx)
        self.star = ctx.row_normalised is not True  # unknown (Hugging Face): computed, reported if rows do not sum to 1
        self.batches: dict[str, list] = {"alpha": [], "slot": [], "alpha_star": [], "slot_star": []}
        self.layers: dict[str, list] = {name: [] for name in self.batches}
        self.acc: Optional[dict[str, torch.Tensor]] = None

    def update_maps(self, layer: int, rows: torch.Tensor, maps: torch.Tensor) -> None:
        n_extra, T = self.ctx.n_extra, maps.shape[-1] - self.ctx.n_extra
        K = min(self.ctx.k, T)
        if not self.acc or self.acc["layer"] != layer:
            self._close_layer()
            B, H = maps.shape[:2]
            zeros = torch.zeros(B, H, K, dtype=torch.float64, device=maps.device)
            zeros_x = torch.zeros(B, H, n_extra, dtype=torch.float64, device=maps.device)
            self.acc = {"layer": layer, "T": T, "alpha": zeros, "slot": zeros_x,
                        "alpha_star": zeros.clone(), "slot_star": zeros_x.clone()}
        # Sink* renormalises by whole rows; without it only the extra keys' and tokens 1..K's columns are summed
        a = maps.double() if self.star else maps[..., :n_extra + K].double()
        for m, name in ((a, ""),) + (((renormalise(a), "_star"),) if self.star else ()):
            self.acc["alpha" + name] += seen_column_sums(m, rows, n_extra, K)
            self.acc["slot" + name] += m[..., :n_extra].sum(2)

    def _close_layer(self) -> None:
        if not self.acc:
            return
        K, T = self.acc["alpha"].shape[-1], self.acc["T"]
        denom = (T - torch.arange(K, device=self.acc["alpha"].device)).double()
        for name in ("alpha", "alpha_star"):
            self.layers[name].append(self.acc[name] / denom)
        for name in ("slot", "slot_star"):
            self.layers[name].append(self.acc[name] / T)
        self.acc = None

    def end_batch(self) -> None:
        self._close_layer()
        for name, layers in self.layers.items():
            self.batches[name].append(torch.stack(layers, 1))  # (B, L, H, K)
            layers.clear()

    def scores(self) -> AttentionScores:
        cat = {name: torch.cat(v).float() for name, v in self.batches.items()}
        n_extra = self.ctx.n_extra
        star = self.star and self.ctx.row_normalised is not True  # a Hugging Face model's rows may turn out to sum to 1
        return AttentionScores(alpha=cat["alpha"], slot=cat["slot"] if n_extra else None,
                               alpha_star=cat["alpha_star"] if star else None,
                               slot_star=cat["slot_star"] if star and n_extra else None)

    def result(self) -> dict[str, Any]:
        return {"scores": self.scores(), "row_normalised": self.ctx.row_normalised}

    def log(self, result: dict[str, Any]) -> dict[str, float]:
        return {SINK_PREFIX + k: v for k, v in summarise(result["scores"], self.ctx.eps, self.ctx.slot_names).items()}

    def json(self, result: dict[str, Any]) -> dict[str, Any]:
        """eps, k, row_normalised, sink, sink_by_eps, sink_star(_by_eps), alpha, alpha_mean, sink1_by_layer,
        alpha_star, slot(_star), slot(_star)_by_eps, slot(_star)_alpha (sinklab.cli.measure's docstring)."""
        scores, eps = result["scores"], self.ctx.eps
        row_normalised = bool(result["row_normalised"])
        K = scores.alpha.shape[-1]
        res: dict[str, Any] = {"eps": [float(e) for e in eps], "k": K, "row_normalised": row_normalised}
        res["sink"] = rates(scores.alpha, eps[0])
        res["sink_by_eps"] = {f"{e:g}": rates(scores.alpha, e) for e in eps}
        # Sink*: the metric on |A| / sum |A|, which is A itself when rows sum to one (then exactly Sink)
        star = scores.alpha_star if not row_normalised and scores.alpha_star is not None else scores.alpha
        res["sink_star"] = rates(star, eps[0])
        res["sink_star_by_eps"] = {f"{e:g}": rates(star, e) for e in eps}
        res["alpha"] = scores.alpha[..., 0].mean(0).tolist()  # (L, H): alpha_1 mean over sequences
        res["alpha_mean"] = {str(j + 1): scores.alpha[..., j].mean().item() for j in range(K)}
        res["sink1_by_layer"] = (100.0 * (scores.alpha[..., 0] > eps[0]).float().mean(dim=(0, 2))).tolist()
        if not row_normalised and scores.alpha_star is not None:
            res["alpha_star"] = scores.alpha_star[..., 0].mean(0).tolist()
        names = self.ctx.slot_names
        for name, slot in (("slot", scores.slot), ("slot_star", scores.slot_star if not row_normalised else None)):
            if slot is None:
                continue

            def slot_rates(e: float, slot=slot) -> dict[str, float]:
                r = 100.0 * (slot > e).float().mean(dim=(1, 2)).mean(0)  # (n_extra,)
                return {n: v for n, v in zip(names, r.tolist())}

            res[name] = slot_rates(eps[0])
            res[f"{name}_by_eps"] = {f"{e:g}": slot_rates(e) for e in eps}
            res[f"{name}_alpha"] = {n: slot[..., i].mean(0).tolist() for i, n in enumerate(names)}  # (L, H)
        return res

    @classmethod
    def text(cls, part: dict[str, Any], res: dict[str, Any]) -> list[str]:
        """Sink_k per eps (and Sink* where rows do not sum to one), mean alpha_k, the slot scores, and alpha_1 per
        layer and head (the first MAX_HEADS heads) with each layer's mean and Sink_1."""
        K = part["k"]
        lines = ["Sink_k (%): heads with alpha_k > eps, per sequence, averaged",
                 f"{'':<14}" + "".join(f"{'k=' + str(j + 1):>9}" for j in range(K))]
        for e, r in part["sink_by_eps"].items():
            lines.append(f"{'eps=' + e:<14}" + "".join(f"{r[str(j + 1)]:9.2f}" for j in range(K)))
        for e, r in (part["sink_star_by_eps"] if not part["row_normalised"] else {}).items():  # else equal to Sink
            lines.append(f"{'Sink* eps=' + e:<14}" + "".join(f"{r[str(j + 1)]:9.2f}" for j in range(K)))
        lines.append(f"{'mean alpha_k':<14}" + "".join(f"{part['alpha_mean'][str(j + 1)]:9.4f}" for j in range(K)))
        for name in ("slot", "slot_star"):
            if f"{name}_by_eps" not in part:
                continue
            lines += ["", f"{'bias slot / sink tokens' if name == 'slot' else 'slots, renormalised (Sink*)'} (%):"]
            for e, r in part[f"{name}_by_eps"].items():
                lines.append(f"{'eps=' + e:<14}" + "".join(f"{n}={v:.2f}  " for n, v in r.items()))
            lines.append(f"{'mean score':<14}" + "".join(f"{n}={float(np.mean(grid)):.4f}  "
                                                         for n, grid in part[f"{name}_alpha"].items()))
        alpha = part["alpha"]
        H = len(alpha[0]) if alpha else 0
        shown = min(H, MAX_HEADS)
        which = "" if shown == H else f"; first {shown} of {H} heads"
        lines += ["", f"alpha_1 per layer and head (mean over sequences{which})",
                  f"{'layer':>5} {'mean':>7} {'Sink_1%':>7} |" + "".join(f"{'h' + str(h):>6}" for h in range(shown))]
        for layer, row in enumerate(alpha):
            lines.append(f"{layer:>5} {float(np.mean(row)):7.3f} {cell(part['sink1_by_layer'][layer], 7, 1)} |"
                         + "".join(f"{a:6.2f}" for a in row[:shown]))
        return lines

    def heatmap(self, result: dict[str, Any]) -> torch.Tensor:
        """alpha_1 per layer and head, the mean over sequences (L, H)."""
        return result["scores"].alpha[..., 0].mean(0).cpu()

    @classmethod
    def fill_final(cls, finals: Sequence[dict[str, float]]) -> None:
        """In a sweep where some jobs log Sink*_k (the renormalised map's, logged only where rows do not sum to one:
        sigmoid, differential attention, ...), a job that logs Sink_k but no Sink* has rows that sum to one, where
        renormalising changes nothing: its Sink*_k is its Sink_k, so the two kinds of operation compare on one
        column."""
        def logs_star(final: dict[str, float]) -> bool:
            return any(k.startswith(SINK_PREFIX) and k.endswith("_star") for k in final)

        if not any(logs_star(final) for final in finals):
            return
        for final in finals:
            if not logs_star(final):
                final.update({f"{k}_star": v for k, v in list(final.items()) if SINK_K.fullmatch(k)})


def rates(alpha: torch.Tensor, eps: float) -> dict[str, float]:
    """alpha (N, L, H, K) -> {"1": Sink_1, ...} in percent (per sequence over heads, then mean)."""
    return {str(j + 1): v for j, v in enumerate(sink_rate(alpha, eps).tolist())}


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


_LAYER_SINK1 = re.compile(rf"^{re.escape(SINK_PREFIX)}layer(\d+)/sink1$")


def layer_sink1(logged: dict[str, float]) -> dict[int, float]:
    """{layer: Sink_1 of its heads (%)} from the logged values (sink/layer<i>/sink1): layers numbered from 0 as in
    the log keys, in the training summary and the heat map alike."""
    return {int(m.group(1)): v for k, v in logged.items() if (m := _LAYER_SINK1.match(k))}
