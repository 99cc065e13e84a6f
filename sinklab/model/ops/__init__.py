"""Attention operations, one module each; every module in this package is imported (and so registered) here, so a
new operation is one new module (docs/extending.md)."""
from sinklab.registries import discover

from .base import AttentionOp, NormalisableOp

discover(__name__)

__all__ = ["AttentionOp", "NormalisableOp"]
