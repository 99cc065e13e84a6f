"""Where this job runs in Hydra's terms: its output dir, whether it is one job of a multirun, its group choices."""
from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig


def output_dir_of(cfg: DictConfig) -> Path:
    """Hydra's run dir of this job; paths.output_dir outside Hydra (a config composed from Python)."""
    from hydra.core.hydra_config import HydraConfig

    if HydraConfig.initialized():
        return Path(HydraConfig.get().runtime.output_dir)
    return Path(cfg.paths.output_dir)


def is_multirun() -> bool:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def group_choices() -> dict:
    """This job's config-group choices (hydra.runtime.choices: model/gate -> elementwise, ...); {} outside Hydra."""
    from hydra.core.hydra_config import HydraConfig

    return dict(HydraConfig.get().runtime.choices) if HydraConfig.initialized() else {}
