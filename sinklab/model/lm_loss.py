"""How a language model is scored, written once: its next-token targets, its mean negative log-likelihood, its
perplexity and its bits per byte. Training (`sinklab.train.module.LitLM.loss`) takes its next-token targets from here;
every evaluation (`sinklab.targets.Target.nll`, `sinklab quant`, the streaming evaluation, the interventions) its mean
NLL and perplexity; training's val/bpb, `sinklab quant` and the streaming evaluation their bits per byte.

Bits per byte (`bits_per_byte`): the summed NLL of the scored targets in bits over the UTF-8 bytes of the text those
same targets decode to, = mean NLL / (ln 2 x bytes per target), comparable across tokenizers and vocabularies where
nats per token are not. The bytes per target of a split are counted once (the data module's
`val_bytes_per_token`, decoding the targets with the run's tokenizer), so bits per byte is the mean NLL times a
constant of the split. The first token of a block (the BOS token where data.bos) is an input, never a target: it
counts neither in the NLL nor in the bytes. A document separator inside a block is a target the loss scores; as a
special token it decodes to no text, so its NLL counts (the cost of predicting a document's end) and its bytes do
not.

Perplexity's overflow guard (`perplexity`): exp(loss) exactly wherever a float holds it, inf where it overflows
(loss > ~709.78, `math.exp` raises OverflowError there), and NaN for a NaN loss. The guards this replaces were
`exp(loss) if loss < 700 else inf` (sinklab quant and the streaming evaluation: inf already from 700, and inf for a
NaN loss) and none (sinklab eval intervene: a traceback past ~709.78); every perplexity of a loss below 700 is the
same bit for bit.
"""
from __future__ import annotations

import math
from typing import Callable, Iterable, Optional, Union

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


def scored_targets(batch: torch.Tensor, prefix_len: int = 0) -> list[list[int]]:
    """The ids of the scored targets of each row of a batch (B, T + 1), in order: what `mean_nll` and the training's
    val/loss average over, and whose text bits per byte count the bytes of."""
    y = next_token_targets(batch, prefix_len)
    return [row[row != IGNORE].tolist() for row in y]


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


def bytes_per_token(n_bytes: int, n_targets: int) -> Optional[float]:
    """UTF-8 bytes of text per scored target; None where the targets decode to no text (bits per byte undefined)."""
    return n_bytes / n_targets if n_bytes > 0 and n_targets > 0 else None


def bits_per_byte(loss: Union[float, torch.Tensor], per_token: Optional[float]):
    """Bits per byte of a mean NLL in nats per target (a float or a tensor), given the bytes of text per target of
    the same targets (`bytes_per_token`): loss / (ln 2 x per_token) (the module docstring); None without bytes."""
    return None if per_token is None else loss / (math.log(2) * per_token)
