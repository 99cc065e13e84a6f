"""One model interface behind every evaluation and analysis: `Target` (`interface.py`), implemented once per model
source and registered in `SOURCES`: sinklab checkpoints and run dirs (`native.py`, source "sinklab") and transformers
causal LMs, local dirs or hub ids at a revision (`transformers_lm.py`, source "hf"; the hub download in
`hub_models.py`, the streaming cache in `transformers_cache.py`, interventions in `transformers_masking.py`).
`load_target(TargetSpec(name, source=...))` loads one; a new source is one module (docs/extending.md)."""
from .interface import SOURCES, Decoder, Step, Target, TargetMeta, TargetSpec, load_target
from .native import SinklabTarget
from .transformers_lm import TransformersTarget

__all__ = ["Decoder", "SOURCES", "SinklabTarget", "Step", "Target", "TargetMeta", "TargetSpec", "TransformersTarget",
           "load_target"]
