"""Architecture only: the config dataclass, the component registries and the model. Data, training and metrics live
elsewhere."""
from .config import PRESETS, ModelConfig, preset
from .registry import ATTENTION_OPS, ATTN_BIASES, FAMILIES, FFNS, GATES, NORM_POSITIONS, NORMS, POSITIONS, ConfigError
from .transformer import Transformer

__all__ = ["ConfigError", "ModelConfig", "PRESETS", "preset", "Transformer", "FAMILIES", "ATTENTION_OPS",
           "ATTN_BIASES", "FFNS", "GATES", "NORM_POSITIONS", "NORMS", "POSITIONS"]
