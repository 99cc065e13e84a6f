"""Positional encodings, chosen by `model.pos`: absolute ones added to the embeddings (sinusoidal, learnable), RoPE
on q / k (rope), additive biases on the attention logits (alibi, nape, relative), or none (nope).

Each is a `PositionalEncoding`: the model asks it for an absolute table (`absolute`), a rotation (`rotary`) and a
logit bias (`logit_bias`) for a sequence, and uses whichever it returns. `base.py` holds the interface and the
encodings without a rotation or a bias, `rope.py` RoPE, `biases.py` the logit biases; they register in that order.
"""
from .base import HEAD_TYPES, LearnablePositions, NoPositions, PositionalEncoding, SinusoidalPositions, table_rows
from .rope import (Rotary, RotaryAt, chosen_heads, per_head_spec, per_query_head, rope_frequencies, rotary_type,
                   rotated_pairs)
from .biases import ALiBi, NAPE, RelativeBias, alibi_slopes

__all__ = ["HEAD_TYPES", "PositionalEncoding", "NoPositions", "SinusoidalPositions", "LearnablePositions", "table_rows",
           "Rotary", "RotaryAt", "chosen_heads", "per_head_spec", "per_query_head", "rope_frequencies", "rotary_type",
           "rotated_pairs", "ALiBi", "NAPE", "RelativeBias", "alibi_slopes"]
