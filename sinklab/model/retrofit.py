"""Retrofit: a trained model taken into a config that adds components to its architecture.

`init_from=` copies a checkpoint's weights into this run's model (sinklab.runs.checkpoints). Its model config may
differ from the checkpoint's by additions only, each from the value that means "without it":
- a component of a family whose checkpoint value is the family's default (model.gate=none -> headwise,
  model.attn_bias=none -> v, model.sparsity=none -> moba, model.attn_op=softmax -> dsa or nsa, and the knob that
  selects a variant of the op, model.sink_logit=none -> learned), where the component says how it starts
  (`Component.retrofit`); its knobs then take any value;
- a knob a component names in its `retrofit_knobs`, from its default (RoPE's rope_heads, rope_head_fractions,
  nope_every: per-head or per-layer NoPE);
- model.window from null and model.n_sink_tokens from 0 (`BASE`).
Any other difference (n_layer, d_model, a gate of another kind than the checkpoint's, a component removed) is refused.
`plan` lists the additions and the keys it cannot explain; each `Addition` says whether the model then computes at
step 0 what the checkpoint's did (the component's `retrofit_identity(cfg)`: exactly, or to float32 rounding where
the paths differ: an op's explicit softmax against the fused kernel). `init_added` gives the added parameters their
start: every module whose parameters are all new calls its `retrofit_init(parent)`; the others keep the fresh init
this run drew for them.

Decided here: the retrofit is not a mode to switch on. A config that adds to the checkpoint's architecture can only
mean one, every addition is logged with how it starts, and what is not an addition is refused in one line as before.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from sinklab.errors import word

from .config import BaseModelConfig, ModelConfig
from .knobs import KNOBS
from .registry import FAMILIES

# base fields a retrofit may add: key -> (how it starts, whether it is the identity under a config)
BASE: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "window": ("no parameters; the identity where the window spans the context (window = block_size)",
               lambda cfg: cfg.window >= cfg.block_size),
    "n_sink_tokens": ("not the identity: every query sees the learned tokens (fresh N(0, bias_init_std))",
                      lambda cfg: False),
}
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(BaseModelConfig)}


@dataclass(frozen=True)
class Addition:
    """A component (or knob) a retrofit adds: its key and value here, how it starts, whether it is the identity."""

    key: str
    value: Any
    how: str
    identity: bool

    def __str__(self) -> str:
        start = "the identity at step 0" if self.identity else "not the identity at step 0"
        return f"model.{self.key}={word(self.value)} ({start}; {self.how})"


def plan(saved: ModelConfig, cfg: ModelConfig, ignore: tuple[str, ...] = ()) -> tuple[list[Addition], list[str]]:
    """What `cfg` adds to the checkpoint's model `saved`, and the keys in which they differ otherwise (sorted; the
    keys `ignore` are not compared)."""
    differ = {k for k in set(saved.to_dict()) | set(cfg.to_dict())
              if k not in ignore and getattr(saved, k, None) != getattr(cfg, k, None)}
    added: list[Addition] = []
    for registry in FAMILIES:
        own = {k for k, (_, owners) in KNOBS.items() if owners[0].registry is registry}
        keys = sorted(differ & (own | {registry.key}))
        if not keys:
            continue
        was, now = registry.selected(saved), registry.selected(cfg)
        if was is not now:  # a component in place of the family's default: the component and all its knobs
            if was is registry.get(_DEFAULTS[registry.key]) and now.retrofit:
                shown = registry.key if registry.key in keys else keys[0]
                added.append(Addition(shown, getattr(cfg, shown), now.retrofit, now.retrofit_identity(cfg)))
                differ -= set(keys)
            continue
        for key in keys:  # the same component: a knob it names as an addition, from its default
            if key in now.retrofit_knobs and getattr(saved, key) == KNOBS[key][0].default:
                added.append(Addition(key, getattr(cfg, key), now.retrofit, now.retrofit_identity(cfg)))
                differ.discard(key)
    for key, (how, identity) in BASE.items():
        if key in differ and getattr(saved, key) == _DEFAULTS[key]:
            added.append(Addition(key, getattr(cfg, key), how, identity(cfg)))
            differ.discard(key)
    return added, sorted(differ)


def init_added(model: nn.Module, copied: set[str]) -> list[str]:
    """Each module of `model` whose parameters are all new (none of them among the `copied` names) and that has a
    `retrofit_init(parent)` sets their start (`parent`: the module that holds it, e.g. the layer's attention).
    Returns the names of those modules."""
    done = []
    with torch.no_grad():
        for name, module in model.named_modules():
            init = getattr(module, "retrofit_init", None)
            params = [f"{name}.{p}" for p, _ in module.named_parameters()]
            if init is None or not params or any(p in copied for p in params):
                continue
            init(model.get_submodule(name.rpartition(".")[0]))
            done.append(name)
    return done
