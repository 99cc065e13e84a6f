"""Muon (`optim=muon`, conf/optim/muon.yaml): `torch.optim.Muon` for the hidden matrices, AdamW for the rest, as the
common recipe does (Jordan et al. 2024, the modded-nanogpt speedrun; Liu et al. 2025, "Muon is Scalable for LLM
Training", arXiv 2502.16982).

- Muon takes the 2-D weights of the linear layers inside the blocks: the attention projections, the FFN, a gate's
  W_theta, a kernel feature map's layers, GatedNorm's low-rank pair.
- AdamW takes everything else: the token embedding, the LM head, norm gains, biases, learned positions, sink tokens,
  bias slots and an op's own scalars (a sink logit, differential attention's lambda vectors). Its settings are
  AdamW's schema's (`betas`, `eps`, `exclude_norm_and_embedding`).
- One lr and one weight decay for both, one schedule (warmup then cosine or constant, as AdamW's). Muon's step is
  scaled by `adjust_lr_fn`: `match_rms_adamw` (default, Moonshot's 0.2 sqrt(max(A, B))) gives its update AdamW's
  RMS, so the lr and weight decay tuned for AdamW carry over and an lr sweep compares the two at matched lrs;
  `original` is Keller Jordan's sqrt(max(1, A / B)), which wants a larger lr (0.02-0.05).
- The two optimizers step as one (`MuonWithAdamW`), so that Lightning's automatic optimization, gradient clipping,
  the lr scheduler, the lr monitor and checkpoints see a single optimizer whose parameter groups are both parts'.
- A retrofit's keys (`new_lr_scale`, `freeze_pretrained`: sinklab.train.optim) split each part's groups alike
  (`muon_pretrained`, `muon_new`, `adamw_...`); a part left with nothing to train (every hidden matrix frozen, say)
  is left out.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum
from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn

from sinklab.config.schema import integer, number, rule
from sinklab.errors import UserError

from .optim import AdamWConfig, decay_groups, retrofit_groups, with_schedule

HIDDEN = re.compile(r"(^|\.)blocks\.")  # a module inside the blocks (also under a compiled model's _orig_mod)


class AdjustLR(str, Enum):
    match_rms_adamw = "match_rms_adamw"
    original = "original"


@dataclass
class MuonConfig(AdamWConfig):
    """AdamW's keys (they set the AdamW part and the shared lr, weight decay and schedule) and Muon's own."""
    _target_: str = "sinklab.train.muon.muon"
    momentum: float = rule(0.95, number(ge=0, lt=1))
    nesterov: bool = True
    ns_steps: int = rule(5, integer(1))  # Newton-Schulz iterations
    adjust_lr_fn: AdjustLR = AdjustLR.match_rms_adamw


def register(cs) -> None:
    cs.store(group="optim", name="muon_schema", node=MuonConfig)


def hidden_matrices(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """(name, weight) of every linear layer inside the blocks: what Muon takes."""
    return [(f"{name}.weight", mod.weight) for name, mod in model.named_modules()
            if isinstance(mod, nn.Linear) and HIDDEN.search(name)]


class MuonWithAdamW(torch.optim.Optimizer):
    """Muon and AdamW stepped together: one optimizer to Lightning, the lr scheduler and checkpoints.

    `param_groups` are the parts' own group dicts (a scheduler's lr reaches both); `step` runs the closure once
    (forward, backward, clipping) and then each part; the state dict holds each part's."""

    def __init__(self, muon: Optional[torch.optim.Muon], adamw: Optional[torch.optim.AdamW]):
        self.parts = {name: part for name, part in (("muon", muon), ("adamw", adamw)) if part is not None}
        super().__init__([p for part in self.parts.values() for g in part.param_groups for p in g["params"]], {})
        self.param_groups = [g for part in self.parts.values() for g in part.param_groups]

    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for part in self.parts.values():
            part.step()
        return loss

    def state_dict(self) -> dict[str, Any]:
        return {name: part.state_dict() for name, part in self.parts.items()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if set(state_dict) != set(self.parts):
            raise UserError(f"the checkpoint's optimizer state has parts {sorted(state_dict)}, optim=muon needs "
                            f"{sorted(self.parts)}: resume a run with the optimizer it was trained with")
        for name, part in self.parts.items():
            part.load_state_dict(state_dict[name])


def muon(model: nn.Module, max_steps: int, *, lr: float, weight_decay: float, betas: list[float], eps: float,
         exclude_norm_and_embedding: bool, warmup_steps: int, schedule: str, min_lr_ratio: float, momentum: float,
         nesterov: bool, ns_steps: int, adjust_lr_fn: str, new_lr_scale: float = 1.0, freeze_pretrained: bool = False,
         freeze_pretrained_steps: Optional[int] = None, new_params: Sequence[str] = ()) -> dict[str, Any]:
    """Muon for the hidden matrices, AdamW for the rest, and their shared schedule (configure_optimizers' return);
    a retrofit's groups as `sinklab.train.optim.adamw`'s."""
    hidden = hidden_matrices(model)
    flat = [name for name, p in hidden if p.dim() != 2]
    if flat:
        raise UserError(f"optim=muon needs 2-D weight matrices, but {flat[0]} has shape "
                        f"{tuple(dict(hidden)[flat[0]].shape)} (trainer=fsdp flattens them); use trainer=ddp or "
                        "optim=adamw")
    taken = {id(p) for _, p in hidden}
    rest = [(name, p) for name, p in model.named_parameters() if id(p) not in taken]
    new_lr = lr * new_lr_scale
    groups_muon = retrofit_groups(hidden, new_params, new_lr, lambda named: [{"params": [p for _, p in named]}],
                                  "muon_")
    groups_adamw = retrofit_groups(rest, new_params, new_lr, lambda named: decay_groups(
        named, weight_decay, exclude_norm_and_embedding), "adamw_")
    part_muon = torch.optim.Muon(groups_muon, lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                                 ns_steps=ns_steps, adjust_lr_fn=AdjustLR(adjust_lr_fn).value) \
        if any(g["params"] for g in groups_muon) else None
    part_adamw = torch.optim.AdamW(groups_adamw, lr=lr, betas=tuple(betas), eps=eps, fused=None) \
        if any(g["params"] for g in groups_adamw) else None
    return with_schedule(MuonWithAdamW(part_muon, part_adamw), max_steps, warmup_steps, schedule, min_lr_ratio,
                         freeze_pretrained_steps)
