"""The setting a sweep's other settings are compared with, paired by seed (``stats.setting_differences``).

In order: ``--baseline KEY=VALUE`` (each key a swept key other than the seed, each value one the sweep ran; else one
line before any work); the preset's ``experiment.baseline``; else, for a sweep that names none (an ad hoc
``sinklab-train -m model/gate=none,elementwise seed=0,1``, a paper-table preset), each compared key at its default:
the value ``sinklab-train`` gives the key when the sweep does not set it, composed from the registered schemas and
the config files with the sweep's other (fixed) overrides, so ``model.gate`` is ModelConfig's ``none`` and
``optim.weight_decay`` the one the sweep's scale sets. For a config group (``model/gate``) the default is the
swept option that leaves that composition unchanged (``model/gate=none`` sets only the schema's defaults;
``optim=adamw`` is the defaults list's choice). A key whose default the sweep did not run, or cannot be composed
(a plugin not installed here), takes its first swept value, and the report says so.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf

from sinklab.config import compose
from sinklab.config.claims import settings_text
from sinklab.errors import UserError, describe, word
from sinklab.report.jobs import Sweep, fixed_overrides, is_seed_key
from sinklab.report.paper import values_match


@dataclass(frozen=True)
class Baseline:
    """The compared-with setting (swept key -> value) and how it was chosen, for report.md and the command."""

    setting: dict
    why: str  # "--baseline", "experiment.baseline of ...", or per key "the default of KEY" / "the first swept ..."

    def line(self, sweep: Sweep) -> str:
        """'baseline model/gate=none (the default of model/gate); another: --baseline model/gate=elementwise'."""
        key = next(iter(self.setting))
        other = next((v for v in swept_values(sweep, key) if not values_match(self.setting[key], v)), None)
        hint = f"--baseline {key}={word(other)}" if other is not None else "--baseline KEY=VALUE"
        return f"baseline {settings_text(self.setting)} ({self.why}); another: {hint}"


def compared_keys(sweep: Sweep) -> list[str]:
    """The swept keys a baseline can name: all but the seeds, which pair the jobs."""
    return [k for k in sweep.swept if not is_seed_key(k)]


def swept_values(sweep: Sweep, key: str) -> list[Any]:
    """The values of ``key`` the sweep's jobs have (pending ones included), in job order, each once."""
    out: list[Any] = []
    for job in sweep.jobs:
        v = job.value(key)
        if v is not None and not any(values_match(v, seen) for seen in out):
            out.append(v)
    return out


def check_baseline(sweep: Sweep, baseline: dict) -> None:
    """``--baseline`` names compared keys of this sweep and values it ran; else one line naming the allowed ones."""
    keys = compared_keys(sweep)
    for key, value in baseline.items():
        given = f"--baseline {key}={word(value)}"
        if key not in keys:
            what = ("pairs the jobs (seeds are averaged over, not compared)" if key in sweep.swept else
                    f"is not a swept key of {sweep.where}")
            raise UserError(f"{given}: {key} {what}; allowed: "
                            + (", ".join(keys) or "none: the sweep varies only the seed"))
        values = swept_values(sweep, key)
        if not any(values_match(value, v) for v in values):
            raise UserError(f"{given}: the sweep ran no job with {key}={word(value)}; allowed: "
                            + ", ".join(f"{key}={word(v)}" for v in values))


def choose_baseline(sweep: Sweep, given: Optional[dict], preset: Optional[dict], preset_from: str) -> Optional[Baseline]:
    """``given`` (--baseline, already checked), else ``preset`` (its experiment.baseline, stated in ``preset_from``),
    else every compared key's default (module docstring); None when the sweep compares no key."""
    if given:
        return Baseline(given, "--baseline")
    if preset:
        return Baseline(preset, f"experiment.baseline of {preset_from}")
    keys = compared_keys(sweep)
    if not keys:
        return None
    fixed = fixed_overrides(sweep)
    try:
        plain: Optional[DictConfig] = compose(fixed)
        failed = ""
    except Exception as e:  # the sweep's config no longer composes here: say so, compare with the first values
        plain, failed = None, describe(e)
    setting, notes = {}, []
    for key in keys:
        values = swept_values(sweep, key)
        if not values:
            continue
        default = default_of(key, values, plain, fixed) if plain is not None else None
        chosen = next((v for v in values if default is not None and values_match(default, v)), None)
        if chosen is not None:
            setting[key] = chosen
            notes.append(f"the default of {key}")
            continue
        setting[key] = values[0]
        why = (f"its default could not be composed: {failed}" if plain is None else
               "none of its swept options leaves the config as it is without them" if is_group(key, plain) else
               f"its default {word(default)} was not swept")
        notes.append(f"the first swept value of {key}: {why}")
    return Baseline(setting, "; ".join(notes)) if setting else None


def is_group(key: str, plain: DictConfig) -> bool:
    """A config group (model/gate, optim, experiment), not a value: a path with '/', or a key whose node is a
    mapping in the composed config."""
    node = OmegaConf.select(plain, key, default=None, throw_on_resolution_failure=False)
    return "/" in key or isinstance(node, DictConfig)


def default_of(key: str, values: list[Any], plain: DictConfig, fixed: list[str]) -> Any:
    """The default of one swept key (module docstring): a value's composed value; for a group, the swept option
    whose composition with the fixed overrides equals ``plain`` (theirs without the group), else None."""
    if not is_group(key, plain):
        v = OmegaConf.select(plain, key, default=None, throw_on_resolution_failure=False)
        return OmegaConf.to_container(v) if OmegaConf.is_config(v) else v
    want = OmegaConf.to_container(plain, resolve=False)
    for option in values:
        try:
            if OmegaConf.to_container(compose([*fixed, f"{key}={word(option)}"]), resolve=False) == want:
                return option
        except Exception:  # an option that no longer composes is not the default
            continue
    return None
