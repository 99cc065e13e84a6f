"""The catalog behind `sinklab components` (the command: `sinklab.cli.components`): every registered architecture
component, the config key and value that select it, its knobs with their defaults, and the conf/model/ files that
select it (for a component of a plugin, sinklab.plugins: the config group options it brings). Generated from the
registries, so it is complete."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from omegaconf import OmegaConf

from sinklab.model import FAMILIES
from sinklab.model.knobs import KNOBS

from .store import CONF_DIR, plugin_options


def catalog(conf_dir: Optional[Path] = None) -> list[dict]:
    """One entry per registered component, in registry order."""
    conf = (conf_dir or CONF_DIR) / "model"
    entries = []
    for registry in FAMILIES:
        files = {p.stem: OmegaConf.load(p) for p in sorted((conf / registry.group).glob("*.yaml"))}
        files.update(plugin_options().get(f"model/{registry.group}", {}))  # components from the user's packages
        for cls in registry:
            doc = (cls.__doc__ or "").strip().splitlines()
            entries.append({
                "key": f"model.{registry.key}", "name": cls.name, "family": registry.what,
                "about": doc[0] if doc else "",
                "knobs": {k: f.default for k, (f, owners) in KNOBS.items() if cls in owners},
                "files": [f"model/{registry.group}={name}" for name, node in files.items()
                          if node.get(registry.key) == cls.name],
            })
    return entries
