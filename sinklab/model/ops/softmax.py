"""softmax(alpha q.k / sqrt(d_h) + position bias), with an optional extra logit that absorbs attention: a learned
one per head (`model.sink_logit=learned`, gpt-oss style) or a zero (`sink_logit=zero`, softmax-off-by-one).

Retrofit (`sink_logit` added to a trained softmax model): a learned sink logit starts at RETROFIT_SINK_LOGIT = -30,
where its weight e^(-30 - m) / Z (m a row's largest logit, Z >= 1) is below float32's resolution of 1 (2^-24 =
e^-16.6) in every row whose largest logit exceeds -13.4, so the rows are those of plain softmax to float32 rounding.
Not -inf: a parameter that is not finite stops training (`TrainingDiverged`), and its gradient would be 0 for good.
Its gradient at -30 is that weight times the row's output difference: the logit starts unused and is learned only
where the rows' logits fall towards it (or with a larger `optim.new_lr_scale`). A zero extra logit
(`sink_logit=zero`) has no parameter and changes every row (it takes e^-m / (Z + e^-m)): not the identity."""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch

from ..backends import AttentionBackend
from ..masks import Layout
from ..registry import ATTENTION_OPS
from .base import AttentionOp


@ATTENTION_OPS.register("softmax")
class Softmax(AttentionOp):
    """softmax over the visible keys; fused through the backend (sinklab/model/backends.py)."""

    @dataclasses.dataclass
    class Knobs:
        sink_logit: str = dataclasses.field(default="none", metadata={"choices": ("none", "learned", "zero")})

    @classmethod
    def resolve(cls, cfg: Any) -> type:
        return {"none": Softmax, "learned": LearnedSinkLogitSoftmax, "zero": OffByOneSoftmax}[cfg.sink_logit]

    rows_sum_to_one = llama = True

    @classmethod
    def fusable(cls, cfg: Any) -> bool:
        return cfg.backend != "explicit"

    def fused(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: Layout, scale: float,
              backend: AttentionBackend) -> Optional[torch.Tensor]:
        return backend.softmax(q, k, v, layout, scale)

    def normalise(self, s: torch.Tensor, seen: torch.Tensor) -> torch.Tensor:
        return torch.softmax(s.masked_fill(~seen, float("-inf")), dim=-1)


class OffByOneSoftmax(Softmax):
    """softmax over the keys and one extra zero logit, dropped from the map: rows sum to less than one."""

    rows_sum_to_one = llama = False
    retrofit = "not the identity: the zero logit takes a share of every row"

    @classmethod
    def llama_mismatch(cls, cfg: Any) -> Optional[str]:
        return f"model.sink_logit={cfg.sink_logit} (LLaMA needs none)"

    @classmethod
    def fusable(cls, cfg: Any) -> bool:
        return cfg.backend == "flex"  # sdpa has no extra logit

    def fused(self, q, k, v, layout, scale, backend):
        return backend.softmax(q, k, v, layout, scale, sink=self.extra_logit(q))

    def extra_logit(self, s: torch.Tensor) -> torch.Tensor:
        return torch.zeros(self.n_head, device=s.device)

    def normalise(self, s: torch.Tensor, seen: torch.Tensor) -> torch.Tensor:
        s = s.masked_fill(~seen, float("-inf"))
        extra = self.extra_logit(s).to(s.dtype)[None, :, None, None].expand(*s.shape[:-1], 1)
        return torch.softmax(torch.cat([s, extra], dim=-1), dim=-1)[..., :-1]


RETROFIT_SINK_LOGIT = -30.0  # a retrofit's start: a weight below float32 resolution (module docstring)


class LearnedSinkLogitSoftmax(OffByOneSoftmax):
    """The extra logit is learned, one per head."""

    retrofit = "the identity to float32 rounding: the logit starts at -30 (weight < 2^-24 where a row's max > -13.4)"

    def __init__(self, cfg: Any):
        super().__init__(cfg)
        self.sink_logit = torch.nn.Parameter(torch.zeros(cfg.n_head))

    @classmethod
    def retrofit_identity(cls, cfg: Any) -> bool:
        return True

    def retrofit_init(self, parent: torch.nn.Module) -> None:
        torch.nn.init.constant_(self.sink_logit, RETROFIT_SINK_LOGIT)

    def extra_logit(self, s: torch.Tensor) -> torch.Tensor:
        return self.sink_logit
