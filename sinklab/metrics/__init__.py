"""Measurements as plug-ins: every metric one module registered in `METRICS` (`base.py`), recorded through forward
hooks (`record.py`). Importing this package registers sinklab's own (the registry keeps the order of first import: the order of the logs and of
`sinklab measure --json`)."""
from . import entropy, first_token, gates, massive, norms, outliers, residual_sinks, sink  # noqa: F401, I001
from .activations import activation_stats, flatten_activation_stats, hidden_state_stats, qkv_stats
from .base import METRICS, Context, Metric
from .gates import gate_stats, record_gates
from .record import SinklabTarget, attention_maps, measure_all, measure_model
from .sink import (AttentionScores, attention_scores, brute_force_alpha, column_scores, first_token_attention, sink_rate,
                   slot_names, summarise)

__all__ = ["METRICS", "AttentionScores", "Context", "Metric", "SinklabTarget", "activation_stats", "attention_maps",
           "attention_scores", "brute_force_alpha", "column_scores", "first_token_attention",
           "flatten_activation_stats", "gate_stats", "hidden_state_stats", "measure_all", "measure_model",
           "qkv_stats", "record_gates", "sink_rate", "slot_names", "summarise"]
