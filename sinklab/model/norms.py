"""Norms (`model.norm`), the GatedNorm wrapper any of them can take (`model.gated_norm`), and where they sit in a
block (`model.norm_position`: the block classes are in transformer.py)."""
from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from .registry import NORMS, Component, ConfigError, check_positive_int


class Norm(Component):
    """A norm over the last dimension, built as cls(d, eps) (`make`), wrapped in a `GatedNorm` when
    `model.gated_norm` is true. The GatedNorm knobs belong to every norm: they are declared here, so each registered
    norm owns them."""

    @dataclasses.dataclass
    class Knobs:
        gated_norm: bool = False  # y' = sigmoid(W_up swish(W_down y)) * y after the norm (GatedNorm below)
        gated_norm_rank: int = 16  # r, the width of W_down (d -> r) and W_up (r -> d)
        gated_norm_gate_init: float = 0.5  # the gate's starting value: W_up's bias starts at logit(this)

    llama_knobs: ClassVar[dict[str, Any]] = {"gated_norm": False}

    @classmethod
    def validate(cls, cfg: Any) -> None:
        if not cfg.gated_norm:
            for key in ("gated_norm_rank", "gated_norm_gate_init"):
                default = Norm.Knobs.__dataclass_fields__[key].default
                if getattr(cfg, key) != default:
                    raise ConfigError(f"model.{key}={getattr(cfg, key)} applies to model.gated_norm=true only; "
                                      f"set gated_norm=true or {key}={default}")
            return
        check_positive_int(cfg, "gated_norm_rank")
        if not 0 < cfg.gated_norm_gate_init < 1:
            raise ConfigError(f"model.gated_norm_gate_init={cfg.gated_norm_gate_init} must lie in (0, 1) "
                              "(a sigmoid gate's starting value)")

    @classmethod
    def make(cls, cfg: Any) -> nn.Module:
        """The plain norm, without the gate."""
        return cls(cfg.d_model, cfg.norm_eps)

    @classmethod
    def build(cls, cfg: Any) -> nn.Module:
        norm = cls.make(cfg)
        if cfg.gated_norm:
            return GatedNorm(norm, cfg.d_model, cfg.gated_norm_rank, cfg.gated_norm_gate_init)
        return norm


@NORMS.register("rms")
class RMSNorm(Norm, nn.Module):
    """x / rms(x) * weight (LLaMA's)."""

    def __init__(self, d: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))

    llama = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


@NORMS.register("layer")
class LayerNorm(Norm, nn.LayerNorm):
    """LayerNorm without a bias (the reference study's)."""

    def __init__(self, d: int, eps: float = 1e-5):
        super().__init__(d, eps=eps, bias=False)


@NORMS.register("preaffine")
class PreAffineRMSNorm(RMSNorm):
    """RMSNorm(lambda * x) * weight, lambda learned per channel from 1 (PreAffine, arXiv 2601.22966).

    Follows "A Unified View of Attention and Residual Sinks" (arXiv 2601.22966): lambda lets the model scale a
    channel before the normalisation instead of growing a residual-sink channel to rescale the others.

    Left open by the paper, chosen here: lambda starts at ones (so the model starts as plain RMSNorm); it has no weight
    decay (a vector, like every norm weight, see `train/optim.py`); the same norm is used at every norm site,
    the final norm included; eps is added to the mean square of lambda * x, as RMSNorm's to x's."""

    def __init__(self, d: int, eps: float = 1e-5):
        super().__init__(d, eps)
        self.pre_scale = nn.Parameter(torch.ones(d))  # lambda

    llama = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x * self.pre_scale)


@NORMS.register("dyt")
class DynamicTanh(Norm, nn.Module):
    """Dynamic Tanh, gamma * tanh(alpha * x) + beta, instead of a norm (Zhu et al. 2025).

    Follows "Transformers without Normalization" (Zhu et al. 2025): alpha one learned scalar starting at
    `model.dyt_alpha_init`, gamma (ones) and beta (zeros) learned per channel; no statistics over the channels, so
    `model.norm_eps` has nothing to act on.

    Left open or tuned per model in the paper, chosen here: one alpha_0 for every DyT of the model (the paper tunes
    LLaMA's separately for the attention DyT and the others, and by width; 0.5 is its default elsewhere); the final
    norm is a DyT too, as in the paper."""

    @dataclasses.dataclass
    class Knobs(Norm.Knobs):
        dyt_alpha_init: float = 0.5

    @classmethod
    def validate(cls, cfg: Any) -> None:
        super().validate(cfg)
        if not cfg.dyt_alpha_init > 0:
            raise ConfigError(f"model.dyt_alpha_init={cfg.dyt_alpha_init} must be > 0 (the paper uses 0.5)")
        eps_default = type(cfg).__dataclass_fields__["norm_eps"].default
        if cfg.norm_eps != eps_default:
            raise ConfigError(f"model.norm_eps={cfg.norm_eps} has no effect with model.norm=dyt (no statistics to "
                              f"divide by); set norm_eps={eps_default}")

    @classmethod
    def make(cls, cfg: Any) -> "DynamicTanh":
        return cls(cfg.d_model, cfg.dyt_alpha_init)

    def __init__(self, d: int, alpha_init: float = 0.5):
        super().__init__()
        self.alpha = nn.Parameter(torch.tensor(float(alpha_init)))
        self.weight = nn.Parameter(torch.ones(d))  # gamma
        self.bias = nn.Parameter(torch.zeros(d))  # beta

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.alpha * x) * self.weight + self.bias


class GatedNorm(nn.Module):
    """y = norm(x); y' = sigmoid(W_up swish(W_down y)) * y, elementwise, W_down d -> r and W_up r -> d (GatedNorm,
    "A Unified View of Attention and Residual Sinks", arXiv 2601.22966): an explicit, input-dependent per-channel
    rescaling after the norm, which the paper finds replaces the residual-sink channels a model grows to rescale
    through RMSNorm. It wraps whichever norm `model.norm` selects, at every norm site (both block layouts and the
    final norm).

    Left open by the paper, chosen here: W_down and W_up are drawn N(0, model.init_std) as every matrix; W_up has a
    learned bias starting at logit(model.gated_norm_gate_init), so the gate starts near that value (0.5 by default:
    bias 0, the start of a bias-free gate with small W_up); W_up is not zero at the start, so W_down gets a gradient
    from the first step; the bias has no weight decay (a vector), the matrices have it."""

    def __init__(self, norm: nn.Module, d: int, rank: int = 16, gate_init: float = 0.5):
        super().__init__()
        self.norm = norm
        self.down = nn.Linear(d, rank, bias=False)
        self.up = nn.Linear(rank, d, bias=True)
        self.gate_init = gate_init

    def init_parameters(self, std: float, bias_std: float) -> None:
        """The wrapped norm keeps its own starting values (its vectors); the gate's matrices are drawn, down first."""
        nn.init.normal_(self.down.weight, std=std)
        nn.init.normal_(self.up.weight, std=std)
        nn.init.constant_(self.up.bias, math.log(self.gate_init / (1 - self.gate_init)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm(x)
        return y * torch.sigmoid(self.up(F.silu(self.down(y))))
