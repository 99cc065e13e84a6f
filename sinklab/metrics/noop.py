"""The no-op signature of sinks: a sink takes much attention but adds little, because its value is small (value
drain) and so is the output of the queries that attend to it (a head "doing nothing").

Sink positions are the `secondary_sinks` metric's: in each sequence, the real positions k (any k that at least
min(16, T) queries see) where head h has alpha_k > eps (the first eps). Per layer, over sequences and heads:
- value_drain_ratio: the mean over (sequence, head, sink position k) of ||v_k|| / median_j ||v_j||, the value norm of
  the sink token against the median token's of the same sequence and head (the lower middle value for an even T;
  values as the op sees them, after the kv heads' repeat); < 1: the sink's value is drained;
- sink_query_share: the share of (sequence, head, query i) whose attention on the head's sink positions of that
  sequence is at least one half (|A| / sum |A| where rows do not sum to one): the queries that sink;
- sink_output_ratio: the mean norm of the head's output o_i = sum_j A[i, j] v_j (every key, bias slot and sink
  tokens included; before the gate and the output projection) over the queries that sink, divided by its mean over
  the queries that do not; < 1: sinking is a no-op.
Which queries sink is known only after the whole map's column sums, so the metric reads each layer's map twice
(`reads_maps_twice`: first the columns, then the rows); memory stays one chunk of one map.

Logged: act/value_drain_ratio, act/sink_output_ratio (pooled over layers), act/sink_query_share and the same per layer
as act/layer<i>/...; a ratio only where both its parts were seen (a layer without sinks logs none). `measure --json`
noop: the same, and by_layer {value_drain_ratio, sink_query_share, sink_output_ratio, sink_output_norm,
other_output_norm} (null where not seen).
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from sinklab.keys import ACT_PREFIX

from .base import METRICS, NON_NEGATIVE, UNIT, Context, Metric, layer_logs, layer_table
from .outliers import lower_median
from .secondary_sinks import ColumnMeans

SINKING = 0.5  # a query sinks when at least this share of its attention is on the head's sink positions
SUMS = ("drain", "drained", "sink_norm", "sink_queries", "other_norm", "other_queries")


def ratio(num: Optional[float], den: Optional[float]) -> Optional[float]:
    """num / den, None where either is unknown or den is 0."""
    return num / den if num is not None and den else None


@METRICS.register("noop")
class NoOpSignature(Metric):
    records = frozenset({"v", "v_extra", "maps"})
    reads_maps_twice = True
    bounds = ((r"^act/(layer\d+/)?(value_drain|sink_output)_ratio$", NON_NEGATIVE),
              (r"^act/(layer\d+/)?sink_query_share$", UNIT))
    json_key = "noop"
    headline = ("act/value_drain_ratio", "act/sink_output_ratio")

    def __init__(self, ctx: Context):
        super().__init__(ctx)
        self.values: dict[int, dict] = {}  # layer -> this batch's v, v_extra, column sums, sink mask
        self.sums = {name: torch.zeros(ctx.n_layer, dtype=torch.float64) for name in SUMS}

    def update(self, layer: int, rec: dict[str, torch.Tensor]) -> None:
        if "v" in rec:  # a Hugging Face attention layout `sinklab.targets.transformers_recorder.project_qkv` does not know has none
            self.values[layer] = {"v": rec["v"].float(), "v_extra": rec.get("v_extra"),
                                  "columns": ColumnMeans(self.ctx)}

    def update_maps(self, layer: int, rows: torch.Tensor, maps: torch.Tensor) -> None:
        if layer in self.values:
            self.values[layer]["columns"].add(rows, maps)

    def _sinks(self, layer: int) -> torch.Tensor:
        """(B, H, T) bool: the head's sink positions in each sequence; the value-drain sums added once."""
        state = self.values[layer]
        if "sinks" not in state:
            alpha = state["columns"].alpha()  # (B, H, P)
            v_norm = state["v"].norm(dim=-1, dtype=torch.float64)  # (B, H, T)
            sinks = torch.zeros_like(v_norm, dtype=torch.bool)
            sinks[..., :alpha.shape[-1]] = alpha > self.ctx.eps[0]
            drain = v_norm / lower_median(v_norm)[..., None].clamp_min(1e-30)  # ||v_k|| / median_j
            self.sums["drain"][layer] += drain[sinks].sum().item()
            self.sums["drained"][layer] += sinks.sum().item()
            state["sinks"] = sinks
        return state["sinks"]

    def update_maps_again(self, layer: int, rows: torch.Tensor, maps: torch.Tensor) -> None:
        if layer not in self.values:
            return
        sinks, state = self._sinks(layer), self.values[layer]
        n_extra = self.ctx.n_extra
        a = maps.float()
        on_sinks = (state["columns"].scored(a)[..., n_extra:] * sinks[:, :, None, :]).sum(-1)  # (B, H, R)
        sinking = on_sinks >= SINKING
        out = a[..., n_extra:] @ state["v"]  # (B, H, R, T) @ (B, H, T, hd) -> (B, H, R, hd)
        if n_extra and state["v_extra"] is not None:  # the extra keys' values (a learned sink logit has none: 0)
            out = out + a[..., :n_extra] @ state["v_extra"].float()
        norm = out.norm(dim=-1, dtype=torch.float64)  # (B, H, R)
        for group, mask in (("sink", sinking), ("other", ~sinking)):
            self.sums[f"{group}_norm"][layer] += norm[mask].sum().item()
            self.sums[f"{group}_queries"][layer] += mask.sum().item()

    def end_batch(self) -> None:
        self.values = {}

    def result(self) -> dict[str, Any]:
        s = {name: v.tolist() for name, v in self.sums.items()}
        total = {name: sum(v) for name, v in s.items()}

        def values(d: dict) -> dict[str, Optional[float]]:
            sink_norm = ratio(d["sink_norm"], d["sink_queries"])
            other_norm = ratio(d["other_norm"], d["other_queries"])
            return {"value_drain_ratio": ratio(d["drain"], d["drained"]),
                    "sink_query_share": ratio(d["sink_queries"], d["sink_queries"] + d["other_queries"]),
                    "sink_output_ratio": ratio(sink_norm, other_norm),
                    "sink_output_norm": sink_norm, "other_output_norm": other_norm}

        layers = [values({name: v[i] for name, v in s.items()}) for i in range(self.ctx.n_layer)]
        return {"sinking": SINKING, **values(total),
                "by_layer": {key: [layer[key] for layer in layers] for key in layers[0]} if layers else {}}

    @staticmethod
    def flatten(result: dict[str, Any]) -> dict[str, float]:
        keys = ("value_drain_ratio", "sink_query_share", "sink_output_ratio")
        out = {ACT_PREFIX + key: float(result[key]) for key in keys if result[key] is not None}
        return {**out, **layer_logs(result["by_layer"], keys)}

    @classmethod
    def text(cls, part: dict[str, Any], res: dict[str, Any]) -> list[str]:
        """Per layer and pooled over layers; '-' where a ratio's parts were not seen (a layer without sinks)."""
        share = lambda x: None if x is None else 100 * x  # noqa: E731
        g = part["by_layer"]
        return [f"no-op signature per layer: v drain = the sinks' ||v|| / the median token's; sinking % = queries "
                f"with >= {part['sinking']:g}", "of their attention on the sinks; out ratio = their output norm / the "
                "other queries'",
                *layer_table([("v drain", g.get("value_drain_ratio", []), 8, 3),
                              ("sinking %", [share(x) for x in g.get("sink_query_share", [])], 9, 2),
                              ("out ratio", g.get("sink_output_ratio", []), 9, 3)],
                             overall=[part["value_drain_ratio"], share(part["sink_query_share"]),
                                      part["sink_output_ratio"]])]
