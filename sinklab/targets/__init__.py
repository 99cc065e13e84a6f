"""One model interface behind every evaluation and analysis: `Target` (`interface.py`), implemented once per model
source by a class registered in `SOURCES`, each in a module of this package beside the helpers it uses (the hub
download, the transformers streaming cache and interventions). `load_target(TargetSpec(name, source=...))` loads one.
Every module of this package is imported, and so registered, here: a new source is one module (docs/extending.md,
"Add a model source"); the reference pages list the sources."""
from sinklab.registries import discover

from .interface import SOURCES, Decoder, Step, Target, TargetMeta, TargetSpec, load_target

discover(__name__)
from .native import SinklabTarget  # noqa: E402  (re-exported names)
from .transformers_lm import TransformersTarget  # noqa: E402

__all__ = ["Decoder", "SOURCES", "SinklabTarget", "Step", "Target", "TargetMeta", "TargetSpec", "TransformersTarget",
           "load_target"]
