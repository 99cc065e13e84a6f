"""What sinks are for: evaluations of trained models beyond validation loss (e.g. perplexity through an evicting KV
cache; `sinklab eval --help` and the reference pages list them all), and sampling. Each evaluation is registered in
`EVALUATIONS` (`registry.py`) by its own module; importing this package imports every module of it, so a new module
here is a new evaluation, with its `sinklab eval NAME` and its sweep columns, and no other file touched."""
from sinklab.registries import discover

discover(__name__)
from .registry import EVALUATIONS, Evaluation  # noqa: E402

__all__ = ["EVALUATIONS", "Evaluation"]
