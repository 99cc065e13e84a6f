"""RoPE, `model.pos=rope`: full, partial (p-RoPE), off in every k-th layer (per-layer NoPE) and per head, and the
rotation it hands the attention (`RotaryAt`)."""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional, Sequence

import torch

from sinklab.errors import word

from ..layer_pattern import layer_ops
from ..registry import ATTENTION_OPS, POSITIONS, ConfigError
from .base import PositionalEncoding


@POSITIONS.register("rope")
class Rotary(PositionalEncoding):
    """RoPE (rotate-half, as LLaMA / HF transformers), optionally partial (p-RoPE), off in every k-th layer, and
    per head.

    Pair i of a head is (x_i, x_{i + hd/2}), rotated by position * rope_base^(-2i/hd), pair 0 the fastest.

    Partial RoPE, `model.rope_fraction` p (p-RoPE, Barbero et al. 2024, "Round and Round We Go! What makes Rotary
    Positional Encodings useful?"): only the floor(p * hd/2) highest-frequency pairs rotate, at the frequencies they
    have in full RoPE; the lowest-frequency pairs get frequency 0 and pass unrotated, so their part of q.k depends on
    the content only. As in the paper's code, the kept frequencies are those of the full head (not respaced).

    Per-layer NoPE, `model.nope_every` k: every k-th layer has no RoPE, counting layers from 1, i.e. layers k, 2k, ...
    (0-indexed: those with (layer + 1) % k == 0), as Llama 4's `no_rope_layer_interval` and Cohere Command A's
    interleaved NoPE layers (k = 4). Left open there and chosen here: every layer still sees the causal mask,
    biases and sink tokens as the others; p applies to the RoPE layers.

    Per head (issue 37). The unit is the key/value head; under GQA each query head takes its kv head's setting, so
    that a key is rotated as every query that reads it:
    - `model.rope_heads`: which kv heads rotate, a count n (the first n: heads 0 .. n - 1) or a list of kv-head
      indices ([0, 2]); the others are NoPE heads (frequency 0 on every pair). null: every head. The rotating heads
      take `model.rope_fraction`.
    - `model.rope_head_fractions`: one p-RoPE fraction per kv head, in [0, 1] (0: a NoPE head, 1: full RoPE), in
      place of `rope_fraction` (which then stays 1) and of `rope_heads` (one spec at a time).
    A spec applies in every RoPE layer (with `nope_every`, the NoPE layers stay NoPE on every head). The per-head
    cos / sin tables, (n_head, positions, hd) for the query heads, are built once; a layer's keys take every g-th
    query head's table (g = n_head / n_kv_head, a strided view). A spec whose heads are all alike keeps the shared
    (positions, hd) tables. Operations that rotate tensors of their own (NSA's window and block keys, DSA's indexer)
    refuse a per-head spec. LLaMA has no per-head RoPE: export-hf refuses it."""

    @dataclasses.dataclass
    class Knobs:
        rope_base: float = 10000.0
        rope_fraction: float = dataclasses.field(default=1.0, metadata={"cases": (1.0, 0.5)})
        nope_every: Optional[int] = dataclasses.field(default=None, metadata={"cases": (None, 2)})
        # a count (the first n kv heads) or a list of kv-head indices; the contract tests try heads 0 and 2 of 4
        rope_heads: Any = dataclasses.field(default=None, metadata={"cases": (None, (0, 2))})
        # one fraction per kv head (the contract tests: full, NoPE, half and a quarter of the 4 pairs of head size 8)
        rope_head_fractions: Optional[list[float]] = dataclasses.field(
            default=None, metadata={"cases": (None, (1.0, 0.0, 0.5, 0.25))})

    llama = True
    llama_knobs = {"rope_fraction": 1.0, "nope_every": None, "rope_heads": None, "rope_head_fractions": None}
    # a retrofit may add NoPE heads or layers to a trained RoPE model: no parameters, not the identity (their q . k
    # loses its rotation) unless every head keeps its fraction
    retrofit_knobs = ("rope_heads", "rope_head_fractions", "nope_every")
    retrofit = "no parameters; not the identity: the NoPE heads / layers stop rotating"

    @classmethod
    def retrofit_identity(cls, cfg: Any) -> bool:
        return cfg.nope_every is None and set(cls.kv_head_fractions(cfg)) == {cfg.rope_fraction}

    @classmethod
    def validate(cls, cfg: Any) -> None:
        if cfg.hd % 2:
            raise ConfigError(f"model.pos=rope needs an even head size, got head size {cfg.hd} "
                              f"(d_model={cfg.d_model} / n_head={cfg.n_head}); change n_head or head_dim")
        if cfg.rope_base <= 0:
            raise ConfigError(f"model.rope_base={cfg.rope_base} must be > 0 (RoPE frequencies base^(-2i/d); "
                              "LLaMA uses 10000)")
        if not 0 < cfg.rope_fraction <= 1:
            raise ConfigError(f"model.rope_fraction={cfg.rope_fraction} must lie in (0, 1] (the share of each head's "
                              "rotary pairs that rotate; 1 = full RoPE)")
        if rotated_pairs(cfg.hd, cfg.rope_fraction) == 0:
            raise ConfigError(f"model.rope_fraction={cfg.rope_fraction} rotates none of the {cfg.hd // 2} pairs of "
                              f"head size {cfg.hd}; allowed: >= {1 / (cfg.hd // 2):.4g} or model.pos=nope")
        k = cfg.nope_every
        if k is not None and (not isinstance(k, int) or isinstance(k, bool) or not 2 <= k <= cfg.n_layer):
            raise ConfigError(f"model.nope_every={k!r} must be an integer in 2..n_layer={cfg.n_layer} or null "
                              "(every k-th layer without RoPE; k=1 is model.pos=nope)")
        if not cls.per_head(cfg):
            return
        own = sorted(op for op in layer_ops(cfg) if ATTENTION_OPS.get(op).rotated)
        if own:
            raise ConfigError(f"{per_head_spec(cfg)} with model.attn_op={own[0]}, which rotates keys of its own with "
                              "one table for every head; allowed: a per-head RoPE spec with another op, or "
                              "rope_heads=null and rope_head_fractions=null")

    @classmethod
    def kv_head_fractions(cls, cfg: Any) -> tuple[float, ...]:
        """(n_kv_head,) the share p of each key/value head's rotary pairs that rotate in a RoPE layer (0: a NoPE
        head): model.rope_head_fractions, else model.rope_fraction on the heads model.rope_heads names (all when
        null) and 0 on the others. A bad spec is one ConfigError line (`validate` calls it first)."""
        n_kv, fractions, heads = cfg.kv_heads, cfg.rope_head_fractions, cfg.rope_heads
        if fractions is None:
            rotating = range(n_kv) if heads is None else chosen_heads(cfg, "rope_heads", "rotates", "nope")
            return tuple(cfg.rope_fraction if h in rotating else 0.0 for h in range(n_kv))
        key = f"model.rope_head_fractions={word(fractions)}"
        if heads is not None:
            raise ConfigError(f"{key} and model.rope_heads={word(heads)} are two per-head specs; allowed: one of them "
                              "(a fraction of 0 makes a NoPE head)")
        if cfg.rope_fraction != 1.0:
            raise ConfigError(f"{key} gives each head its fraction; model.rope_fraction={cfg.rope_fraction} would "
                              "be a second one; set rope_fraction=1.0")
        if not isinstance(fractions, (list, tuple)) or len(fractions) != n_kv:
            raise ConfigError(f"{key} must list one fraction per key/value head, {n_kv} of them (model.n_kv_head, or "
                              "n_head without GQA)")
        for p in fractions:
            if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 <= p <= 1:
                raise ConfigError(f"{key}: {p!r} must lie in [0, 1] (the share of the head's rotary pairs that "
                                  "rotate; 0 = NoPE, 1 = full RoPE)")
            if p > 0 and rotated_pairs(cfg.hd, p) == 0:
                raise ConfigError(f"{key}: {p} rotates none of the {cfg.hd // 2} pairs of head size {cfg.hd}; "
                                  f"allowed: 0 (a NoPE head) or >= {1 / (cfg.hd // 2):.4g}")
        if not any(fractions):
            raise ConfigError(f"{key} rotates no head; allowed: a fraction > 0 for some head, or model.pos=nope")
        return tuple(float(p) for p in fractions)

    @classmethod
    def per_head(cls, cfg: Any) -> bool:
        """Whether the heads of a RoPE layer rotate differently (a per-head spec whose heads are not all alike)."""
        return len(set(cls.kv_head_fractions(cfg))) > 1

    @classmethod
    def head_fractions(cls, cfg: Any) -> tuple[float, ...]:
        """(n_head,) each query head's fraction: its kv head's (query head h reads kv head h // (n_head / n_kv))."""
        return per_query_head(cfg, cls.kv_head_fractions(cfg))

    @classmethod
    def from_config(cls, cfg: Any) -> "Rotary":
        fractions = cls.head_fractions(cfg)
        per_head = fractions if len(set(fractions)) > 1 else None
        return cls(cfg.hd, cfg.block_size + cfg.n_sink_tokens, cfg.rope_base, fractions[0], per_head)

    @classmethod
    def rotates(cls, cfg: Any, layer: int) -> bool:
        return cfg.nope_every is None or (layer + 1) % cfg.nope_every != 0

    @classmethod
    def head_types(cls, cfg: Any, layer: int) -> tuple[str, ...]:
        if not cls.rotates(cfg, layer):
            return ("nope",) * cfg.n_head
        return tuple(rotary_type(cfg.hd, p) for p in cls.head_fractions(cfg))

    @classmethod
    def pair_frequencies(cls, cfg: Any, layer: int) -> torch.Tensor:
        if not cls.rotates(cfg, layer):
            return super().pair_frequencies(cfg, layer)
        return torch.stack([rope_frequencies(cfg.hd, cfg.rope_base, p) for p in cls.head_fractions(cfg)])

    def __init__(self, head_dim: int, max_len: int, base: float = 10000.0, fraction: float = 1.0,
                 head_fractions: Optional[tuple[float, ...]] = None):
        """`head_fractions`: one fraction per query head (per-head tables), else `fraction` for every head."""
        super().__init__()
        inv_freq = rope_frequencies(head_dim, base, fraction) if head_fractions is None else \
            torch.stack([rope_frequencies(head_dim, base, p) for p in head_fractions])  # (hd/2,) or (H, hd/2)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        cos, sin = self.tables(torch.arange(max_len, dtype=torch.float32))
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def tables(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions t (n,) -> cos, sin (n, hd), or (H, n, hd) with per-head frequencies."""
        freqs = t[:, None] * self.inv_freq[..., None, :]  # (n, hd/2) or (H, n, hd/2)
        emb = torch.cat([freqs, freqs], dim=-1)  # (..., n, hd)
        return emb.cos(), emb.sin()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (B, H, T, hd) -> rotated, positions 0..T-1."""
        return self.rotary(x.shape[-2])(x)

    def rotary(self, n: int, start: int = 0) -> "RotaryAt":
        """The tables for positions start..n-1, sliced once: the model binds them once per forward for every layer.
        Past the precomputed context (a KV cache that never evicts) they are computed for the positions asked."""
        if n > self.cos.shape[-2]:
            return RotaryAt(*self.tables(torch.arange(start, n, dtype=torch.float32, device=self.inv_freq.device)))
        return RotaryAt(self.cos[..., start:n, :], self.sin[..., start:n, :])


def chosen_heads(cfg: Any, key: str, verb: str, instead: str) -> tuple[int, ...]:
    """The key/value heads that model.<key> names, a count n (heads 0 .. n - 1) or a list of indices, sorted. A
    spec that names no head ("... <verb> no head; ... or model.pos=<instead>"), a head that does not exist or one
    named twice is one ConfigError line."""
    value, n_kv = getattr(cfg, key), cfg.kv_heads
    heads = f"{n_kv} key/value heads (model.n_kv_head, or n_head without GQA)"
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 1:
            raise ConfigError(f"model.{key}={value} {verb} no head; allowed: 1..{n_kv} of the {heads}, or "
                              f"model.pos={instead}")
        if value > n_kv:
            raise ConfigError(f"model.{key}={value} exceeds the {heads}; allowed: 1..{n_kv}, or a list of head "
                              f"indices in 0..{n_kv - 1}")
        return tuple(range(value))
    if not isinstance(value, (list, tuple)) or any(isinstance(h, bool) or not isinstance(h, int) for h in value):
        raise ConfigError(f"model.{key}={word(value)} must be a count of key/value heads (the first n) or a list of "
                          "head indices, e.g. [0, 2]")
    if not value:
        raise ConfigError(f"model.{key}=[] {verb} no head; allowed: head indices in 0..{n_kv - 1}, or "
                          f"model.pos={instead}")
    bad = next((h for h in value if not 0 <= h < n_kv), None)
    if bad is not None:
        raise ConfigError(f"model.{key}={word(value)} names head {bad}, which does not exist: the {heads} are "
                          f"0..{n_kv - 1}")
    if len(set(value)) != len(value):
        raise ConfigError(f"model.{key}={word(value)} names a head twice; allowed: each head once")
    return tuple(sorted(value))


def per_query_head(cfg: Any, kv_values: Sequence[Any]) -> tuple[Any, ...]:
    """(n_head,) each query head's value from (n_kv_head,) values per key/value head: under GQA query head h reads
    kv head h // (n_head / n_kv_head), and takes its setting (the per-head RoPE and NAPE rule)."""
    return tuple(v for v in kv_values for _ in range(cfg.n_head // cfg.kv_heads))


def per_head_spec(cfg: Any) -> str:
    """The per-head RoPE knob a config sets, as 'model.key=value'."""
    key = "rope_heads" if cfg.rope_heads is not None else "rope_head_fractions"
    return f"model.{key}={word(getattr(cfg, key))}"


def rotary_type(head_dim: int, fraction: float) -> str:
    """A RoPE head's type (HEAD_TYPES) under p-RoPE fraction p: nope (no pair rotates), partial or rope (all do)."""
    pairs = rotated_pairs(head_dim, fraction)
    return "nope" if pairs == 0 else "rope" if pairs == head_dim // 2 else "partial"


def rope_frequencies(head_dim: int, base: float, fraction: float = 1.0) -> torch.Tensor:
    """(hd/2,) the angular frequency of each rotary pair, base^(-2i/hd), pair 0 the fastest; 0 for the pairs p-RoPE
    leaves unrotated (the slowest ones)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    inv_freq[rotated_pairs(head_dim, fraction):] = 0.0
    return inv_freq


def rotated_pairs(head_dim: int, fraction: float) -> int:
    """How many of a head's hd/2 rotary pairs rotate under p-RoPE: floor(p * hd/2) (a float's last bit aside)."""
    return math.floor(fraction * (head_dim // 2) + 1e-9)


class RotaryAt:
    """RoPE for a fixed length: callable on q or k (B, H, T, hd); casts the tables to the input's dtype once. The
    tables are (T, hd), shared by the heads, or (n_head, T, hd), one per query head (`Rotary`'s per-head spec)."""

    __slots__ = ("cos", "sin", "_cos", "_sin")

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor):
        self.cos, self.sin = cos, sin  # in the buffers' dtype
        self._cos, self._sin = cos, sin  # cast to the last input's dtype (autocast: the projections' dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self._cos.dtype:
            self._cos, self._sin = self.cos.to(x.dtype), self.sin.to(x.dtype)
        cos, sin = self._cos, self._sin
        if cos.dim() == 3 and cos.shape[0] != x.shape[1]:
            # per-head tables (H, T, hd) of the query heads, and x holds the kv heads: kv head j takes the table of
            # query head j * g, the first of its group (a strided view, no copy)
            step = cos.shape[0] // x.shape[1]
            cos, sin = cos[::step], sin[::step]
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat([-x2, x1], dim=-1) * sin
