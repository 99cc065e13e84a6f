"""wandb for `logger=wandb`: installed or a one-line error, offline without an API key, the group and run names of a
job, and closing its run. Nothing here imports wandb unless the config asks for it (the default logger is csv)."""
from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Optional

from omegaconf import DictConfig, OmegaConf

from sinklab.errors import import_optional
from sinklab.train.runtime import is_multirun

log = logging.getLogger("sinklab")


def check_wandb_installed(cfg: DictConfig) -> None:
    """logger=wandb without the wandb package: one line naming both, before any data is read or a model built
    (Lightning's WandbLogger would fail only after the data is prepared)."""
    if "wandb" in (cfg.get("logger") or {}):
        import_optional("wandb", "logger=wandb", instead="or logger=csv (the default), which needs none")


def setup_wandb_mode(cfg: DictConfig) -> None:
    """wandb goes offline when no API key is available, instead of failing at init."""
    if "wandb" not in (cfg.get("logger") or {}) or os.environ.get("WANDB_MODE"):
        return
    netrc = Path.home() / ".netrc"
    has_key = bool(os.environ.get("WANDB_API_KEY")) or (netrc.exists() and "api.wandb.ai" in netrc.read_text())
    if not has_key:
        os.environ["WANDB_MODE"] = "offline"
        log.info("wandb: no API key found, logging offline (sync later with `wandb sync`)")


def wandb_group(cfg: DictConfig) -> str:
    """<experiment.name>-<sweep time> for the jobs of a multirun: the sweep dir's name, the same for every job and
    for requeued jobs (e.g. weight_decay-2026-11-22_10-00-00); <experiment.name>-<run time> for a single run (the
    time Hydra put in the default run dir's name)."""
    from hydra.core.hydra_config import HydraConfig

    name = OmegaConf.select(cfg, "experiment.name", default=None) or "default"
    if is_multirun():
        stamp = Path(HydraConfig.get().sweep.dir).name
    else:  # Hydra resolves ${now:...} once per run; a node under cfg shares that resolution
        stamp = OmegaConf.create({"t": "${now:%Y-%m-%d_%H-%M-%S}"}, parent=cfg).t
    return f"{name}-{stamp}"


def wandb_run_name() -> Optional[str]:
    """This job's command-line overrides as Hydra writes them in override_dirname (e.g.
    `experiment=weight_decay,optim.weight_decay=5.0`), so the runs of a group are told apart by what was set; None
    outside Hydra or with no overrides (wandb then picks a name)."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return None
    return HydraConfig.get().job.override_dirname or None


def set_wandb_names(cfg: DictConfig) -> None:
    """logger.wandb.group=null (the default): the group of wandb_group(cfg); logger.wandb.name=null: the run name of
    wandb_run_name()."""
    for key, node in (cfg.get("logger") or {}).items():
        if isinstance(node, DictConfig) and str(node.get("_target_", "")).endswith("WandbLogger"):
            if node.get("group") is None:
                OmegaConf.update(cfg, f"logger.{key}.group", wandb_group(cfg), force_add=True)
            if node.get("name") is None:
                OmegaConf.update(cfg, f"logger.{key}.name", wandb_run_name(), force_add=True)


def finish_wandb(exit_code: int = 0) -> None:
    """Close this job's wandb run (each multirun job is its own run); exit_code=1 marks it failed in wandb."""
    if "wandb" in sys.modules:
        import wandb

        if wandb.run is not None:
            wandb.finish(exit_code=exit_code)
