"""Attention biases (`model.attn_bias`): a key (K) or key-value (KV) slot that every query sees, prepended to the
keys after RoPE, or a bias added to each head's output (V). Per head, or one shared by all heads
(`model.attn_bias_shared`). The reference study's K bias has a zero value, or a fixed one
(`model.attn_bias_fixed_value_scale`: a fixed random direction of that norm).

Retrofit (a bias added to a trained model): a V bias starts as the identity, exactly (zero). A K / KV slot cannot: its
logit q . k_bias is finite for every query, so the slot takes a share exp(q . k_bias) / Z of every row whatever k_bias
is (a softmax weight of 0 needs a logit of -inf); it keeps its fresh N(0, bias_init_std) init, a logit near 0.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch
from torch import nn

from .registry import ATTN_BIASES, Component, ConfigError


@ATTN_BIASES.register("none")
class AttentionBias(Component, nn.Module):
    """No bias, and the interface: `extend` prepends slots to k and v, `output` adds to the heads' outputs."""

    n_slots = 0  # key slots visible to every query

    def __init__(self, cfg: Any):
        super().__init__()
        self.n_head, self.hd = cfg.n_head, cfg.hd

    llama = True

    def init_parameters(self, std: float, bias_std: float) -> None:
        """Biases start small: N(0, model.bias_init_std)."""
        for p in self.parameters():
            nn.init.normal_(p, std=bias_std)

    def extend(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v (B, H, N, hd) -> (B, H, n_slots + N, hd)."""
        return k, v

    def output(self, o: torch.Tensor) -> torch.Tensor:
        """o (B, H, N, hd) -> o."""
        return o

    def per_head(self, bias: torch.Tensor) -> torch.Tensor:
        """(1 or H, hd) -> (H, hd)."""
        return bias.expand(self.n_head, self.hd)


class LearnedBias(AttentionBias):
    """A bias learned per head, or shared by the heads."""

    @dataclasses.dataclass
    class Knobs:
        attn_bias_shared: bool = False  # one bias for all heads instead of one per head

    llama = False

    learned: tuple[str, ...] = ()  # the parameters, each (1 or H, hd), created in this order

    def __init__(self, cfg: Any):
        super().__init__(cfg)
        for name in self.learned:
            setattr(self, name, nn.Parameter(torch.zeros(1 if cfg.attn_bias_shared else cfg.n_head, cfg.hd)))


class SlotBias(LearnedBias):
    """A learned key slot, prepended to the keys after RoPE (so never rotated), with the value `slot_value`."""

    n_slots = 1
    retrofit = "not the identity (a finite key logit takes a share of every row): k_bias fresh"
    learned = ("k_bias",)

    def slot_value(self, v: torch.Tensor) -> torch.Tensor:
        """(H, hd) value of the slot."""
        raise NotImplementedError

    def extend(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        B = k.shape[0]
        kb = self.per_head(self.k_bias)[None, :, None, :].expand(B, -1, -1, -1).to(k.dtype)
        vb = self.slot_value(v)[None, :, None, :].expand(B, -1, -1, -1).to(v.dtype)
        return torch.cat([kb, k], dim=2), torch.cat([vb, v], dim=2)  # (B, H, 1 + N, hd)


@ATTN_BIASES.register("k")
class KeyBias(SlotBias):
    """A learned key slot with a zero value, or a fixed value of norm `attn_bias_fixed_value_scale`."""

    @dataclasses.dataclass
    class Knobs(LearnedBias.Knobs):
        attn_bias_fixed_value_scale: Optional[float] = None  # K bias whose value is a fixed vector of this norm
        attn_bias_fixed_value_seed: int = 0  # which fixed direction (v' = 0, v'' = 1, ...)

    @classmethod
    def validate(cls, cfg: Any) -> None:
        if cfg.attn_bias_fixed_value_scale is not None and cfg.attn_bias_fixed_value_scale < 0:
            raise ConfigError(f"model.attn_bias_fixed_value_scale={cfg.attn_bias_fixed_value_scale} is the norm "
                              "of the fixed value; allowed: >= 0 or null")

    def __init__(self, cfg: Any):
        super().__init__(cfg)
        if cfg.attn_bias_fixed_value_scale is not None:
            g = torch.Generator().manual_seed(1234 + cfg.attn_bias_fixed_value_seed)
            direction = torch.randn(cfg.hd, generator=g)
            self.register_buffer("v_fixed", cfg.attn_bias_fixed_value_scale * direction / direction.norm())

    def slot_value(self, v: torch.Tensor) -> torch.Tensor:
        fixed = getattr(self, "v_fixed", None)
        return fixed.expand(self.n_head, self.hd) if fixed is not None else \
            torch.zeros(self.n_head, self.hd, device=v.device)


@ATTN_BIASES.register("kv")
class KeyValueBias(SlotBias):
    """A learned key slot with a learned value."""

    learned = ("k_bias", "v_bias")

    def slot_value(self, v: torch.Tensor) -> torch.Tensor:
        return self.per_head(self.v_bias)


@ATTN_BIASES.register("v")
class ValueBias(LearnedBias):
    """A learned bias added to each head's output (before the output projection)."""

    learned = ("v_out_bias",)
    retrofit = "the identity, exactly: the bias starts at zero"

    @classmethod
    def retrofit_identity(cls, cfg: Any) -> bool:
        return True

    def retrofit_init(self, parent: nn.Module) -> None:
        nn.init.zeros_(self.v_out_bias)

    def output(self, o: torch.Tensor) -> torch.Tensor:
        return o + self.per_head(self.v_out_bias)[None, :, None, :]
