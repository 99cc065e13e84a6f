"""The interventions of `sinklab eval intervene` (the command, and what each intervention is: `sinklab.cli.intervene`):
the probe set's massive activations, the mask functions that drop a key, the hook that sets activations, and the
validation perplexity and Sink_1 of the model unchanged and under each; the key / value interventions in some
layers, in each layer alone (`per_layer`) and mask_first in each head alone (`per_head`). The model is a
`sinklab.targets.Target` of any source: interventions are opened on it (`Target.masked` with a mask function or a
`sinklab.model.masks.LayerMask`, `Target.set_output`, `Target.zero_value`), never set on it. Registered as the
evaluation `intervene` (`Interventions`: its sweep columns).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Iterable, Optional, Sequence, Union

import torch

from sinklab.errors import UserError
from sinklab.evals.registry import ANY, EVALUATIONS, NON_NEGATIVE, PERCENT, PERPLEXITY, UNIT, Evaluation
from sinklab.metrics.base import Metric
from sinklab.model.lm_loss import perplexity
from sinklab.model.masks import LayerMask, MaskMod
from sinklab.stats import spearman
from sinklab.targets.interface import Target

INTERVENTIONS = ("zero", "mean", "mask_first", "mask_random", "zero_value_first")
IN_LAYERS = ("mask_first", "mask_random", "zero_value_first")  # applied in the chosen layers (--layers)
PER_LAYER = ("mask_first", "zero_value_first")  # the key / value interventions applied in each layer alone


# ------------------------------------------------------------------------------------------------ interventions
@dataclass
class Intervention:
    """What an intervention changes, passed to the model rather than set on it: `mask`, a mask function every query
    obeys on top of the model's own (forward's `extra_mask`; the fused kernels' is_causal shortcut is off then), or a
    `LayerMask` that the queries of some layers / heads obey, and `hooks`, a context that replaces activations or
    values while it is open."""

    mask: Union[MaskMod, LayerMask, None] = None
    hooks: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext


def drop_first_key(first: int) -> MaskMod:
    """Queries after position `first` (the first text token) do not see its key."""
    def mask(b, h, q_idx, kv_idx):
        return (kv_idx != first) | (q_idx == first)
    return mask


def drop_random_key(first: int, n_pos: int, seed: int, device) -> MaskMod:
    """Each query q >= first + 2 does not see one key drawn uniformly from first + 1 .. q - 1 (neither the first
    token nor itself); earlier queries see all their keys."""
    g = torch.Generator().manual_seed(seed)
    dropped = torch.full((n_pos,), -1, dtype=torch.long)
    for q in range(first + 2, n_pos):
        dropped[q] = int(torch.randint(first + 1, q, (1,), generator=g))
    dropped = dropped.to(device)

    def mask(b, h, q_idx, kv_idx):
        return kv_idx != dropped[q_idx]
    return mask


# ----------------------------------------------------------------------------------------------- the model evaluated
class LayerOutputs(Metric):
    """Records each layer's residual stream (B, T, d) of the real tokens of one batch, float32 (a recorder for
    `residuals`, not a registered metric)."""

    records = frozenset({"h"})

    def __init__(self):
        super().__init__(ctx=None)
        self.layers: dict[int, torch.Tensor] = {}

    def update(self, layer: int, rec: dict[str, torch.Tensor]) -> None:
        self.layers[layer] = rec["h"].float()


def residuals(target: Target, batch: torch.Tensor) -> list[torch.Tensor]:
    """Each layer's residual stream (B, T, d) of the real tokens of one batch, float32."""
    rec = LayerOutputs()
    target.recorder().run(batch, [rec])
    return [rec.layers[i] for i in sorted(rec.layers)]


def sink_summary(target: Target, probe: torch.Tensor) -> tuple[dict, list[list[float]]]:
    """`sinklab.metrics.summarise` of the sink metric (k = 1) of the probe set, under the target's open mask, and
    alpha_1 of each layer and head (L, H), the mean over the probe sequences."""
    from sinklab.metrics import summarise

    (metric,) = target.measure(probe, ["sink"], k=1)
    scores = metric.scores()
    return summarise(scores, slot_names=metric.ctx.slot_names), scores.alpha[..., 0].mean(0).tolist()


def model_shape(target: Target) -> tuple[int, int]:
    """(layers, query heads) of the target, from its recorder's context (no forward)."""
    ctx = target.recorder().context()
    return ctx.n_layer, ctx.n_head


@torch.no_grad()
def find_massive(target: Target, tokens: torch.Tensor, n_channels: int, batch_size: int = 32) -> dict:
    """The massive activations of the probe set (see the module docstring): layer (from 0), token (from 1), channels, their
    mean |h| and mean signed value, and the top mean |h| over the median |h| of that layer."""
    abs_sum, signed_sum, medians = None, None, None
    for start in range(0, tokens.shape[0], batch_size):
        h = torch.stack(residuals(target, tokens[start:start + batch_size]), 1)  # (B, L, T, d) of the real tokens
        a, sg = h.abs().sum(0), h.sum(0)  # (L, T, d)
        med = h.abs().flatten(2).median(-1).values.sum(0)  # (L,)
        abs_sum = a if abs_sum is None else abs_sum + a
        signed_sum = sg if signed_sum is None else signed_sum + sg
        medians = med if medians is None else medians + med
    n = tokens.shape[0]
    mean_abs, mean_signed, median = abs_sum / n, signed_sum / n, medians / n
    top = mean_abs.flatten(1).max(-1).values  # (L,)
    layer = int(torch.nonzero(top >= 0.5 * top.max())[0])
    token = int(mean_abs[layer].max(-1).values.argmax())
    if not 1 <= n_channels <= mean_abs.shape[-1]:
        raise UserError(f"--channels {n_channels} must be in 1..{mean_abs.shape[-1]} (the model width)")
    channels = mean_abs[layer, token].topk(n_channels).indices
    return {"layer": layer, "token": token + 1, "channels": channels.tolist(),
            "values": mean_abs[layer, token, channels].tolist(),
            "mean_values": mean_signed[layer, token, channels].tolist(),
            "ratio": float(top[layer] / median[layer].clamp(min=1e-12))}


def intervention(name: str, target: Target, massive: dict, n_pos: int, seed: int, device,
                 layers: Optional[Iterable[int]] = None, heads: Optional[Iterable[int]] = None) -> Intervention:
    """The intervention `name`; one of IN_LAYERS in `layers` only (None: every layer) and, a mask, obeyed by the
    query `heads` only (None: every head)."""
    S = target.n_prefix
    if name == "none":
        return Intervention()
    if name in ("zero", "mean"):
        values = torch.tensor(massive["mean_values"]) if name == "mean" else torch.zeros(len(massive["channels"]))
        position = S + massive["token"] - 1  # the token's sequence position, learned sink tokens first
        return Intervention(hooks=lambda: target.set_output(massive["layer"], position, massive["channels"],
                                                          values.to(device)))
    if name == "zero_value_first":
        return Intervention(hooks=lambda: target.zero_value(layers, S))
    mask = drop_first_key(S) if name == "mask_first" else drop_random_key(S, n_pos, seed, device)
    return Intervention(mask=mask if layers is None and heads is None else LayerMask(mask, layers, heads))


# ----------------------------------------------------------------------------------------------------- evaluation
def evaluate(target: Target, val: list[torch.Tensor], probe: torch.Tensor, names: Sequence[str], massive: dict,
             seed: int, layers: Optional[Sequence[int]] = None) -> tuple[dict, int, list[list[float]]]:
    """{name: row} for the unchanged model and each intervention (those of IN_LAYERS in `layers`, None: all), the
    number of scored validation targets (`Target.nll` of the validation blocks (B, T + 1), Sink_1 of the probe set),
    and the unchanged model's alpha_1 per layer and head (L, H)."""
    rows, count, by_head = {}, 0, []
    n_pos = target.n_prefix + max(val[0].shape[1] - 1, probe.shape[1])
    for name in ("none", *names):
        iv = intervention(name, target, massive, n_pos, seed, probe.device, layers)
        with iv.hooks(), target.masked(iv.mask), torch.no_grad():
            loss, count = target.nll(val)
            summary, alpha1 = sink_summary(target, probe)
        if name == "none":
            by_head = alpha1
        rows[name] = {"loss": loss, "ppl": perplexity(loss), "sink1": summary["sink1"], "alpha1": summary["alpha1"]}
        if "sink1_star" in summary:
            rows[name]["sink1_star"] = summary["sink1_star"]
    for row in rows.values():
        row["dppl"] = row["ppl"] - rows["none"]["ppl"]
    return rows, count, by_head


def val_ppl(target: Target, val: list[torch.Tensor], iv: Intervention) -> float:
    """The validation perplexity under one intervention."""
    with iv.hooks(), target.masked(iv.mask), torch.no_grad():
        return perplexity(target.nll(val)[0])


def per_layer(target: Target, val: list[torch.Tensor], names: Sequence[str], layers: Sequence[int],
              base_ppl: float) -> dict:
    """{name: [{layer, ppl, dppl}, ...]}: each key / value intervention of `names` (PER_LAYER) in each layer of
    `layers` alone; dppl against the unchanged model's `base_ppl`."""
    device = val[0].device
    out = {}
    for name in names:
        out[name] = []
        for layer in layers:
            ppl = val_ppl(target, val, intervention(name, target, {}, 0, 0, device, [layer]))
            out[name].append({"layer": layer, "ppl": ppl, "dppl": ppl - base_ppl})
    return out


def per_head(target: Target, val: list[torch.Tensor], layers: Sequence[int], n_head: int,
             alpha1: list[list[float]], base_ppl: float) -> dict:
    """mask_first in each (layer, query head) of `layers` alone: {"mask_first": [{layer, head, ppl, dppl, alpha1},
    ...], "spearman_alpha1_dppl": Spearman's rho between the heads' alpha_1 in the unchanged model (`alpha1`, (L, H))
    and their dppl (None under 3 heads or for a constant column)}."""
    device = val[0].device
    heads = []
    for layer in layers:
        for head in range(n_head):
            ppl = val_ppl(target, val, intervention("mask_first", target, {}, 0, 0, device, [layer], [head]))
            heads.append({"layer": layer, "head": head, "ppl": ppl, "dppl": ppl - base_ppl,
                          "alpha1": alpha1[layer][head]})
    return {"mask_first": heads,
            "spearman_alpha1_dppl": spearman([h["alpha1"] for h in heads], [h["dppl"] for h in heads])}


# ----------------------------------------------------------------------------------------------------- in sweeps
_ROWS = "|".join(("none", *INTERVENTIONS))


_PER_LAYER = "|".join(PER_LAYER)


@EVALUATIONS.register("intervene")
class Interventions(Evaluation):
    """`sinklab eval intervene`; in a sweep's intervene.csv: massive_layer (0-based, as every layer number),
    massive_token (1-based), massive_ratio, then for the unchanged model (`none`) and each intervention <row>_ppl,
    _dppl, _sink1, _alpha1 (and _sink1_star where the operation is unnormalised); with --per-layer
    layer<l>_<intervention>_ppl and _dppl, with --per-head per_head_spearman (alpha_1 against dppl)."""

    command = "sinklab.cli.intervene"
    summary = "perplexity and Sink_1 after zeroing massive channels / masking keys / zeroing values"
    bounds = ((r"^massive_(layer|token|ratio)$", NON_NEGATIVE),
              (rf"^({_ROWS})_ppl$", PERPLEXITY),
              (rf"^({_ROWS})_dppl$", ANY),
              (rf"^({_ROWS})_sink1(_star)?$", PERCENT),
              (rf"^({_ROWS})_alpha1$", UNIT),
              (rf"^layer\d+_({_PER_LAYER})_ppl$", PERPLEXITY),
              (rf"^layer\d+_({_PER_LAYER})_dppl$", ANY),
              (r"^per_head_spearman$", (-1.0, 1.0)))

    @staticmethod
    def row(result: dict) -> dict:
        m = result["massive"]
        row = {"massive_layer": m["layer"], "massive_token": m["token"], "massive_ratio": m["ratio"]}
        row.update({f"{name}_{k}": v for name, r in result["rows"].items() for k, v in r.items() if k != "loss"})
        row.update({f"layer{r['layer']}_{name}_{k}": r[k] for name, rs in result.get("per_layer", {}).items()
                    for r in rs for k in ("ppl", "dppl")})
        if "per_head" in result:
            row["per_head_spearman"] = result["per_head"]["spearman_alpha1_dppl"]
        return row
