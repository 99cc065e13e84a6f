"""Positional encodings that add a bias to the attention logits: ALiBi (alibi), ALiBi on some heads and NoPE on the
others (nape), T5's bucketed relative bias (relative)."""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

import torch
from torch import nn

from ..registry import POSITIONS, ConfigError
from .base import PositionalEncoding
from .rope import chosen_heads, per_query_head


def alibi_slopes(n_head: int) -> torch.Tensor:
    """The standard geometric ALiBi slopes (Press et al.), with the interleaving rule for non-powers of two."""

    def pow2(n: int) -> list[float]:
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        return [start * start ** i for i in range(n)]

    if math.log2(n_head).is_integer():
        return torch.tensor(pow2(n_head))
    closest = 2 ** math.floor(math.log2(n_head))
    return torch.tensor(pow2(closest) + pow2(2 * closest)[0::2][: n_head - closest])


@POSITIONS.register("alibi")
class ALiBi(PositionalEncoding):
    """Attention with linear biases (Press et al.): -slope_h * |i - j| added to the logits."""

    adds_logit_bias = True
    head_type = "alibi"

    @classmethod
    def from_config(cls, cfg: Any) -> "ALiBi":
        return cls(cfg.n_head)

    def __init__(self, n_head: int, slopes: Optional[torch.Tensor] = None):
        """`slopes` (n_head,): one per head, 0 for a head without a bias (NAPE); default: the geometric ones."""
        super().__init__()
        self.register_buffer("slopes", alibi_slopes(n_head) if slopes is None else slopes, persistent=False)

    def logit_bias(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        """Additive logit bias (H, R, Tk) = -slope * |i - j|."""
        dist = (q_pos[:, None] - k_pos[None, :]).abs().to(self.slopes.dtype)
        return -self.slopes[:, None, None] * dist


@POSITIONS.register("nape")
class NAPE(ALiBi):
    """NAPE: ALiBi on some heads, no position on the others (NoPE), as the NAPE split (half the heads each).

    `model.nape_alibi_heads`: which key/value heads take ALiBi, a count n (the first n) or a list of kv-head
    indices; null: the first half, n_kv_head // 2. Query heads take their kv head's type (the per-head RoPE spec's
    rule, so that each key belongs to one type). Chosen here: the ALiBi heads take the geometric slopes of an
    ALiBi model with as many heads (`alibi_slopes(m)` for the m ALiBi query heads, in head order: the same range of
    distances, 1/2 .. 1/256 for m = 8, as full ALiBi), not full ALiBi's slopes at their indices (which would give
    the ALiBi heads of the first half only the steep slopes); the NoPE heads have slope 0: no bias. LLaMA has no
    ALiBi: export-hf refuses it."""

    @dataclasses.dataclass
    class Knobs:
        # the contract tests try the default half and heads 0 and 3 of 4
        nape_alibi_heads: Any = dataclasses.field(default=None, metadata={"cases": (None, (0, 3))})

    @classmethod
    def validate(cls, cfg: Any) -> None:
        cls.alibi_kv_heads(cfg)

    @classmethod
    def alibi_kv_heads(cls, cfg: Any) -> tuple[int, ...]:
        """The key/value heads with ALiBi (sorted); a spec naming none is one ConfigError line."""
        if cfg.nape_alibi_heads is None:
            half = cfg.kv_heads // 2
            if half == 0:
                raise ConfigError(f"model.pos=nape gives ALiBi to half of the key/value heads, none of "
                                  f"n_kv_head={cfg.kv_heads}; allowed: 2 or more key/value heads, or model.pos=alibi")
            return tuple(range(half))
        return chosen_heads(cfg, "nape_alibi_heads", "gives ALiBi to", "nope")

    @classmethod
    def alibi_query_heads(cls, cfg: Any) -> list[bool]:
        """(n_head,) whether each query head has ALiBi (its kv head's setting)."""
        alibi = set(cls.alibi_kv_heads(cfg))
        return list(per_query_head(cfg, [h in alibi for h in range(cfg.kv_heads)]))

    @classmethod
    def head_types(cls, cfg: Any, layer: int) -> tuple[str, ...]:
        return tuple("alibi" if a else "nope" for a in cls.alibi_query_heads(cfg))

    @classmethod
    def from_config(cls, cfg: Any) -> "NAPE":
        alibi = cls.alibi_query_heads(cfg)
        slopes = torch.zeros(cfg.n_head)
        slopes[torch.tensor(alibi)] = alibi_slopes(sum(alibi))
        return cls(cfg.n_head, slopes)


@POSITIONS.register("relative")
class RelativeBias(PositionalEncoding):
    """T5-style bucketed relative position bias, one table per model (shared by the layers, as in T5); a prefix LM
    splits the buckets by direction (its prefix sees later keys)."""

    adds_logit_bias = True
    head_type = "relative"

    @dataclasses.dataclass
    class Knobs:
        relative_buckets: int = 32
        relative_max_distance: int = 128

    @classmethod
    def validate(cls, cfg: Any) -> None:
        if not isinstance(cfg.relative_buckets, int) or cfg.relative_buckets < 4:
            # a prefix LM splits the buckets by direction, and each half needs at least one exact distance
            raise ConfigError(f"model.relative_buckets={cfg.relative_buckets!r} must be an integer >= 4")
        if cfg.relative_max_distance <= cfg.relative_buckets // 2:
            # T5 buckets: the first buckets // 2 distances are exact, the rest log-spaced up to max_distance
            raise ConfigError(f"model.relative_max_distance={cfg.relative_max_distance} must exceed the "
                              f"{cfg.relative_buckets // 2} exact distances of model.relative_buckets="
                              f"{cfg.relative_buckets}; allowed: > {cfg.relative_buckets // 2}")

    @classmethod
    def from_config(cls, cfg: Any) -> "RelativeBias":
        return cls(cfg.n_head, cfg.relative_buckets, cfg.relative_max_distance, bidirectional=cfg.prefix_len > 0)

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

    def logit_bias(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        """Additive logit bias (H, R, Tk)."""
        rel = k_pos[None, :] - q_pos[:, None]  # (R, Tk)
        return self.table(self.bucket(rel)).permute(2, 0, 1)  # (R, Tk, H) -> (H, R, Tk)
