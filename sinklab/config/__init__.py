"""Configuration: the structured-config schemas registered in Hydra's ConfigStore, composing from Python, and
turning Hydra's own errors into one line.

Each schema lives beside the code it configures (ModelConfig in sinklab.model.config, DataConfig in
sinklab.data.config, ...); `store.register_configs()` puts them all in the ConfigStore once.
"""
from sinklab.errors import UserError

from .messages import hydra_error_message
from .store import CONF_DIR, compose, register_configs
from .validate import built, check_devices, validate_config

__all__ = ["CONF_DIR", "UserError", "compose", "register_configs", "validate_config", "check_devices",
           "hydra_error_message", "built"]
