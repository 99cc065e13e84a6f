"""Measurements: the attention-sink metric and activation statistics."""
from .activations import activation_stats, flatten_activation_stats
from .sink import AttentionScores, attention_scores, brute_force_alpha, column_scores, sink_rate, slot_names, summarise

__all__ = ["AttentionScores", "activation_stats", "attention_scores", "brute_force_alpha", "column_scores",
           "flatten_activation_stats", "sink_rate", "slot_names", "summarise"]
