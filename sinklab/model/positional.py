"""Positional encodings: absolute ones added to the embeddings, RoPE on q/k, additive biases on the logits."""
from __future__ import annotations

import math

import torch
from torch import nn


class SinusoidalPositions(nn.Module):
    """Absolute sinusoidal encoding cat(sin, cos), added to the token embeddings (no parameters)."""

    def __init__(self, d_model: int, max_len: int):
        super().__init__()
        pos = torch.arange(max_len, dtype=torch.float32)[:, None]
        inv = torch.exp(torch.arange(0, d_model // 2, dtype=torch.float32) * (-math.log(10000.0) / (d_model // 2)))
        self.register_buffer("table", torch.cat([torch.sin(pos * inv), torch.cos(pos * inv)], dim=-1), persistent=False)

    def forward(self, T: int) -> torch.Tensor:  # (T, d)
        return self.table[:T]


class LearnablePositions(nn.Module):
    def __init__(self, d_model: int, max_len: int):
        super().__init__()
        self.table = nn.Embedding(max_len, d_model)

    def forward(self, T: int) -> torch.Tensor:  # (T, d)
        return self.table.weight[:T]


class Rotary(nn.Module):
    """RoPE over the whole head (rotate-half convention, as LLaMA / HF transformers)."""

    def __init__(self, head_dim: int, max_len: int, base: float = 10000.0):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        t = torch.arange(max_len, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)  # (max_len, hd/2)
        emb = torch.cat([freqs, freqs], dim=-1)  # (max_len, hd)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (B, H, T, hd) -> rotated, positions 0..T-1."""
        return self.at(x.shape[-2])(x)

    def at(self, T: int) -> "RotaryAt":
        """The tables for positions 0..T-1, sliced once: the model binds them once per forward for every layer."""
        return RotaryAt(self.cos[:T], self.sin[:T])


class RotaryAt:
    """RoPE for a fixed length: callable on q or k (B, H, T, hd); casts the tables to the input's dtype once."""

    __slots__ = ("cos", "sin", "_cos", "_sin")

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor):
        self.cos, self.sin = cos, sin  # in the buffers' dtype
        self._cos, self._sin = cos, sin  # cast to the last input's dtype (autocast: the projections' dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self._cos.dtype:
            self._cos, self._sin = self.cos.to(x.dtype), self.sin.to(x.dtype)
        x1, x2 = x.chunk(2, dim=-1)
        return x * self._cos + torch.cat([-x2, x1], dim=-1) * self._sin


def alibi_slopes(n_head: int) -> torch.Tensor:
    """The standard geometric ALiBi slopes (Press et al.), with the interleaving rule for non-powers of two."""

    def pow2(n: int) -> list[float]:
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        return [start * start ** i for i in range(n)]

    if math.log2(n_head).is_integer():
        return torch.tensor(pow2(n_head))
    closest = 2 ** math.floor(math.log2(n_head))
    return torch.tensor(pow2(closest) + pow2(2 * closest)[0::2][: n_head - closest])


class ALiBi(nn.Module):
    def __init__(self, n_head: int):
        super().__init__()
        self.register_buffer("slopes", alibi_slopes(n_head), persistent=False)

    def forward(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        """Additive logit bias (H, R, Tk) = -slope * |i - j|."""
        dist = (q_pos[:, None] - k_pos[None, :]).abs().to(self.slopes.dtype)
        return -self.slopes[:, None, None] * dist


class RelativeBias(nn.Module):
    """T5-style bucketed relative position bias, one table per model (shared by the layers, as in T5)."""

    def __init__(self, n_head: int, num_buckets: int = 32, max_distance: int = 128, bidirectional: bool = False):
        super().__init__()
        self.num_buckets, self.max_distance, self.bidirectional = num_buckets, max_distance, bidirectional
        self.table = nn.Embedding(num_buckets, n_head)

    def bucket(self, rel: torch.Tensor) -> torch.Tensor:
        """rel = key - query position -> bucket ids (T5's _relative_position_bucket)."""
        n = self.num_buckets
        out = torch.zeros_like(rel)
        if self.bidirectional:
            n //= 2
            out = out + (rel > 0).long() * n
            rel = rel.abs()
        else:
            rel = -torch.clamp(rel, max=0)
        max_exact = n // 2
        is_small = rel < max_exact
        large = max_exact + (
            torch.log(rel.float().clamp(min=1) / max_exact) / math.log(self.max_distance / max_exact) * (n - max_exact)
        ).long()
        large = torch.clamp(large, max=n - 1)
        return out + torch.where(is_small, rel, large)

    def forward(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        """Additive logit bias (H, R, Tk)."""
        rel = k_pos[None, :] - q_pos[:, None]  # (R, Tk)
        return self.table(self.bucket(rel)).permute(2, 0, 1)  # (R, Tk, H) -> (H, R, Tk)
