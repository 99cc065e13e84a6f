"""How a language model is scored, written once: its next-token targets, its mean negative log-likelihood and its
perplexity. Training (`sinklab.train.module.LitLM.loss`) takes its next-token targets from here; every evaluation
(`sinklab.targets.Target.nll`, `sinklab quant`, the streaming evaluation, the interventions) its mean NLL and
perplexity.

Perplexity's overflow guard (`perplexity`): exp(loss) exactly wherever a float holds it, inf where it overflows
(loss > ~709.78, `math.exp` raises OverflowError there), and NaN for a NaN loss. The guards this replaces were
`exp(loss) if loss < 700 else inf` (sinklab quant and the streaming evaluation: inf already from 700, and inf for a
NaN loss) and none (sinklab eval intervene: a traceback past ~709.78); every perplexity of a loss below 700 is the
same bit for bit.
"""
from __future__ import annotations

import math
from typing import Callable, Iterable, Union

import torch
import torch.nn.functional as F

IGNORE = -100  # cross-entropy's ignore_index: targets that are not scored

LogitsFn = Callable[[torch.Tensor], torch.Tensor]  # idx (B, T) -> logits (B, T, V)


def next_token_targets(batch: torch.Tensor, prefix_len: int = 0) -> torch.Tensor:
    """batch (B, T + 1) -> the targets (B, T) of its inputs batch[:, :-1]; a prefix-LM (prefix_len p > 1) does not
    score its first p - 1 targets (they are IGNORE)."""
    y = batch[:, 1:]
    if prefix_len > 1:
        y = y.clone()
        y[:, : prefix_len - 1] = IGNORE
    return y


@torch.no_grad()
def mean_nll(logits_of: LogitsFn, batches: Iterable[torch.Tensor], prefix_len: int = 0) -> tuple[float, int]:
    """(mean next-token cross-entropy over every scored target of the batches (B, T + 1), number of targets); the
    sum is taken in float32 per batch and accumulated in Python floats (float64)."""
    total, count = 0.0, 0
    for batch in batches:
        y = next_token_targets(batch, prefix_len)
        logits = logits_of(batch[:, :-1])  # (B, T, V)
        total += F.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), ignore_index=IGNORE,
                                 reduction="sum").item()
        count += int((y != IGNORE).sum())
    return total / count, count


def perplexity(loss: Union[float, torch.Tensor]) -> float:
    """exp(mean NLL): `loss` is the mean NLL, or a tensor of per-target NLLs (averaged in float64). inf where
    exp overflows a float, NaN for a NaN loss (see the module docstring)."""
    if isinstance(loss, torch.Tensor):
        loss = float(loss.double().mean())
    try:
        return math.exp(loss)
    except OverflowError:
        return math.inf
