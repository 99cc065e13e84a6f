"""Measurements: the attention-sink metric and activation statistics."""
from .activations import ActivationStats, activation_stats, flatten_activation_stats, hidden_state_stats, qkv_stats
from .sink import (AttentionScores, attention_scores, brute_force_alpha, column_scores, first_token_attention, sink_rate,
                   slot_names, summarise)

__all__ = ["ActivationStats", "AttentionScores", "activation_stats", "attention_scores", "brute_force_alpha",
           "column_scores", "first_token_attention", "flatten_activation_stats", "hidden_state_stats", "qkv_stats",
           "sink_rate", "slot_names", "summarise"]
