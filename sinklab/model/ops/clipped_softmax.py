"""Clipped softmax (Bondarenko, Nagel & Blankevoort 2023, "Quantizable Transformers: Removing Outliers by Helping
Attention Heads Do Nothing", eq. 4.1): clip((zeta - gamma) * softmax(x) + gamma, 0, 1), gamma = -alpha / T.

Stretched below zero (gamma < 0), a small probability is clipped to exactly zero with a finite logit, so a head can
"do nothing" without pushing its logits, and the activations feeding them, to extremes; zeta > 1 lets a probability
reach exactly one. Rows do not sum to one (the metric also reports Sink*).

Details the paper leaves open, decided here:
- T is the number of keys of a full training sequence (model.block_size tokens, learned sink tokens and a K / KV
  bias slot included), the same for every query row and every input length: the paper's "sequence length" (its
  models train at one length), not the number of keys a row sees under the causal (or window) mask, and not the
  length of a shorter probe or prompt. So a position's output does not depend on how many tokens follow it, and
  decoding with a KV cache gives the full forward's logits. (T was once the input's length: the two
  agree on full-context inputs, which is what training and the sink probes at the training length use.)
- alpha defaults to 4. The paper reports gamma = -alpha / T from a sweep; its reference scripts use gamma = -0.025
  at T = 128 for BERT-base (alpha = 3.2) and alpha = 12 at T = 512 for OPT-125m. 4 is a round value near the BERT
  setting, not a number the paper recommends for small causal models.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ..registry import ATTENTION_OPS, ConfigError
from .base import AttentionOp


@ATTENTION_OPS.register("clipped_softmax")
class ClippedSoftmax(AttentionOp):
    """clip((zeta - gamma) * softmax + gamma, 0, 1), gamma = -alpha / T: exact zeros (and ones) for finite logits."""

    @dataclasses.dataclass
    class Knobs:
        clip_zeta: float = 1.0  # stretch above one: zeta > 1 lets a probability be clipped to exactly 1
        clip_alpha: float = 4.0  # gamma = -alpha / T, T the keys of a training sequence: stretch below zero

    def __init__(self, cfg: Any):
        super().__init__(cfg)
        self.zeta, self.alpha = cfg.clip_zeta, cfg.clip_alpha
        # T: the keys of a full training sequence (bias slot, sink tokens, model.block_size tokens), whatever the
        # row sees and however long the input: a position's output does not depend on how many tokens follow it,
        # so decoding with a KV cache gives the full forward's logits
        self.n_train_keys = cfg.n_slots + cfg.n_sink_tokens + cfg.block_size

    @classmethod
    def validate(cls, cfg: Any) -> None:
        # the paper's range: gamma <= 0 keeps masked keys (softmax 0) at 0; zeta >= 1 keeps 1 reachable
        if cfg.clip_alpha < 0:
            raise ConfigError(f"model.clip_alpha={cfg.clip_alpha} would give masked keys weight (gamma = -alpha / T "
                              "> 0); allowed: >= 0")
        if cfg.clip_zeta < 1:
            raise ConfigError(f"model.clip_zeta={cfg.clip_zeta} would cap every weight below one; allowed: >= 1")

    def normalise(self, s: torch.Tensor, seen: torch.Tensor) -> torch.Tensor:
        gamma = -self.alpha / self.n_train_keys
        p = torch.softmax(s.masked_fill(~seen, float("-inf")), dim=-1)  # (B, H, R, n_keys)
        return ((self.zeta - gamma) * p + gamma).clamp(0, 1)  # a masked key: gamma <= 0, clipped to 0
