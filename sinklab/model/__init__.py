"""Architecture only: the config dataclass and the model. Data, training and metrics live elsewhere."""
from .config import ConfigError, ModelConfig, PRESETS, preset
from .transformer import Transformer

__all__ = ["ConfigError", "ModelConfig", "PRESETS", "preset", "Transformer"]
