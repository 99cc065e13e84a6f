"""The optimizer recipe, a `_target_` / `_partial_` config (conf/optim/adamw.yaml): AdamW as in the reference study
(betas 0.9 / 0.95, weight decay on every parameter unless told otherwise) with linear warmup then a cosine or
constant schedule. `AdamWConfig` holds the defaults once and checks them; Hydra instantiates the node into a partial
of `adamw`, which the LightningModule calls with its model and the run's length (and, in a retrofit, the names of
the parameters it added).

A retrofit (`init_from=` a model without a component this run's config adds: sinklab.model.retrofit) trains two kinds
of parameter, each in its own parameter groups (named `pretrained` and `new`, so the lr monitor logs both):
- `new_lr_scale`: the added parameters' lr is new_lr_scale x lr, on the same schedule;
- `freeze_pretrained`: the parameters copied from the checkpoint are not trained: for the whole run (they are set
  `requires_grad=False` when the model is built, and no optimizer state is kept for them), or with
  `freeze_pretrained_steps` N for the first N steps only, after which they train on a schedule of their own that
  starts at step N (its warmup, then the decay over the remaining steps): the two stages of DSA's retrofit
  (conf/experiment/dsa_retrofit.yaml) in one run. While frozen their lr is exactly 0, so AdamW leaves them bit for
  bit (its moments still follow their gradients).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum
from typing import Any, Iterable, Optional, Sequence

import torch
from torch import nn

from sinklab.config.schema import Schema, integer, number, numbers, rule
from sinklab.errors import UserError


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
    # a retrofit's parameter groups (module docstring): the added parameters' lr multiplier, and the copied ones frozen
    new_lr_scale: float = rule(1.0, number(gt=0))
    freeze_pretrained: bool = False
    freeze_pretrained_steps: Optional[int] = rule(None, integer(1, optional=True))  # null: the whole run

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.freeze_pretrained_steps is not None and not self.freeze_pretrained:
            raise UserError(f"optim.freeze_pretrained_steps={self.freeze_pretrained_steps} applies with "
                            "optim.freeze_pretrained=true only; allowed: freeze_pretrained=true, or "
                            "freeze_pretrained_steps=null")


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
          exclude_norm_and_embedding: bool, warmup_steps: int, schedule: str, min_lr_ratio: float,
          new_lr_scale: float = 1.0, freeze_pretrained: bool = False, freeze_pretrained_steps: Optional[int] = None,
          new_params: Sequence[str] = ()) -> dict[str, Any]:
    """AdamW and its per-step schedule, as LightningModule.configure_optimizers returns them. `new_params`: the
    parameters a retrofit added (module docstring)."""
    groups = retrofit_groups(model.named_parameters(), new_params, lr * new_lr_scale,
                             lambda named: decay_groups(named, weight_decay, exclude_norm_and_embedding))
    opt = torch.optim.AdamW(groups, lr=lr, betas=tuple(betas), eps=eps, fused=None)
    return with_schedule(opt, max_steps, warmup_steps, schedule, min_lr_ratio, freeze_pretrained_steps)


def retrofit_groups(named: Iterable[tuple[str, nn.Parameter]], new_params: Sequence[str], new_lr: float,
                    make: Any, prefix: str = "") -> list[dict[str, Any]]:
    """`make(named)`'s parameter groups, of the parameters that train (requires_grad); with `new_params` (a
    retrofit's, names in the uncompiled model) twice: those of the copied parameters, tagged and named `pretrained`,
    and those of the added ones at lr `new_lr`, tagged and named `new` (`prefix` before each name; a group of
    exempt parameters adds `_no_decay`). Empty groups are left out."""
    trained = [(name, p) for name, p in named if p.requires_grad]
    if not new_params:
        return make(trained)
    new = set(new_params)
    parts = {"pretrained": [(n, p) for n, p in trained if n.removeprefix("_orig_mod.") not in new],
             "new": [(n, p) for n, p in trained if n.removeprefix("_orig_mod.") in new]}
    groups = []
    for tag, part in parts.items():
        for i, group in enumerate(make(part)):
            extra = {"lr": new_lr} if tag == "new" else {}
            groups.append({**group, **extra, "retrofit": tag, "name": prefix + tag + ("_no_decay" if i else "")})
    return [g for g in groups if g["params"]]


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
                  min_lr_ratio: float, frozen_steps: Optional[int] = None) -> dict[str, Any]:
    """The optimizer with its per-step LambdaLR (`lr_lambda`), as configure_optimizers returns them. `frozen_steps`
    N: the groups tagged `pretrained` (`retrofit_groups`) have lr 0 for the first N steps, then a schedule of their
    own from step N (warmup, then the decay over max_steps - N)."""
    def run(s: int) -> float:
        return lr_lambda(s, warmup_steps, max_steps, schedule, min_lr_ratio)

    def after_freeze(s: int) -> float:
        return 0.0 if s < frozen_steps else lr_lambda(s - frozen_steps, warmup_steps, max(1, max_steps - frozen_steps),
                                                      schedule, min_lr_ratio)

    lambdas = run if frozen_steps is None else \
        [after_freeze if g.get("retrofit") == "pretrained" else run for g in opt.param_groups]
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambdas)
    return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
