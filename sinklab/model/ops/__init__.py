"""Attention operations, one module each; every module in this package is imported (and so registered) here, so a
new operation is one new module (docs/extending.md)."""
import importlib
import pkgutil

from .base import AttentionOp, NormalisableOp

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")

__all__ = ["AttentionOp", "NormalisableOp"]
