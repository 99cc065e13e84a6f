"""Importing this module registers every component: each module registers its classes when it is imported."""
from . import attn_bias, backends, ffn, gates, norms, ops, positional, qk_norm, transformer  # noqa: F401
