"""Gate statistics (issue 15, after Qiu et al. 2025, arXiv 2505.06708, section 4): the mean gate score, the share of
scores below 0.1 (the paper's sparsity: most sigmoid scores of a G1 gate are small) and the mean score on the first
token (where a gate can switch off the attention sink's contribution).

The hook: every gate (`sinklab/model/gates.py`) passes its scores through its submodule `gate_act`
(`blocks.<i>.attn.gate_proj.gate_act`, an nn.Sigmoid or nn.SiLU), whose output is act(X W_theta) of shape
(B, S + T, width) for S learned sink tokens and T real tokens, before the scores are arranged per head. `record_gates`
registers a forward hook on each and keeps the real tokens' scores, one list per gated layer:

    with record_gates(model) as values:   # values[l]: a list of (B, T, width) tensors, one per forward
        model(tokens)
    stats = gate_stats(values)            # {"gate_mean": .., "gate_low_share": .., "gate_first_token": ..,
                                          #  "layer0/gate_mean": .., ...}
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Sequence

import torch
from torch import nn

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
    out: dict[str, float] = {}
    total = torch.zeros(5, dtype=torch.float64)  # sum, count, low count, first-token sum, first-token count
    for i, layer in enumerate(values):
        sums = torch.zeros(5, dtype=torch.float64)
        for g in layer:
            g = g.double()
            sums += torch.stack([g.sum(), torch.tensor(g.numel()), (g < low).sum(), g[:, 0].sum(),
                                 torch.tensor(g[:, 0].numel())]).to(sums)
        out.update({f"layer{i}/{k}": v for k, v in from_sums(sums).items()})
        total += sums
    return {**out, **from_sums(total)}


def from_sums(sums: torch.Tensor) -> dict[str, float]:
    """(sum, count, low count, first-token sum, first-token count) -> the three statistics; empty without scores."""
    s, n, n_low, s1, n1 = sums.tolist()
    return {"gate_mean": s / n, "gate_low_share": n_low / n, "gate_first_token": s1 / n1} if n else {}
