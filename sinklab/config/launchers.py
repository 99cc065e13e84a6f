"""The submitit launcher presets: `conf/hydra/launcher/slurm.yaml` and `local.yaml` extend the plugin's schemas
(SlurmQueueConf, LocalQueueConf), stored here as `slurm_schema` and `local_schema`, and hold only sinklab's settings.

The plugin's own names, `hydra/launcher=submitit_slurm` and `submitit_local`, select sinklab's presets too: they
are stored here as nodes whose defaults list is the preset. (A yaml file with the plugin's name would be validated
against the plugin's node of that name, Hydra's "automatic schema matching", which prints a deprecation warning.)
"""
import importlib.util
from typing import Optional

from .store import SCHEMA_NAME
from sinklab.errors import missing_package

GROUP = "hydra/launcher"
PRESETS = {"slurm": "SlurmQueueConf", "local": "LocalQueueConf"}  # sinklab's name: the plugin's schema
PLUGIN_PREFIX = "submitit_"
PACKAGE = "hydra-submitit-launcher"


def plugin_installed() -> bool:
    """Whether hydra-submitit-launcher is importable: a stock GPU image without it still trains and sweeps on the
    basic launcher; only `hydra/launcher=slurm|local` needs it (refused in one line: missing_plugin_message)."""
    try:
        return importlib.util.find_spec("hydra_plugins.hydra_submitit_launcher") is not None
    except ModuleNotFoundError:  # no hydra_plugins namespace at all
        return False


def missing_plugin_message(missing_cfg_file: str) -> Optional[str]:
    """The one line for a launcher preset chosen without the plugin installed, where Hydra reports a missing config
    (sinklab.config.messages.hydra_error_message): `hydra/launcher/slurm_schema` (slurm.yaml's schema, stored only
    with the plugin) for hydra/launcher=slurm, `hydra/launcher/submitit_slurm` itself for the plugin's name; None for
    any other missing config, or when the plugin is installed."""
    group, _, name = missing_cfg_file.rpartition("/")
    preset = name.removeprefix(PLUGIN_PREFIX).removesuffix(f"_{SCHEMA_NAME}")
    if group != GROUP or preset not in PRESETS or plugin_installed():
        return None
    option = name if name.startswith(PLUGIN_PREFIX) else preset
    return missing_package(f"{GROUP}={option}", PACKAGE,
                           instead="or leave hydra/launcher out: the basic launcher runs a sweep's jobs one by one")


def register(cs) -> None:
    if not plugin_installed():
        return
    from hydra.core.plugins import Plugins
    from hydra_plugins.hydra_submitit_launcher import config as plugin

    # Hydra's first plugin scan executes the plugin's modules again, and so stores the plugin's nodes again: scan
    # first, so that the redirects below are the nodes Hydra finds under the plugin's names
    Plugins.instance()
    for name, schema in PRESETS.items():
        cs.store(group=GROUP, name=f"{name}_{SCHEMA_NAME}", node=getattr(plugin, schema))
        cs.store(group=GROUP, name=PLUGIN_PREFIX + name, node={"defaults": [name, "_self_"]})
