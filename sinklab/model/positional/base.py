"""The interface of every positional encoding (`PositionalEncoding`) and the encodings without a rotation or a
bias: none (nope), absolute tables added to the embeddings (sinusoidal, learnable)."""
from __future__ import annotations

import math
from typing import Any, Optional

import torch
from torch import nn

from ..registry import POSITIONS, Component, ConfigError


# the position types a head can have: full RoPE, partial RoPE (some pairs unrotated), no position (NoPE), ALiBi,
# a learned relative bias, an absolute table added to the embeddings (every head alike)
HEAD_TYPES = ("rope", "partial", "nope", "alibi", "relative", "absolute")


class PositionalEncoding(Component, nn.Module):
    """No positional information (NoPE), and the interface of every positional encoding."""

    adds_logit_bias = False  # needs attention logits to add to (kernel attention has none)

    @classmethod
    def from_config(cls, cfg: Any) -> "PositionalEncoding":
        return cls()

    def absolute(self, n: int) -> Optional[torch.Tensor]:
        """(n, d) table added to the embeddings of positions 0..n-1, or None."""
        return None

    def rotary(self, n: int, start: int = 0) -> Optional["RotaryAt"]:
        """The rotation of q or k at positions start..n-1, or None."""
        return None

    logit_bias = None  # or a method (q_pos (R,), k_pos (N,)) -> (H, R, N) additive logits

    @classmethod
    def rotates(cls, cfg: Any, layer: int) -> bool:
        """Whether the attention of `layer` (0-indexed) applies the rotation (per-layer NoPE says no)."""
        return True

    head_type: str = "nope"  # what every head of this encoding is, for metrics split by head type (HEAD_TYPES)

    @classmethod
    def head_types(cls, cfg: Any, layer: int) -> tuple[str, ...]:
        """The position type of each query head of `layer` (0-indexed), one of HEAD_TYPES: what metrics split by head
        type group on. An encoding that treats heads differently (per-head RoPE, NAPE) says so per head."""
        return (cls.head_type,) * cfg.n_head

    @classmethod
    def pair_frequencies(cls, cfg: Any, layer: int) -> torch.Tensor:
        """(n_head, hd // 2): the angular frequency (radians per position) of each query head's rotary pair
        (x_i, x_{i + hd/2}) in `layer`; 0 where the pair does not rotate (NoPE heads and layers, p-RoPE's slowest
        pairs, every encoding without a rotation). A pair with 0 < frequency x (T - 1) < 2 pi never completes a
        cycle within T tokens (the mechanism papers' "partial-cycle" pairs)."""
        return torch.zeros(cfg.n_head, cfg.hd // 2)


@POSITIONS.register("nope")
class NoPositions(PositionalEncoding):
    """NoPE: the causal mask is the only source of position information."""


@POSITIONS.register("sinusoidal")
class SinusoidalPositions(PositionalEncoding):
    """Absolute sinusoidal encoding cat(sin, cos), added to the token embeddings (no parameters)."""

    head_type = "absolute"

    @classmethod
    def validate(cls, cfg: Any) -> None:
        if cfg.d_model % 2:
            raise ConfigError(f"model.pos=sinusoidal needs an even d_model, got {cfg.d_model}")

    @classmethod
    def from_config(cls, cfg: Any) -> "SinusoidalPositions":
        return cls(cfg.d_model, cfg.block_size + cfg.n_sink_tokens)

    def __init__(self, d_model: int, max_len: int):
        super().__init__()
        pos = torch.arange(max_len, dtype=torch.float32)[:, None]
        inv = torch.exp(torch.arange(0, d_model // 2, dtype=torch.float32) * (-math.log(10000.0) / (d_model // 2)))
        self.register_buffer("table", torch.cat([torch.sin(pos * inv), torch.cos(pos * inv)], dim=-1), persistent=False)

    def absolute(self, n: int) -> torch.Tensor:  # (n, d)
        return table_rows(self.table, n)


def table_rows(table: torch.Tensor, n: int) -> torch.Tensor:
    """The first n rows of an absolute position table, or a one-line error past its end (a KV cache that never
    evicts, decoding past the context)."""
    if n > table.shape[0]:
        raise ValueError(f"position {n - 1} is past the {table.shape[0]} positions of an absolute position table "
                         "(model.block_size + model.n_sink_tokens); allowed: a cache that evicts (streaming), or "
                         "model.pos=rope/alibi/relative/nope")
    return table[:n]


@POSITIONS.register("learnable")
class LearnablePositions(PositionalEncoding):
    """A learned absolute position embedding, added to the token embeddings."""

    head_type = "absolute"

    @classmethod
    def from_config(cls, cfg: Any) -> "LearnablePositions":
        return cls(cfg.d_model, cfg.block_size + cfg.n_sink_tokens)

    def __init__(self, d_model: int, max_len: int):
        super().__init__()
        self.table = nn.Embedding(max_len, d_model)

    def absolute(self, n: int) -> torch.Tensor:  # (n, d)
        return table_rows(self.table.weight, n)

