"""Metrics split by head type: the sink, the q / k outliers per rotary pair and (through the induction metric) the
induction and previous-token scores of each kind of head (RoPE, partial RoPE, NoPE, ALiBi, a learned relative bias,
an absolute table), so that a model whose heads differ in their positions says which heads sink and where the
outliers sit (issue 37; the mechanism papers put the q / k outliers in rotary pairs that do not complete a cycle
within the context, arXiv 2503.01832, 2502.01563).

The types and frequencies come from the model's config, read once: `ModelConfig.head_types()` (each layer's query
heads' types, sinklab.model.positional.HEAD_TYPES) and each layer's `PositionalEncoding.pair_frequencies` ((H, hd/2):
the angular frequency f of each query head's rotary pair (x_i, x_{i + hd/2}), 0 where the pair does not rotate).
Each pair of each head is in one class, with D the largest distance between a query and a key whose positions
rotate (T - 1 over T real tokens, plus the learned sink tokens in front of them):
    partial_cycle: 0 < f * D < 2 pi  (the pair never completes a turn within the context)
    full_cycle:    f * D >= 2 pi
    unrotated:     f = 0             (NoPE heads and layers, p-RoPE's slowest pairs, ALiBi, relative, absolute)

Per type t (the types present only), over the heads (l, h) of type t in every layer:
- alpha1: the mean of alpha_1(l, h) (the sink metric's: the mean over the real queries i >= 1 of A[i, 1]) over the
  type's heads and the sequences;
- sink1: Sink_1 over the type's heads: 100 * the share of them with alpha_1 > eps (the first eps), per sequence,
  then averaged over sequences (`sink.sink_rate`);
- sink_share: the type's share of all sink heads: 100 * (sink heads of type t) / (sink heads of every type), both
  counted over every (sequence, layer, head); not logged when no head sinks;
- qk_max_partial_cycle, qk_max_full_cycle, qk_max_unrotated: the largest pair norm sqrt(x_i^2 + x_{i + hd/2}^2) of
  the queries or keys (the larger of the two, over the real tokens and the sequences) among the type's heads' pairs
  of the class; not logged for a class the type's heads have no pair of (a NoPE head has no rotating pair). RoPE
  turns a pair without changing its norm, so the recorded (rotated) q and k give the unrotated ones' values; keys
  are the query heads' (a key/value head repeated under GQA), the bias slot's and sink tokens' left out. With an
  odd head size (no rotation anywhere) the last channel is in no pair;
- induction, prev_token: logged by the induction metric (sinklab/metrics/induction.py), which measures them on its
  own input of repeated random tokens: the best head's score among the type's heads (`type_scores`).

Logged heads/<type>/{sink1, alpha1, sink_share, qk_max_partial_cycle, qk_max_full_cycle, qk_max_unrotated} here and
heads/<type>/{induction, prev_token} by the induction metric. `measure --json` heads: {eps, span, types [[type per
head] per layer], by_type {t: {heads, alpha1, sink1, sink_share, qk_max_<class>, pairs {class: count of (head, pair)},
q_pair_max, k_pair_max [per pair: the largest over the type's heads]}}, by_layer {t: {alpha1, sink1, qk_max_<class>:
per-layer lists, null where the layer has no such head or pair}}, by_head {frequency, q_pair_max, k_pair_max: [[[per
pair] per head] per layer]}}.

Applies to sinklab models only, whose config says each head's type; a Hugging Face model of the LLaMA family has RoPE
on every head, where the sink metric's values are the RoPE type's.
"""
from __future__ import annotations

import math
from typing import Any, Optional

import torch

from sinklab.model import POSITIONS
from sinklab.model.positional.base import HEAD_TYPES

from .base import ANY, METRICS, NON_NEGATIVE, PERCENT, Context, Metric, cell
from .sink import seen_column_sums, sink_rate

HEADS_PREFIX = "heads/"
CYCLES = ("partial_cycle", "full_cycle", "unrotated")  # the classes of a rotary pair (module docstring)
QK_KEYS = tuple(f"qk_max_{c}" for c in CYCLES)
TYPE_KEYS = ("sink1", "alpha1", "sink_share", *QK_KEYS)  # logged per type by this metric


def head_types(cfg) -> dict[str, torch.Tensor]:
    """{type: (L, H) bool, which heads of which layer have it} for each type present, in HEAD_TYPES order."""
    types = cfg.head_types()  # per layer, a type per query head
    return {t: torch.tensor([[x == t for x in layer] for layer in types])
            for t in HEAD_TYPES if any(t in layer for layer in types)}


def pair_frequencies(cfg) -> torch.Tensor:
    """(L, H, hd/2): the angular frequency of each layer's query heads' rotary pairs, from each layer's own config."""
    return torch.stack([POSITIONS.selected(c).pair_frequencies(c, layer)
                        for layer, c in enumerate(cfg.layer_configs())]).float()


def pair_cycles(freq: torch.Tensor, span: int) -> dict[str, torch.Tensor]:
    """Each pair's class (CYCLES) at the largest query-key distance `span`: {class: bool of freq's shape}."""
    turn = freq.double() * span
    return {"partial_cycle": (freq > 0) & (turn < 2 * math.pi), "full_cycle": (freq > 0) & (turn >= 2 * math.pi),
            "unrotated": freq == 0}


def pair_norm_max(x: torch.Tensor) -> torch.Tensor:
    """Queries or keys x (B, H, T, hd) -> (H, hd/2): the largest norm of each rotary pair (x_i, x_{i + hd/2}) over the
    sequences and tokens."""
    half = x.shape[-1] // 2
    sq = x.float().permute(1, 3, 0, 2).square()  # (H, hd, B, T): a reduction over the last dim, twice as fast on a CPU
    return (sq[:, :half] + sq[:, half:2 * half]).flatten(2).amax(-1).sqrt()  # (H, hd/2, B * T) -> (H, hd/2)


def type_scores(by_head: torch.Tensor, types: dict[str, torch.Tensor]) -> dict[str, dict[str, float]]:
    """A per-head score (L, H) grouped by head type (`head_types`): {type: {"max": the best head's, "mean": the mean
    over the type's heads}}."""
    return {t: {"max": by_head[mask].max().item(), "mean": by_head[mask].mean().item()} for t, mask in types.items()}


def largest(x: torch.Tensor) -> Optional[float]:
    """The largest value of x, None where it is empty."""
    return x.max().item() if x.numel() else None


@METRICS.register("heads")
class HeadTypeMetric(Metric):
    """alpha_1, Sink_1, the share of the sink heads and the q / k pair maxima of each head type (module docstring):
    alpha_1's column of token 1 summed from the maps' row chunks in float64, q and k's pair norms as they come."""

    records = frozenset({"q", "k", "maps"})
    needs_model = True  # each head's type and rotary frequencies come from the sinklab model's config
    bounds = ((r"^heads/\w+/(sink1|sink_share)$", PERCENT),
              (r"^heads/\w+/alpha1$", ANY),  # as sink/alpha1: any sign for kernels, differential attention
              (r"^heads/\w+/qk_max_(partial_cycle|full_cycle|unrotated)$", NON_NEGATIVE))
    json_key = "heads"
    # per type (those a model has are shown): Sink_1 and the q / k maxima of the outlier pairs and the unrotated ones
    headline = tuple(f"{HEADS_PREFIX}{t}/{key}" for t in HEAD_TYPES
                     for key in ("sink1", "qk_max_partial_cycle", "qk_max_unrotated"))

    def __init__(self, ctx: Context):
        super().__init__(ctx)
        cfg = ctx.model.cfg
        self.names = cfg.head_types()  # per layer, each query head's type
        self.types = head_types(cfg)
        self.freq = pair_frequencies(cfg)  # (L, H, hd/2)
        self.n_sink_tokens = cfg.n_sink_tokens
        self.T: Optional[int] = None  # real tokens per sequence, from the first batch
        self.q_max: dict[int, torch.Tensor] = {}  # layer -> (H, hd/2) over every batch so far
        self.k_max: dict[int, torch.Tensor] = {}
        self.column: dict[int, torch.Tensor] = {}  # this batch's layer -> (B, H) sums of token 1's column
        self.alpha: list[torch.Tensor] = []  # per batch (B, L, H)

    def update(self, layer: int, rec: dict[str, torch.Tensor]) -> None:
        self.T = rec["q"].shape[2]
        for name, maxima in (("q", self.q_max), ("k", self.k_max)):
            m = pair_norm_max(rec[name])
            maxima[layer] = torch.maximum(maxima[layer], m) if layer in maxima else m

    def update_maps(self, layer: int, rows: torch.Tensor, maps: torch.Tensor) -> None:
        n_extra = self.ctx.n_extra
        s = seen_column_sums(maps[..., :n_extra + 1].double(), rows, n_extra, 1)[..., 0]  # (B, H)
        self.column[layer] = self.column[layer] + s if layer in self.column else s

    def end_batch(self) -> None:
        if self.column:
            self.alpha.append(torch.stack([self.column[i] for i in sorted(self.column)], 1).cpu() / self.T)
        self.column = {}

    def result(self) -> dict[str, Any]:
        """alpha (N, L, H): each sequence's alpha_1; q_max, k_max (L, H, hd/2); span: the largest query-key distance."""
        stack = lambda d: torch.stack([d[i] for i in sorted(d)]).cpu()  # noqa: E731
        return {"alpha": torch.cat(self.alpha), "q_max": stack(self.q_max), "k_max": stack(self.k_max),
                "span": self.n_sink_tokens + self.T - 1}

    def pooled(self, result: dict[str, Any]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """qk (L, H, hd/2): the larger of the q and k pair maxima; each pair's class at the result's span."""
        return torch.maximum(result["q_max"], result["k_max"]), pair_cycles(self.freq, result["span"])

    def values(self, result: dict[str, Any], mask: torch.Tensor) -> dict[str, Optional[float]]:
        """alpha1, sink1 and qk_max_<class> (None without a pair of the class) of the heads `mask` (L, H)."""
        eps = self.ctx.eps[0]
        qk, cycles = self.pooled(result)
        a = result["alpha"][:, mask]  # (N, the heads of mask)
        return {"alpha1": a.mean().item(), "sink1": sink_rate(a[:, None, :, None], eps).item(),
                **{f"qk_max_{c}": largest(qk[mask][cls[mask]]) for c, cls in cycles.items()}}

    def by_type(self, result: dict[str, Any]) -> dict[str, dict[str, Any]]:
        """Per head type present: heads, alpha1, sink1, sink_share (None without a sink head), qk_max_<class> (None
        without a pair of the class), pairs {class: count}, q_pair_max and k_pair_max (per pair)."""
        alpha, eps = result["alpha"], self.ctx.eps[0]
        _, cycles = self.pooled(result)
        sinks = (alpha > eps).sum().item()  # sink heads of every type, over the sequences
        return {t: {"heads": int(mask.sum()), **self.values(result, mask),
                    "sink_share": 100.0 * (alpha[:, mask] > eps).sum().item() / sinks if sinks else None,
                    "pairs": {c: int(cls[mask].sum()) for c, cls in cycles.items()},
                    "q_pair_max": result["q_max"][mask].amax(0).tolist(),
                    "k_pair_max": result["k_max"][mask].amax(0).tolist()}
                for t, mask in self.types.items()}

    def by_layer(self, result: dict[str, Any]) -> dict[str, dict[str, list]]:
        """Per head type present, per layer (None where the layer has no head of the type or no pair of the class):
        alpha1, sink1, qk_max_<class>."""
        out: dict[str, dict[str, list]] = {}
        for t, mask in self.types.items():
            layers = [self.values(result, mask & (torch.arange(mask.shape[0]) == i)[:, None]) if mask[i].any()
                      else None for i in range(mask.shape[0])]
            out[t] = {key: [v[key] if v else None for v in layers] for key in ("alpha1", "sink1", *QK_KEYS)}
        return out

    def log(self, result: dict[str, Any]) -> dict[str, float]:
        return {f"{HEADS_PREFIX}{t}/{key}": values[key] for t, values in self.by_type(result).items()
                for key in TYPE_KEYS if values[key] is not None}

    def json(self, result: dict[str, Any]) -> dict[str, Any]:
        return {"eps": float(self.ctx.eps[0]), "span": result["span"],
                "types": [list(layer) for layer in self.names],
                "by_type": self.by_type(result), "by_layer": self.by_layer(result),
                "by_head": {"frequency": self.freq.tolist(), "q_pair_max": result["q_max"].tolist(),
                            "k_pair_max": result["k_max"].tolist()}}

    @classmethod
    def text(cls, part: dict[str, Any], res: dict[str, Any]) -> list[str]:
        """Per head type: its heads, Sink_1, alpha_1, its share of the sink heads and the q / k pair maxima by class."""
        lines = [f"head types: the sink and the largest q / k rotary pair norm per type (pairs that turn < 1, >= 1 "
                 f"or no cycle over the largest query-key distance, {part['span']})",
                 f"{'type':<9} {'heads':>5} {'Sink_1%':>7} {'alpha_1':>7} {'share%':>7} {'partial':>9} "
                 f"{'full':>9} {'unrot':>9}"]
        for t, v in part["by_type"].items():
            lines.append(f"{t:<9} {v['heads']:>5} {cell(v['sink1'], 7, 2)} {cell(v['alpha1'], 7, 3)} "
                         f"{cell(v['sink_share'], 7, 1)} " + " ".join(cell(v[f'qk_max_{c}'], 9, 3) for c in CYCLES))
        return lines
