"""Composing every job of a sweep without paying Hydra's whole composition (~0.1 s) for each.

Hydra composes a job in two stages (hydra/_internal/config_loader_impl.py): the defaults list, chosen by the config
group overrides, is loaded and merged; then the value overrides (`key=value` of a key that is not a config group)
are applied to the merged config by `ConfigLoaderImpl._apply_overrides_to_config`. Jobs of one sweep that select the
same config group options therefore share the first stage: `job_config` composes the sweep's base with the job's
group choices once and runs Hydra's own second stage on a copy of it. A job that adds or deletes a key is composed in
full. tests/config/test_experiments.py checks that both ways give the same config.
"""
from __future__ import annotations

import copy
import functools
from typing import Sequence

from hydra._internal.config_loader_impl import ConfigLoaderImpl
from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig, open_dict

from sinklab.config import compose


@functools.lru_cache(maxsize=None)
def composed(*overrides: str, hydra: bool = False) -> DictConfig:
    """compose(overrides), cached per process: the tests only read it (copy before changing it). One composition
    serves both forms: without `hydra` it is the composed config less its hydra node, as hydra.compose returns it."""
    if hydra:
        return compose(list(overrides), return_hydra_config=True)
    return without_hydra(composed(*overrides, hydra=True))


def without_hydra(cfg: DictConfig) -> DictConfig:
    """A copy of a config composed with its hydra node, the node deleted (what hydra.compose does without
    return_hydra_config)."""
    cfg = copy.deepcopy(cfg)
    with open_dict(cfg):
        del cfg["hydra"]
    return cfg


def sweep_jobs(lines: Sequence[str]) -> list[list[str]]:
    """The override list of every job, in job order, as Hydra's BasicSweeper expands `key=a,b` lines."""
    batches = BasicSweeper.split_arguments(OverridesParser.create().parse_overrides(list(lines)), None)
    return [list(job) for batch in batches for job in batch]


def split_overrides(base: Sequence[str], job: Sequence[str]):
    """The job's overrides beyond `base` as (the config group choices, as written; the value overrides parsed by
    Hydra): Hydra's two stages. None when one adds or deletes a key, is a sweep, sets a package, a hydra key or a
    dict (composed in full)."""
    groups = set(composed(*base, hydra=True).hydra.runtime.choices)
    choices, values = [], []
    for o in OverridesParser.create().parse_overrides([o for o in job if o not in base]):
        key = o.key_or_group
        if o.is_add() or o.is_delete() or o.is_sweep_override() or o.package is not None \
                or key.startswith("hydra") or isinstance(o.value(), dict):
            return None
        if "/" in key or key in groups:
            choices.append(o.input_line)
        else:
            values.append(o)
    return choices, values


def value_overrides(base: Sequence[str], job: Sequence[str]):
    """The job's overrides beyond `base` parsed by Hydra, if each sets the value of a key (no config group, no `+` or
    `~`, no hydra key); else None."""
    split = split_overrides(base, job)
    return split[1] if split is not None and not split[0] else None


def job_config(base: Sequence[str], job: Sequence[str], full: bool = False) -> DictConfig:
    """compose([*base, *job]): the cached composition of the base and the job's config group choices with Hydra's
    value-override stage applied (see the module's docstring); composed in full when the job adds or deletes a key, or
    when `full`. Not cached: a fresh config."""
    base = tuple(base)
    split = None if full else split_overrides(base, job)
    if split is None:
        return compose([*base, *(o for o in job if o not in base)])
    choices, values = split
    cfg = copy.deepcopy(composed(*base, *choices))
    ConfigLoaderImpl._apply_overrides_to_config(values, cfg)
    return cfg
