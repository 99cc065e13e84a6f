"""Where the Hydra configs live, the one registration of every structured-config schema, and composing from Python.

A schema module defines a dataclass (defaults once, cross-field rules in `__post_init__`) and a
`register(cs: ConfigStore)` that stores it; `conf/<group>/*.yaml` files list it first in their defaults and hold only
what differs from it (Hydra's "Structured Config schema" pattern).
"""
from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig

from sinklab import plugins
from sinklab.errors import UserError

CONF_DIR = Path(os.environ.get("SINKLAB_CONF", Path(__file__).resolve().parents[2] / "conf"))

# modules with a register(cs) function, one per config group that has a schema
SCHEMA_MODULES = (
    "sinklab.model.config",
    "sinklab.train.optim",
    "sinklab.train.muon",
    "sinklab.train.config",  # trainer, callbacks/{sink,checkpoint,preemption,status}
    "sinklab.data.config",
    "sinklab.config.launchers",  # hydra/launcher: the submitit plugin's schemas, its preset names
)
SCHEMA_NAME = "schema"  # a schema's name in its group ends so (schema, adamw_schema): `defaults: [schema, _self_]`

_registered: Optional[tuple] = None  # plugin_state() when the schemas were stored


def register_configs() -> None:
    """Store every schema, and the config group options of the plugins (sinklab.plugins), in Hydra's ConfigStore;
    again only when a plugin registered something since (a component's knobs change the model's schema)."""
    global _registered
    if _registered == plugin_state():
        return
    cs = ConfigStore.instance()
    for name in SCHEMA_MODULES:
        importlib.import_module(name).register(cs)
    store_plugin_options(cs)
    _registered = plugin_state()


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


# ----------------------------------------------------------------------------------- the plugins' config options
def conf_dirs() -> list[Path]:
    """`conf/` of the top-level package of each plugin module and of each component or metric registered from
    outside sinklab, where it has one with a `model/` folder."""
    from sinklab.metrics import METRICS
    from sinklab.model.registry import FAMILIES

    roots = {c.__module__.split(".")[0] for family in (*FAMILIES, METRICS) for c in family if plugins.is_plugin(c)}
    roots |= {module.split(".")[0] for module in plugins.LOADED}
    dirs = []
    for root in sorted(roots):
        module = sys.modules.get(root)
        where = getattr(module, "__path__", None) or []
        dirs += [Path(p) / "conf" for p in where if (Path(p) / "conf" / "model").is_dir()]
    return dirs


def plugin_options() -> dict[str, dict[str, dict]]:
    """Config group options of the plugins (`sinklab.plugins`): 'model/<group>' -> option name -> the model keys it
    sets. Each component selects itself under its name; each yaml of a plugin's conf/model/<group>/ is an option too."""
    from omegaconf import OmegaConf

    from sinklab.model.registry import FAMILIES

    found: dict[str, dict[str, dict]] = {}
    for registry in FAMILIES:
        for cls in registry:
            if plugins.is_plugin(cls):
                found.setdefault(f"model/{registry.group}", {})[cls.name] = {registry.key: cls.name}
    for conf in conf_dirs():
        for path in sorted((conf / "model").glob("*/*.yaml")):
            node = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
            found.setdefault(f"model/{path.parent.name}", {})[path.stem] = node
    for group, named in found.items():
        clash = sorted(name for name in named if (CONF_DIR / group / f"{name}.yaml").exists())
        if clash:
            raise UserError(f"{group}={clash[0]} of a plugin has the name of sinklab's {group}/{clash[0]}.yaml; "
                            f"rename the component or the plugin's yaml")
    return found


def store_plugin_options(cs: Any) -> None:
    """Put the plugins' config group options in Hydra's ConfigStore (package `model`, as conf/model/<group>/)."""
    for group, named in plugin_options().items():
        for name, node in named.items():
            cs.store(group=group, name=name, node=node, package="model")


def plugin_state() -> tuple:
    """What the ConfigStore's entries depend on beyond sinklab itself (register_configs stores again on a change)."""
    from sinklab.model.config import KNOBS_ADDED

    return KNOBS_ADDED[0], tuple(plugins.LOADED), tuple((g, tuple(n)) for g, n in plugin_options().items())
