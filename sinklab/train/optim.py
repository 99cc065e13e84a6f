"""The optimizer recipe, a `_target_` / `_partial_` config (conf/optim/adamw.yaml): AdamW as in the reference study
(betas 0.9 / 0.95, weight decay on every parameter unless told otherwise) with linear warmup then a cosine or
constant schedule. `AdamWConfig` holds the defaults once and checks them; Hydra instantiates the node into a partial
of `adamw`, which the LightningModule calls with its model and the run's length.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum
from typing import Any, Iterable

import torch
from torch import nn

from sinklab.config.schema import Schema, integer, number, numbers, rule


class Schedule(str, Enum):
    cosine = "cosine"
    constant = "constant"  # the reference's min_lr = lr makes it constant after warmup


@dataclass
class AdamWConfig(Schema):
    KEY = "optim"
    _target_: str = "sinklab.train.optim.adamw"
    _partial_: bool = True
    lr: float = rule(2e-3, number(gt=0))
    weight_decay: float = rule(0.1, number(ge=0))
    betas: list[float] = rule([0.9, 0.95], numbers(number(ge=0, lt=1), 2, "numbers in [0, 1)"))
    eps: float = rule(1e-8, number(gt=0))
    exclude_norm_and_embedding: bool = False  # true: no weight decay on norms, embeddings, positions, sink tokens
    warmup_steps: int = rule(50, integer(0))
    schedule: Schedule = Schedule.cosine
    min_lr_ratio: float = rule(0.1, number(ge=0, le=1))  # cosine decays to min_lr_ratio * lr


def register(cs) -> None:
    cs.store(group="optim", name="adamw_schema", node=AdamWConfig)


def lr_lambda(step: int, warmup_steps: int, max_steps: int, schedule: str, min_lr_ratio: float) -> float:
    """Multiplier of the peak lr: linear warmup, then cosine decay to min_lr_ratio, or constant."""
    if warmup_steps and step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == Schedule.constant:
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def no_decay(name: str, p: nn.Parameter) -> bool:
    """Norm weights, biases, embeddings, position tables and sink tokens (for exclude_norm_and_embedding)."""
    return p.dim() < 2 or "emb" in name or "sink_tokens" in name or "pos" in name


def adamw(model: nn.Module, max_steps: int, *, lr: float, weight_decay: float, betas: list[float], eps: float,
          exclude_norm_and_embedding: bool, warmup_steps: int, schedule: str, min_lr_ratio: float) -> dict[str, Any]:
    """AdamW and its per-step schedule, as LightningModule.configure_optimizers returns them."""
    opt = torch.optim.AdamW(decay_groups(model.named_parameters(), weight_decay, exclude_norm_and_embedding), lr=lr,
                            betas=tuple(betas), eps=eps, fused=None)
    return with_schedule(opt, max_steps, warmup_steps, schedule, min_lr_ratio)


def decay_groups(named: Iterable[tuple[str, nn.Parameter]], weight_decay: float,
                 exclude_norm_and_embedding: bool) -> list[dict[str, Any]]:
    """Parameter groups: weight decay on every parameter, or (exclude_norm_and_embedding) none on `no_decay`'s."""
    decay, exempt = [], []
    for name, p in named:
        (exempt if exclude_norm_and_embedding and no_decay(name, p) else decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if exempt:
        groups.append({"params": exempt, "weight_decay": 0.0})
    return groups


def with_schedule(opt: torch.optim.Optimizer, max_steps: int, warmup_steps: int, schedule: str,
                  min_lr_ratio: float) -> dict[str, Any]:
    """The optimizer with its per-step LambdaLR (`lr_lambda`), as configure_optimizers returns them."""
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: lr_lambda(s, warmup_steps, max_steps, schedule, min_lr_ratio))
    return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
