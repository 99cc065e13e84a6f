"""What sinks are for: evaluations of trained models beyond validation loss (streaming perplexity with an evicting KV
cache, causal interventions on the sink, simulated quantization), and sampling. Each evaluation is registered in
`EVALUATIONS` (`registry.py`) by its own module; importing this package imports every module of it, so a new module
here is a new evaluation, with its `sinklab eval NAME` and its sweep columns, and no other file touched."""
from sinklab.registries import discover

discover(__name__)
from .registry import EVALUATIONS, Evaluation  # noqa: E402

__all__ = ["EVALUATIONS", "Evaluation"]
