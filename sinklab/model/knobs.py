"""The config knobs of every registered component in one table, `KNOBS`: knob name -> (its dataclass field, the
component classes that declare it), family by family in `FAMILIES` order, sinklab's own components first.

`ModelConfig` (config.py) gets one field per knob, and fills the table when it is built (`gather`), once every
component module is imported, and again when a component registers later (sinklab.plugins); what reads it (a
layer's config in layer_pattern.py, the retrofit, the catalog) runs on a built config.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Collection

from .registry import FAMILIES, ConfigError

KNOBS: dict[str, tuple[dataclasses.Field, list[Any]]] = {}


def knob_fields(base: Collection[str]) -> dict[str, tuple[dataclasses.Field, list[Any]]]:
    """knob name -> (its field, the component classes that declare it), over every registered component. Components
    share a knob by declaring it with the same default; a knob named like a base field (`base`: the config's own
    field names), or declared again with another default, is refused in one line naming the component that declares
    it and the one that owns the name (sinklab's own components come first, so a plugin's component is the one named
    as declaring it)."""
    knobs: dict[str, tuple[dataclasses.Field, list[Any]]] = {}
    classes = [cls for registry in FAMILIES for cls in registry]
    for cls in sorted(classes, key=lambda c: c.__module__.split(".")[0] != "sinklab"):  # sinklab's own first
        for f in dataclasses.fields(cls.Knobs):
            if f.name in base:
                raise ConfigError(f"{_declared(cls)} declares the knob {f.name}, the name of ModelConfig's own field "
                                  f"model.{f.name}; give the knob another name")
            if f.name in knobs and knobs[f.name][0].default != f.default:
                owner, theirs = knobs[f.name][1][0], knobs[f.name][0].default
                raise ConfigError(f"{_declared(cls)} declares the knob {f.name} with default {f.default!r}, but "
                                  f"{_declared(owner)} owns model.{f.name} with default {theirs!r}; give the knob "
                                  f"another name (components share a knob only with the same default)")
            knobs.setdefault(f.name, (f, []))[1].append(cls)
    return knobs


def gather(base: Collection[str]) -> None:
    """Fill `KNOBS` in place from the registered components (new knobs at the end, every knob's owners gathered
    again), so that every module that imported it sees them."""
    KNOBS.update(knob_fields(base))


def _declared(cls: type) -> str:
    """'module mypkg.ops.myop (model.attn_op=myop)': where a component comes from and what selects it."""
    return f"module {cls.__module__} (model.{cls.registry.key}={cls.name})"
