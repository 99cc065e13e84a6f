"""Measurements: the attention-sink metric, activation statistics and gate statistics."""
from .activations import ActivationStats, activation_stats, flatten_activation_stats, hidden_state_stats, qkv_stats
from .gates import gate_stats, record_gates
from .sink import (AttentionScores, attention_scores, brute_force_alpha, column_scores, first_token_attention, sink_rate,
                   slot_names, summarise)

__all__ = ["ActivationStats", "AttentionScores", "activation_stats", "attention_scores", "brute_force_alpha",
           "column_scores", "first_token_attention", "flatten_activation_stats", "gate_stats", "hidden_state_stats",
           "qkv_stats", "record_gates",
           "sink_rate", "slot_names", "summarise"]
