"""Sinks at any position (secondary sinks, arXiv 2512.22213): per layer, which real token positions pull a head's
attention, not only the first k.

For layer l, head h and a sequence of T real tokens (1-indexed), alpha_k = 1/(T-k+1) * sum_{i=k..T} A[i, k] as in the
sink metric, now for every position k that at least q_min = min(16, T) queries see, i.e. k <= T - q_min + 1
(positions 1..49 at T = 64). The limit is there because alpha_k of a late k averages few queries: a head that only
attends to the last w tokens gives alpha_k <= w / (T-k+1), so with q_min queries it passes eps only when
w >= eps * q_min (5 tokens at eps 0.3), and position T itself (one query, A[T, T] alone) never counts. Head h has a
sink at k in a sequence when alpha_k > eps (the first eps); a *secondary* sink is one at k > 1. Maps whose rows do not
sum to one are scored renormalised, |A| / sum |A| (as Sink*); the extra key columns (bias slot, sink tokens) are the
sink metric's (sink/slot_*), not positions.

Logged (per sequence, then averaged over the probe sequences):
- act/secondary_sink_heads, act/layer<i>/secondary_sink_heads: % of heads with a sink at some position k > 1;
- act/sink_positions, act/layer<i>/sink_positions: the number of distinct positions at which some head (of any layer,
  of layer i) has a sink;
- act/secondary_sink_first_layer, act/secondary_sink_last_layer: the first and the last layer (0-based, as layer<i>)
  where any head of any probe sequence has a secondary sink: the depth range (not logged when no layer has one).
`measure --json` secondary_sinks: eps, min_queries, scored_positions (the last position scored), the values above,
by_layer, by_head [[% of sequences with a secondary sink, per head] per layer], and positions [{"k": {"share": % of
(sequence, head) pairs of the layer with a sink at k, "alpha": their mean alpha_k}} per layer], which shows where the
sinks sit and at which levels of alpha_k.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from sinklab.keys import ACT_PREFIX

from .base import METRICS, NON_NEGATIVE, PERCENT, Context, Metric, layer_logs, layer_table
from .sink import renormalise, seen_column_sums

MIN_QUERIES = 16


def scored_positions(T: int) -> int:
    """How many positions 1..P are scored at T real tokens: those that at least min(MIN_QUERIES, T) queries see."""
    return T - min(MIN_QUERIES, T) + 1


class ColumnMeans:
    """alpha_k of every real position k of one layer, from its map in chunks of query rows: the column sums over the
    queries i >= k, in float64, over the real keys; `alpha()` (B, H, P) of the scored positions."""

    def __init__(self, ctx: Context):
        self.ctx = ctx
        self.sums: Optional[torch.Tensor] = None  # (B, H, T)

    def scored(self, maps: torch.Tensor) -> torch.Tensor:
        """A chunk's map (B, H, R, n_extra + T) as it is scored: renormalised unless rows are known to sum to one."""
        return maps if self.ctx.row_normalised is True else renormalise(maps)

    def add(self, rows: torch.Tensor, maps: torch.Tensor) -> None:
        T = maps.shape[-1] - self.ctx.n_extra  # every real key; a chunk of rows is summed in the map's precision
        s = seen_column_sums(self.scored(maps), rows, self.ctx.n_extra, T).double()  # (B, H, T)
        self.sums = s if self.sums is None else self.sums + s

    def alpha(self) -> torch.Tensor:
        T = self.sums.shape[-1]
        P = scored_positions(T)
        return self.sums[..., :P] / (T - torch.arange(P, device=self.sums.device)).double()  # (B, H, P)


@METRICS.register("secondary_sinks")
class SecondarySinks(Metric):
    records = frozenset({"maps"})
    bounds = ((r"^act/(layer\d+/)?secondary_sink_heads$", PERCENT),
              (r"^act/(layer\d+/)?sink_positions$", NON_NEGATIVE),
              (r"^act/secondary_sink_(first|last)_layer$", NON_NEGATIVE))
    json_key = "secondary_sinks"
    headline = ("act/secondary_sink_heads", "act/sink_positions")

    def __init__(self, ctx: Context):
        super().__init__(ctx)
        self.columns: dict[int, ColumnMeans] = {}  # layer -> this batch's column sums
        self.n = 0  # sequences seen
        self.acc: dict[str, torch.Tensor] = {}  # sums over sequences (float64)

    def update_maps(self, layer: int, rows: torch.Tensor, maps: torch.Tensor) -> None:
        self.columns.setdefault(layer, ColumnMeans(self.ctx)).add(rows, maps)

    def end_batch(self) -> None:
        if not self.columns:
            return
        alpha = torch.stack([self.columns[i].alpha() for i in sorted(self.columns)], 1).cpu()  # (B, L, H, P)
        self.columns = {}
        sink = alpha > self.ctx.eps[0]
        parts = {"secondary": sink[..., 1:].any(-1).double().sum(0),  # (L, H): sequences with a secondary sink
                 "positions": sink.any(2).double().sum((0, -1)),  # (L,): distinct sink positions, summed over seqs
                 "positions_all": sink.any(2).any(1).double().sum(),  # (): over every layer
                 "at": sink.double().sum((0, 2)),  # (L, P): (sequence, head) pairs with a sink at k
                 "alpha_at": (alpha * sink).sum((0, 2))}  # (L, P): their alpha_k, summed
        for name, value in parts.items():
            self.acc[name] = self.acc[name] + value if name in self.acc else value
        self.n += alpha.shape[0]

    def result(self) -> dict[str, Any]:
        acc, n = self.acc, self.n
        by_head = 100.0 * acc["secondary"] / n  # (L, H)
        by_layer = by_head.mean(1)
        has = [i for i, v in enumerate(by_layer.tolist()) if v > 0]
        positions = [{str(k + 1): {"share": 100.0 * c / (n * by_head.shape[1]), "alpha": s / c}
                      for k, (c, s) in enumerate(zip(count.tolist(), total.tolist())) if c > 0}
                     for count, total in zip(acc["at"], acc["alpha_at"])]
        return {"eps": self.ctx.eps[0], "min_queries": MIN_QUERIES, "scored_positions": acc["at"].shape[1],
                "secondary_sink_heads": by_head.mean().item(), "sink_positions": (acc["positions_all"] / n).item(),
                "first_layer": has[0] if has else None, "last_layer": has[-1] if has else None,
                "by_layer": {"secondary_sink_heads": by_layer.tolist(),
                             "sink_positions": (acc["positions"] / n).tolist()},
                "by_head": by_head.tolist(), "positions": positions}

    @staticmethod
    def flatten(result: dict[str, Any]) -> dict[str, float]:
        out = {ACT_PREFIX + key: float(result[key]) for key in ("secondary_sink_heads", "sink_positions")}
        out.update(layer_logs(result["by_layer"], list(result["by_layer"])))
        for end in ("first", "last"):
            if result[f"{end}_layer"] is not None:
                out[f"{ACT_PREFIX}secondary_sink_{end}_layer"] = float(result[f"{end}_layer"])
        return out

    @classmethod
    def text(cls, part: dict[str, Any], res: dict[str, Any]) -> list[str]:
        """Per layer and over all layers; the layers where secondary sinks are."""
        first, last = part["first_layer"], part["last_layer"]
        where = "no secondary sink in any layer" if first is None else \
            f"secondary sinks in layer {first}" if first == last else f"secondary sinks in layers {first} to {last}"
        return [f"sinks at any position k <= {part['scored_positions']} (alpha_k > {part['eps']:g}) per layer: % of "
                "heads with one at k > 1, distinct positions",
                *layer_table([("2nd sink%", part["by_layer"]["secondary_sink_heads"], 9, 2),
                              ("positions", part["by_layer"]["sink_positions"], 9, 2)],
                             overall=[part["secondary_sink_heads"], part["sink_positions"]]),
                where]
