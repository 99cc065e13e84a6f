"""Measurements as plug-ins: every metric one module registered in `METRICS` (`base.py`), recorded through forward
hooks (`record.py`). Importing this package imports every module of it, so a new module here is a new metric with no
other file touched: the sink metric first, then the rest by name (the order of the logs and of `measure --json`)."""
from sinklab.registries import discover

from . import sink  # noqa: F401  (registered first)

discover(__name__)
from .activations import activation_stats, flatten_activation_stats, hidden_state_stats, qkv_stats
from .base import METRICS, Context, Metric
from .gates import gate_stats, record_gates
from .record import SinklabRecorder, attention_maps, measure_all, measure_model
from .sink import (AttentionScores, attention_scores, brute_force_alpha, column_scores, first_token_attention, sink_rate,
                   slot_names, summarise)

__all__ = ["METRICS", "AttentionScores", "Context", "Metric", "SinklabRecorder", "activation_stats", "attention_maps",
           "attention_scores", "brute_force_alpha", "column_scores", "first_token_attention",
           "flatten_activation_stats", "gate_stats", "hidden_state_stats", "measure_all", "measure_model",
           "qkv_stats", "record_gates", "sink_rate", "slot_names", "summarise"]
