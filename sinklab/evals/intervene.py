"""The interventions of `sinklab eval intervene` (the command, and what each intervention is: `sinklab.cli.intervene`):
the probe set's massive activations, the mask functions that drop a key, the hook that sets activations, and the
validation perplexity and Sink_1 of the model unchanged and under each. Interventions are passed to the model
(forward's `extra_mask`, forward hooks), never set on it. A transformers model (no `cfg`) gets the same through
`sinklab.evals.hf_intervene`: its attention function with the key masked, a hook on the decoder layer's output.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Sequence

import torch

from sinklab.errors import UserError
from sinklab.lm import mean_nll, perplexity
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


def is_hf(model) -> bool:
    """A transformers model (sinklab's Transformer has its config as `cfg`)."""
    return not hasattr(model, "cfg")


def n_sink_tokens(model) -> int:
    return 0 if is_hf(model) else model.cfg.n_sink_tokens


def residuals(model, batch: torch.Tensor) -> list[torch.Tensor]:
    """Each layer's residual stream (B, T, d) of the real tokens of one batch, float32."""
    if is_hf(model):
        from sinklab.evals.hf_intervene import residuals as hf_residuals

        return hf_residuals(model, batch)
    from sinklab.metrics import SinklabTarget

    layers: dict[int, torch.Tensor] = {}
    with SinklabTarget(model).hooks({"h"}, lambda i, rec: layers.__setitem__(i, rec["h"].float())):
        model(batch)
    return [layers[i] for i in sorted(layers)]


@torch.no_grad()
def find_massive(model, tokens: torch.Tensor, n_channels: int, batch_size: int = 32) -> dict:
    """The massive activations of the probe set (see the module docstring): layer, token (1-indexed), channels, their
    mean |h| and mean signed value, and the top mean |h| over the median |h| of that layer."""
    abs_sum, signed_sum, medians = None, None, None
    for start in range(0, tokens.shape[0], batch_size):
        h = torch.stack(residuals(model, tokens[start:start + batch_size]), 1)  # (B, L, T, d) of the real tokens
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


def intervention(name: str, model, massive: dict, n_pos: int, seed: int, device) -> Intervention:
    S = n_sink_tokens(model)
    if name == "none":
        return Intervention()
    if name in ("zero", "mean"):
        values = torch.tensor(massive["mean_values"]) if name == "mean" else torch.zeros(len(massive["channels"]))
        position = S + massive["token"] - 1  # the token's sequence position, learned sink tokens first
        if is_hf(model):
            from sinklab.evals.hf_intervene import set_layer_output as setter
        else:
            setter = set_activations
        return Intervention(hooks=lambda: setter(model, massive["layer"], position, massive["channels"],
                                                 values.to(device)))
    if name == "mask_first":
        return Intervention(mask=drop_first_key(S))
    return Intervention(mask=drop_random_key(S, n_pos, seed, device))


# ----------------------------------------------------------------------------------------------------- evaluation
def evaluate(model, val: list[torch.Tensor], probe: torch.Tensor, names: Sequence[str], massive: dict,
             seed: int) -> tuple[dict, int]:
    """{name: row} for the unchanged model and each intervention, and the number of scored validation targets
    (`sinklab.lm.mean_nll` of the validation blocks (B, T + 1), Sink_1 of the probe set)."""
    from sinklab.metrics import attention_scores, summarise

    rows, count = {}, 0
    hf = is_hf(model)
    prefix_len = 0 if hf else model.cfg.prefix_len
    n_pos = n_sink_tokens(model) + max(val[0].shape[1] - 1, probe.shape[1])
    for name in ("none", *names):
        iv = intervention(name, model, massive, n_pos, seed, probe.device)
        with iv.hooks(), torch.no_grad():
            if hf:
                from sinklab.evals.hf_intervene import masked_attention, sink_summary

                with masked_attention(model, iv.mask):
                    loss, count = mean_nll(lambda x: model(input_ids=x, use_cache=False).logits, val)
                summary = sink_summary(model, probe, iv.mask)
            else:
                loss, count = mean_nll(lambda x: model(x, extra_mask=iv.mask), val, prefix_len)
                summary = summarise(attention_scores(model, probe, k=1, extra_mask=iv.mask))
        rows[name] = {"loss": loss, "ppl": perplexity(loss), "sink1": summary["sink1"], "alpha1": summary["alpha1"]}
        if "sink1_star" in summary:
            rows[name]["sink1_star"] = summary["sink1_star"]
    for row in rows.values():
        row["dppl"] = row["ppl"] - rows["none"]["ppl"]
    return rows, count
