"""Composing every job of a sweep without paying Hydra's whole composition (~0.1 s) for each.

Hydra composes a job in two stages (hydra/_internal/config_loader_impl.py): the defaults list, chosen by the config
group overrides, is loaded and merged; then the value overrides (`key=value` of a key that is not a config group)
are applied to the merged config by `ConfigLoaderImpl._apply_overrides_to_config`. Jobs of one sweep that differ only
in values therefore share the first stage: `job_config` composes the sweep's base once and runs Hydra's own second
stage on a copy of it. A job that selects a config group, adds or deletes a key is composed in full.
tests/config/test_experiments.py checks that both ways give the same config.
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


def value_overrides(base: Sequence[str], job: Sequence[str]):
    """The job's overrides beyond `base` parsed by Hydra, if each sets the value of a key (no config group, no `+` or
    `~`, no hydra key); else None."""
    groups = set(composed(*base, hydra=True).hydra.runtime.choices)
    parsed = OverridesParser.create().parse_overrides([o for o in job if o not in base])
    for o in parsed:
        key = o.key_or_group
        if o.is_add() or o.is_delete() or o.is_sweep_override() or o.package is not None or "/" in key \
                or key in groups or key.startswith("hydra") or isinstance(o.value(), dict):
            return None
    return parsed


def job_config(base: Sequence[str], job: Sequence[str], full: bool = False) -> DictConfig:
    """compose([*base, *job]): the cached base with Hydra's value-override stage applied when the job only sets
    values (see the module's docstring); composed in full otherwise or when `full`. Not cached: a fresh config."""
    base = tuple(base)
    parsed = None if full else value_overrides(base, job)
    if parsed is None:
        return compose([*base, *(o for o in job if o not in base)])
    cfg = without_hydra(composed(*base, hydra=True))
    ConfigLoaderImpl._apply_overrides_to_config(parsed, cfg)
    return cfg
