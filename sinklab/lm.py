"""The language model as the evaluation commands see it: a target to load (a sinklab checkpoint or a local
transformers causal LM), its next-token targets, its mean negative log-likelihood and its perplexity, written once.

This module sits below `sinklab.train` and `sinklab.evals` (it imports only torch, `sinklab.checkpoint` and, for a
transformers model, `sinklab.hf`), so `sinklab quant` and `sinklab eval` load and score a model without Lightning.
Training (`sinklab.train.module.LitLM.loss`) takes its next-token targets from here; `sinklab quant`
(`sinklab.quant.fake`), the streaming evaluation (`sinklab.evals.perplexity`, `sinklab.cli.streaming`) and the
interventions (`sinklab.evals.intervene`) their targets, mean NLL and perplexity.

Perplexity's overflow guard (`perplexity`): exp(loss) exactly wherever a float holds it, inf where it overflows
(loss > ~709.78, `math.exp` raises OverflowError there), and NaN for a NaN loss. The guards this replaces were
`exp(loss) if loss < 700 else inf` (sinklab quant and the streaming evaluation: inf already from 700, and inf for a
NaN loss) and none (sinklab eval intervene: a traceback past ~709.78); every perplexity of a loss below 700 is the
same bit for bit.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
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


@dataclass
class Target:
    """A model to evaluate: `logits_of(idx (B, T))` -> logits (B, T, V); `meta` = {target, source ("sinklab" |
    "hf"), vocab_size, context (None when the config has none), prefix_len}; `run_dir` the run it was trained in,
    or None (a bare checkpoint, a transformers model)."""

    model: torch.nn.Module
    logits_of: LogitsFn
    meta: dict
    run_dir: Optional[Path]


def load_target(target: Optional[str], hf_model: Optional[str], device: torch.device, revision: Optional[str] = None,
                dtype="auto") -> Target:
    """A sinklab checkpoint or run dir (`target`), or a transformers causal LM (`hf_model`: a local dir or a hub id
    at `revision`, in `dtype`: a torch dtype or a --dtype name, `sinklab.hf.load_hf_model`), on `device`."""
    if hf_model is not None:
        from sinklab import hf

        model = hf.load_hf_model(hf_model, device, dtype, revision)
        meta = {"target": str(hf_model), "source": "hf", "vocab_size": hf.vocab_size(model),
                "context": hf.context_length(model), "prefix_len": 0, "revision": revision,
                "dtype": str(next(model.parameters()).dtype).removeprefix("torch.")}
        return Target(model, lambda idx: model(input_ids=idx, use_cache=False).logits, meta, None)
    from sinklab.checkpoint import load_model
    from sinklab.probe_inputs import checkpoint_and_run_dir

    ckpt, run_dir = checkpoint_and_run_dir(target)
    model = load_model(ckpt).to(device)
    cfg = model.cfg
    meta = {"target": str(ckpt), "source": "sinklab", "vocab_size": cfg.vocab_size, "context": cfg.block_size,
            "prefix_len": cfg.prefix_len}
    return Target(model, model, meta, run_dir)
