"""Gate statistics (issue 15, after Qiu et al. 2025, arXiv 2505.06708, section 4): the mean gate score, the share of
scores below 0.1 (the paper's sparsity: most sigmoid scores of a G1 gate are small) and the mean score on the first
token (where a gate can switch off the attention sink's contribution).

The hook: every gate (`sinklab/model/gates.py`) passes its scores through its submodule `gate_act`
(`blocks.<i>.attn.gate_proj.gate_act`, an nn.Sigmoid, nn.SiLU or ScaledSigmoid), whose output is act(X W_theta) of
shape (B, S + T, width) for S learned sink tokens and T real tokens, before the scores are arranged per head.
`record_gates` registers a forward hook on each and keeps the real tokens' scores, one list per gated layer:

    with record_gates(model) as values:   # values[l]: a list of (B, T, width) tensors, one per forward
        model(tokens)
    stats = gate_stats(values)            # {"gate_mean": .., "gate_low_share": .., "gate_first_token": ..,
                                          #  "layer0/gate_mean": .., ...}

Over many batches, `gate_sums` reduces each batch's scores to per-layer sums that add up, and `stats_from_sums` turns
the total into the same statistics: the `gates` metric (registered here) does so in the probe forwards it records,
for the sink callback (`act/gate_*`) and `sinklab measure` (`gates`).
"""
from __future__ import annotations

import contextlib
import math
from typing import Any, Iterator, Sequence

import torch
from torch import nn

from sinklab.keys import ACT_PREFIX

from .base import METRICS, UNIT, Context, Metric, layer_table

GATE_KEYS = ("gate_mean", "gate_low_share", "gate_first_token")
LOW = 0.1  # a score below this counts as (nearly) closed


@contextlib.contextmanager
def record_gates(model: nn.Module) -> Iterator[list[list[torch.Tensor]]]:
    """Record the gate scores of the real tokens in every forward inside the block: one list per gated layer (empty
    for a model without gates), each entry (B, T, width), detached, in float32."""
    n_sink = model.cfg.n_sink_tokens
    acts = [act for block in model.blocks if (act := getattr(block.attn.gate_proj, "gate_act", None)) is not None]
    values: list[list[torch.Tensor]] = [[] for _ in acts]

    def hook(layer: list[torch.Tensor]):
        return lambda module, inputs, out: layer.append(out[:, n_sink:].detach().float())

    handles = [act.register_forward_hook(hook(layer)) for act, layer in zip(acts, values)]
    try:
        yield values
    finally:
        for h in handles:
            h.remove()


def gate_stats(values: Sequence[Sequence[torch.Tensor]], low: float = LOW) -> dict[str, float]:
    """values[l]: layer l's gate scores, tensors (B, T, width) with token 1 at index 0 -> per layer
    (`layer<l>/<key>`) and over all layers (`<key>`, every score weighted alike):
      gate_mean         the mean score;
      gate_low_share    the share of scores below `low` (0.1);
      gate_first_token  the mean score on token 1.
    Empty for a model without gates (or without recorded scores)."""
    return stats_from_sums(gate_sums(values, low))


def gate_sums(values: Sequence[Sequence[torch.Tensor]], low: float = LOW) -> torch.Tensor:
    """values as `gate_stats`'s -> (L, 5) float64 on the scores' device, per layer: the sum of the scores, their
    count, the count below `low`, the sum and the count on token 1. Sums of batches add up: `activation_stats`
    reduces each batch's scores to these and drops them, so the recorded scores never outgrow one batch."""
    rows = []
    for layer in values:
        row = torch.zeros(5, dtype=torch.float64, device=layer[0].device if layer else None)
        for g in layer:
            g = g.double()
            row += torch.stack([g.sum(), torch.tensor(g.numel()).to(row), (g < low).sum().to(row), g[:, 0].sum(),
                                torch.tensor(g[:, 0].numel()).to(row)])
        rows.append(row)
    return torch.stack(rows) if rows else torch.zeros(0, 5, dtype=torch.float64)


def stats_from_sums(sums: torch.Tensor) -> dict[str, float]:
    """(L, 5) `gate_sums` -> the statistics per layer (`layer<l>/<key>`) and over all layers; empty without scores."""
    sums = sums.cpu()
    out: dict[str, float] = {}
    for i, row in enumerate(sums):
        out.update({f"layer{i}/{k}": v for k, v in from_sums(row).items()})
    return {**out, **from_sums(sums.sum(0))}


def from_sums(sums: torch.Tensor) -> dict[str, float]:
    """(sum, count, low count, first-token sum, first-token count) -> the three statistics; empty without scores."""
    s, n, n_low, s1, n1 = sums.tolist()
    return {"gate_mean": s / n, "gate_low_share": n_low / n, "gate_first_token": s1 / n1} if n else {}


SILU_MIN = -0.2784645427610738  # min_x x * sigmoid(x), at x = -1.2785 (where 1 + x (1 - sigmoid(x)) = 0)


@METRICS.register("gates")
class GateScores(Metric):
    """`gate_stats` of the probe forwards (empty for a model without gates)."""

    records = frozenset({"gate"})
    bounds = ((r"^act/(layer\d+/)?gate_low_share$", UNIT),  # share of gate scores below 0.1
              # mean gate scores: in [0, 1] for model.gate_act=sigmoid, [0, 2] for scaled_sigmoid, [SILU_MIN, inf)
              # for silu
              (r"^act/(layer\d+/)?gate_(mean|first_token)$", (SILU_MIN, math.inf)))
    json_key = "gates"
    headline = ("act/gate_mean", "act/gate_first_token")

    def __init__(self, ctx: Context):
        super().__init__(ctx)
        self.values: dict[int, list[torch.Tensor]] = {}
        self.totals = None

    def update(self, layer: int, rec: dict[str, torch.Tensor]) -> None:
        if "gate" in rec:
            self.values.setdefault(layer, []).append(rec["gate"])

    def end_batch(self) -> None:
        if self.values:  # this batch's scores -> sums, then dropped: memory stays one batch's
            sums = gate_sums([self.values[i] for i in sorted(self.values)])
            self.totals = sums if self.totals is None else self.totals + sums
        self.values = {}

    def result(self) -> dict[str, float]:
        return stats_from_sums(self.totals) if self.totals is not None else {}

    @staticmethod
    def flatten(result: dict[str, Any]) -> dict[str, float]:
        return {ACT_PREFIX + k: v for k, v in result.items()}

    def json(self, result: dict[str, Any]) -> dict:
        """`gate_stats`' names (gate_mean, ..., layer<l>/gate_mean, ...) -> {mean, low_share, first_token,
        by_layer {...: per-layer lists}}; {} without gates."""
        if not result:
            return {}
        n_layers = sum(key.endswith("/gate_mean") for key in result)
        return {**{key.removeprefix("gate_"): result[key] for key in GATE_KEYS},
                "by_layer": {key.removeprefix("gate_"): [result[f"layer{i}/{key}"] for i in range(n_layers)]
                             for key in GATE_KEYS}}

    @classmethod
    def text(cls, part: dict[str, Any], res: dict[str, Any]) -> list[str]:
        """Per layer and over all layers; nothing for a model without gates."""
        if not part:
            return []
        model, g = res.get("model") or {}, part["by_layer"]
        kind = f"model.gate={model.get('gate')}, gate_act={model.get('gate_act')}"
        return [f"gate scores act(X W_theta) per layer ({kind}; real tokens)",
                *layer_table([("mean", g["mean"], 8, 4), ("< 0.1 %", [100 * x for x in g["low_share"]], 8, 1),
                              ("token 1", g["first_token"], 8, 4)],
                             overall=[part["mean"], 100 * part["low_share"], part["first_token"]])]
