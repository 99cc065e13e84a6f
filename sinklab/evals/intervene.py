"""The interventions of `sinklab eval intervene` (the command, and what each intervention is: `sinklab.cli.intervene`):
the probe set's massive activations, the mask functions that drop a key, the hook that sets activations, and the
validation perplexity and Sink_1 of the model unchanged and under each. Interventions are passed to the model
(forward's `extra_mask`, forward hooks), never set on it. What the evaluation asks of a model is a `Subject`:
`SinklabSubject` here, `HFSubject` (sinklab.evals.hf_intervene) for a transformers model (its attention function with
the key masked, a hook on the decoder layer's output); `subject(model)` picks one.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Sequence

import torch

from sinklab.errors import UserError
from sinklab.lm import mean_nll, perplexity
from sinklab.metrics.base import Metric
from sinklab.model.masks import MaskMod

INTERVENTIONS = ("zero", "mean", "mask_first", "mask_random")


# ------------------------------------------------------------------------------------------------ interventions
@dataclass
class Intervention:
    """What an intervention changes, passed to the model rather than set on it: `mask`, a mask function every query
    obeys on top of the model's own (forward's `extra_mask`; the fused kernels' is_causal shortcut is off then), and
    `hooks`, a context that replaces activations through forward hooks while it is open."""

    mask: Optional[MaskMod] = None
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


@contextlib.contextmanager
def set_activations(model, layer: int, position: int, channels: list[int], values: torch.Tensor) -> Iterator[None]:
    """Inside the block, the output of `layer` (its residual stream, `hook_resid`) has h[:, position, channels] =
    values (one per channel); `position` is a sequence position (learned sink tokens first)."""
    def hook(_module, _inputs, x):
        x = x.clone()
        x[:, position, channels] = values.to(x.dtype)
        return x

    handle = model.blocks[layer].hook_resid.register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


# ----------------------------------------------------------------------------------------------- the model evaluated
class LayerOutputs(Metric):
    """Records each layer's residual stream (B, T, d) of the real tokens of one batch, float32 (a recorder for
    `Subject.residuals`, not a registered metric)."""

    records = frozenset({"h"})

    def __init__(self):
        super().__init__(ctx=None)
        self.layers: dict[int, torch.Tensor] = {}

    def update(self, layer: int, rec: dict[str, torch.Tensor]) -> None:
        self.layers[layer] = rec["h"].float()


class Subject:
    """A model under intervention: what `find_massive` and `evaluate` ask of it."""

    n_sink_tokens = 0  # learned sink tokens before the real ones

    def __init__(self, model):
        self.model = model

    def target(self):
        """The model as a measurement target (`sinklab.metrics.record.SinklabTarget`, `sinklab.hf.HFTarget`)."""
        raise NotImplementedError

    def residuals(self, batch: torch.Tensor) -> list[torch.Tensor]:
        """Each layer's residual stream (B, T, d) of the real tokens of one batch, float32."""
        rec = LayerOutputs()
        self.target().run(batch, [rec])
        return [rec.layers[i] for i in sorted(rec.layers)]

    def set_output(self, layer: int, position: int, channels: list[int],
                   values: torch.Tensor) -> contextlib.AbstractContextManager:
        """A context inside which layer `layer`'s output has h[:, position, channels] = values."""
        raise NotImplementedError

    def nll(self, val: list[torch.Tensor], mask: Optional[MaskMod]) -> tuple[float, int]:
        """`sinklab.lm.mean_nll` of the validation blocks (B, T + 1) with the keys `mask` drops masked out."""
        raise NotImplementedError

    def sink_summary(self, probe: torch.Tensor, mask: Optional[MaskMod]) -> dict:
        """`sinklab.metrics.summarise` of the sink metric (k = 1) of the probe set, under `mask`."""
        raise NotImplementedError


class SinklabSubject(Subject):
    def __init__(self, model):
        super().__init__(model)
        self.n_sink_tokens = model.cfg.n_sink_tokens

    def target(self):
        from sinklab.metrics import SinklabTarget

        return SinklabTarget(self.model)

    def set_output(self, layer, position, channels, values):
        return set_activations(self.model, layer, position, channels, values)

    def nll(self, val, mask):
        return mean_nll(lambda x: self.model(x, extra_mask=mask), val, self.model.cfg.prefix_len)

    def sink_summary(self, probe, mask):
        from sinklab.metrics import attention_scores, summarise

        return summarise(attention_scores(self.model, probe, k=1, extra_mask=mask))


def subject(model) -> Subject:
    """HFSubject for a transformers model (sinklab's Transformer has its config as `cfg`), else SinklabSubject."""
    if hasattr(model, "cfg"):
        return SinklabSubject(model)
    from sinklab.evals.hf_intervene import HFSubject

    return HFSubject(model)


@torch.no_grad()
def find_massive(model, tokens: torch.Tensor, n_channels: int, batch_size: int = 32) -> dict:
    """The massive activations of the probe set (see the module docstring): layer (from 0), token (from 1), channels, their
    mean |h| and mean signed value, and the top mean |h| over the median |h| of that layer."""
    abs_sum, signed_sum, medians = None, None, None
    subj = subject(model)
    for start in range(0, tokens.shape[0], batch_size):
        h = torch.stack(subj.residuals(tokens[start:start + batch_size]), 1)  # (B, L, T, d) of the real tokens
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


def intervention(name: str, subj: Subject, massive: dict, n_pos: int, seed: int, device) -> Intervention:
    S = subj.n_sink_tokens
    if name == "none":
        return Intervention()
    if name in ("zero", "mean"):
        values = torch.tensor(massive["mean_values"]) if name == "mean" else torch.zeros(len(massive["channels"]))
        position = S + massive["token"] - 1  # the token's sequence position, learned sink tokens first
        return Intervention(hooks=lambda: subj.set_output(massive["layer"], position, massive["channels"],
                                                          values.to(device)))
    if name == "mask_first":
        return Intervention(mask=drop_first_key(S))
    return Intervention(mask=drop_random_key(S, n_pos, seed, device))


# ----------------------------------------------------------------------------------------------------- evaluation
def evaluate(model, val: list[torch.Tensor], probe: torch.Tensor, names: Sequence[str], massive: dict,
             seed: int) -> tuple[dict, int]:
    """{name: row} for the unchanged model and each intervention, and the number of scored validation targets
    (`sinklab.lm.mean_nll` of the validation blocks (B, T + 1), Sink_1 of the probe set)."""
    rows, count = {}, 0
    subj = subject(model)
    n_pos = subj.n_sink_tokens + max(val[0].shape[1] - 1, probe.shape[1])
    for name in ("none", *names):
        iv = intervention(name, subj, massive, n_pos, seed, probe.device)
        with iv.hooks(), torch.no_grad():
            loss, count = subj.nll(val, iv.mask)
            summary = subj.sink_summary(probe, iv.mask)
        rows[name] = {"loss": loss, "ppl": perplexity(loss), "sink1": summary["sink1"], "alpha1": summary["alpha1"]}
        if "sink1_star" in summary:
            rows[name]["sink1_star"] = summary["sink1_star"]
    for row in rows.values():
        row["dppl"] = row["ppl"] - rows["none"]["ppl"]
    return rows, count
