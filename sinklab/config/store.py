"""Where the Hydra configs live, the one registration of every structured-config schema, and composing from Python.

A schema module defines a dataclass (defaults once, cross-field rules in `__post_init__`) and a
`register(cs: ConfigStore)` that stores it; `conf/<group>/*.yaml` files list it first in their defaults and hold only
what differs from it (Hydra's "Structured Config schema" pattern).
"""
from __future__ import annotations

import importlib
import os
from pathlib import Path
from typing import Optional, Sequence

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig

from sinklab.errors import UserError

CONF_DIR = Path(os.environ.get("SINKLAB_CONF", Path(__file__).resolve().parents[2] / "conf"))

# modules with a register(cs) function, one per config group that has a schema
SCHEMA_MODULES = (
    "sinklab.model.config",
    "sinklab.train.optim",
    "sinklab.train.muon",
    "sinklab.train.config",  # trainer, callbacks/{sink,checkpoint,preemption,status}
    "sinklab.data.config",
    "sinklab.train.launchers",  # hydra/launcher: the submitit plugin's schemas, its preset names
)
SCHEMA_NAME = "schema"  # a schema's name in its group ends so (schema, adamw_schema): `defaults: [schema, _self_]`

_registered: Optional[tuple] = None  # sinklab.plugins.state() when the schemas were stored


def register_configs() -> None:
    """Store every schema, and the config group options of the plugins (sinklab.plugins), in Hydra's ConfigStore;
    again only when a plugin registered something since (a component's knobs change the model's schema)."""
    global _registered
    from sinklab import plugins

    if _registered == plugins.state():
        return
    cs = ConfigStore.instance()
    for name in SCHEMA_MODULES:
        importlib.import_module(name).register(cs)
    plugins.store_options(cs)
    _registered = plugins.state()


def compose(overrides: Sequence[str] = (), config_name: str = "train", return_hydra_config: bool = False) -> DictConfig:
    """Compose the training config from Python (tests, notebooks), as `sinklab-train OVERRIDES` would."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    if not (CONF_DIR / f"{config_name}.yaml").exists():
        raise UserError(f"config dir {CONF_DIR} has no {config_name}.yaml; install sinklab from a clone "
                        "(pip install -e .) or set SINKLAB_CONF")
    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return hydra_compose(config_name=config_name, overrides=list(overrides),
                             return_hydra_config=return_hydra_config)
