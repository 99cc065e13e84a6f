"""Gates in the attention block (`model.gate`), after Qiu et al. 2025, "Gated Attention for Large Language Models"
(arXiv 2505.06708, Table 1): Y' = Y * act(X W_theta), X the attention block's input after its norm (the same normed
hidden states the query projection reads, as in the reference code), Y the tensor at one of five positions
(`model.gate_position`, the classes `G1` .. `G5` below; G1 is the default and the paper's best).

- Granularity (`model.gate`): `headwise`, one score per head and token; `elementwise`, one per channel.
- Head-specific or head-shared (`model.gate_shared`). Head-specific (default): each head has its own scores,
  W_theta maps d -> heads x width. Head-shared: one set of scores per token, W_theta maps d -> width, and every head
  is multiplied by the same scores: one scalar per token (headwise) or one head_dim vector per token (elementwise).
- Activation (`model.gate_act`): `sigmoid` (default), `silu`, or `scaled_sigmoid`, 2 sigmoid(z) in (0, 2): exactly 1
  at z = 0, so a gate with zero weights passes its tensor unchanged (the identity a retrofit starts from; sigmoid and
  SiLU give 1/2 and 0 there).

What the paper leaves open, decided here:
- Grouped-query attention: G2 and G3 gate the value / key projection's output, which has `n_kv_head` heads, so a
  gate score belongs to a kv head and is shared by that head's group of query heads (the heads are repeated after the
  gate). G1 and G4 have `n_head` heads.
- RoPE: G3 and G4 gate the projection's output before RoPE (the paper gates Y = X W_k, X W_q). A headwise score
  commutes with RoPE (a rotation within each head); an elementwise one does not.
- G5 gates the block's d_model output channels, where there are no heads: only an elementwise, head-specific gate
  applies there (headwise or head-shared is refused).
- A K / KV bias slot is prepended after the gate (never gated); at G1 the gate multiplies after a V bias is added.

Value-state gate (`model.gate=vga`, Bu et al. 2025, "Value-State Gated Attention for Mitigating Extreme-Token
Phenomena in Transformers", arXiv 2510.09017): the same G1 position, but the scores come from the value states instead
of the block's input: Y' = Y * sigmoid(V W_g), V = X W_v the value projection's output of the same token. The paper
states the gate as a sigmoid of a learned projection of the value states that multiplies the attention output (so a
head can output nothing without draining its sink token's value). What it leaves open, decided here:
- which values: the query token's own value state (row i of V gates row i of the output, as the element-wise product
  of two (T, d) matrices reads), before a KV bias slot is added and before the kv heads are repeated (GQA);
- W_g's shape: one matrix over all value heads concatenated (n_kv_head * hd -> n_head * hd, no bias), one score per
  channel (elementwise), as Qwen's G1 maps the whole input; initialised N(0, init_std) like every matrix (scores ~0.5);
- no other gate at the same time (one `model.gate`), and the activation is the paper's sigmoid.
The value states reach the gate through its G2 call (`at(G2, x, v)` passes v unchanged and keeps it for the G1 call
of the same forward), so the attention module needs no second path.

Recording the gate values: every gate's activation is its submodule `gate_act` (`blocks.<i>.attn.gate_proj.gate_act`,
an nn.Sigmoid or nn.SiLU). A forward hook on it receives the scores act(X W_theta) of shape (B, S + T, width), before
they are arranged per head; `sinklab.metrics.gates.record_gates` registers these hooks and `gate_stats` summarises.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .registry import GATES, Component, ConfigError


class GatePosition:
    """Where a gate multiplies: a tensor (B, heads, N, channels) with `heads(cfg)` heads of `channels(cfg)` channels;
    a gate's scores (B, N, gate heads * width) are arranged to broadcast over it."""

    @staticmethod
    def heads(cfg: Any) -> int:
        return cfg.n_head

    @staticmethod
    def channels(cfg: Any) -> int:
        return cfg.hd

    @classmethod
    def validate(cls, cfg: Any) -> None:
        """Refuse gate settings this position cannot take."""

    @staticmethod
    def arrange(g: torch.Tensor, heads: int, width: int) -> torch.Tensor:
        # (B, N, heads * width) -> (B, heads, N, width)
        return g.view(g.shape[0], g.shape[1], heads, width).transpose(1, 2)


class G1(GatePosition):
    """After SDPA: each head's output (B, n_head, N, hd), before the output projection."""


class G2(GatePosition):
    """After the value projection: (B, n_kv_head, N, hd), before the kv heads are repeated for their query heads."""

    @staticmethod
    def heads(cfg: Any) -> int:
        return cfg.kv_heads


class G3(G2):
    """After the key projection, before RoPE: (B, n_kv_head, N, hd)."""


class G4(G1):
    """After the query projection, before RoPE: (B, n_head, N, hd)."""


class G5(GatePosition):
    """After the output projection: the block's output (B, N, d_model), without heads."""

    @staticmethod
    def heads(cfg: Any) -> int:
        return 1

    @staticmethod
    def channels(cfg: Any) -> int:
        return cfg.d_model

    @classmethod
    def validate(cls, cfg: Any) -> None:
        if cfg.gate == "headwise":
            raise ConfigError("model.gate=headwise has no heads to gate at model.gate_position=G5 (after the output "
                              "projection); allowed with G5: model.gate=elementwise")
        if cfg.gate_shared:
            raise ConfigError("model.gate_shared=true has no heads to share at model.gate_position=G5 (after the "
                              "output projection); allowed with G5: model.gate_shared=false")

    @staticmethod
    def arrange(g: torch.Tensor, heads: int, width: int) -> torch.Tensor:
        return g  # (B, N, d_model), as the output


class ScaledSigmoid(nn.Module):
    """2 sigmoid(z), in (0, 2): exactly 1 at z = 0 (sigmoid(0) = 1/2 is exact in floating point)."""

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return 2 * torch.sigmoid(z)


GATE_POSITIONS: dict[str, type[GatePosition]] = {"G1": G1, "G2": G2, "G3": G3, "G4": G4, "G5": G5}
ACTIVATIONS: dict[str, type[nn.Module]] = {"sigmoid": nn.Sigmoid, "silu": nn.SiLU, "scaled_sigmoid": ScaledSigmoid}


@GATES.register("none")
class NoGate(Component, nn.Module):
    """No gate: every tensor of the attention block passes unchanged."""

    def __init__(self, cfg: Any):
        super().__init__()

    llama = True

    def at(self, position: type[GatePosition], x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return t


@GATES.register("headwise")
class HeadwiseGate(Component, nn.Linear):
    """One gate score per head and token: t * act(x W_theta) at model.gate_position (Qwen's G1 .. G5).

    x (B, N, d) -> scores (B, heads, N, 1), heads those of the gated tensor t, or 1 when head-shared.

    Retrofit: with gate_act=scaled_sigmoid it starts as the identity, exactly: W_theta zero, so every score is
    2 sigmoid(0) = 1, and W_theta's gradient there is not zero (2 sigmoid'(0) = 1/2 per unit of x t). With sigmoid or
    silu no zero-input score is 1 (1/2, 0): W_theta keeps its fresh N(0, init_std) init and the layer's output changes
    at once. The gated-attention authors (arXiv 2505.06708) saw a random start spike the loss and an identity-like one
    leave the gate unused; whether this start is used is for the runs to show."""

    retrofit = "gate_act=scaled_sigmoid: the identity exactly, W_theta zero (2 sigmoid(0) = 1); else W_theta fresh"

    @dataclasses.dataclass
    class Knobs:
        gate_position: str = dataclasses.field(default="G1", metadata={"choices": tuple(GATE_POSITIONS)})
        gate_shared: bool = False  # one set of scores for all heads (head-shared) instead of one per head
        gate_act: str = dataclasses.field(default="sigmoid", metadata={"choices": tuple(ACTIVATIONS)})

    def __init__(self, cfg: Any):
        position = GATE_POSITIONS[cfg.gate_position]
        heads, width = 1 if cfg.gate_shared else position.heads(cfg), self.width(cfg, position)
        nn.Linear.__init__(self, cfg.d_model, heads * width, bias=False)
        self.position, self.heads, self.per_head = position, heads, width
        self.gate_act = ACTIVATIONS[cfg.gate_act]()  # a named submodule: a forward hook records the scores

    @classmethod
    def validate(cls, cfg: Any) -> None:
        GATE_POSITIONS[cfg.gate_position].validate(cfg)

    @staticmethod
    def width(cfg: Any, position: type[GatePosition]) -> int:
        """Scores per gate head."""
        return 1

    @classmethod
    def retrofit_identity(cls, cfg: Any) -> bool:
        return cfg.gate_act == "scaled_sigmoid"

    def retrofit_init(self, parent: nn.Module) -> None:
        if isinstance(self.gate_act, ScaledSigmoid):
            nn.init.zeros_(self.weight)

    def at(self, position: type[GatePosition], x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """The attention block's tensor t at `position`: gated if this gate sits there, else unchanged."""
        return self(x, t) if position is self.position else t

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """x (B, N, d) the block's normed input, t the tensor at the gate's position (see `GatePosition`)."""
        return t * self.position.arrange(self.gate_act(F.linear(x, self.weight)), self.heads, self.per_head)


@GATES.register("elementwise")
class ElementwiseGate(HeadwiseGate):
    """One gate score per channel and token: t * act(x W_theta) at model.gate_position (Qwen's G1 .. G5).

    x (B, N, d) -> scores (B, heads, N, hd), or (B, N, d_model) at G5."""

    @staticmethod
    def width(cfg: Any, position: type[GatePosition]) -> int:
        return position.channels(cfg)


@GATES.register("vga")
class ValueStateGate(Component, nn.Linear):
    """Value-state gate (VGA, arXiv 2510.09017): Y * sigmoid(V W_g) after SDPA (G1), V the token's value states.

    v (B, n_kv_head, N, hd) -> scores (B, n_head, N, hd), one per channel of each head's output."""

    retrofit = "not the identity (a sigmoid is 1/2 at zero input): W_g fresh"

    def __init__(self, cfg: Any):
        nn.Linear.__init__(self, cfg.kv_heads * cfg.hd, cfg.n_head * cfg.hd, bias=False)
        self.heads, self.per_head = cfg.n_head, cfg.hd
        self.gate_act = nn.Sigmoid()  # a named submodule: a forward hook records the scores
        self.values: torch.Tensor | None = None  # this forward's value states, from the G2 call to the G1 call

    def at(self, position: type[GatePosition], x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """G2: keep the value states t (B, n_kv_head, N, hd), unchanged; G1: gate the heads' output t with them."""
        if position is G2:
            self.values = t
        elif position is G1:
            values, self.values = self.values, None
            return self(values.transpose(1, 2).flatten(2), t)  # (B, n_kv_head, N, hd) -> (B, N, n_kv_head * hd)
        return t

    def forward(self, v: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """v (B, N, n_kv_head * hd) the value states, t the heads' output at G1. Called as a module, so that hooks
        on the linear layer (quantization's calibration) see its input."""
        return t * G1.arrange(self.gate_act(F.linear(v, self.weight)), self.heads, self.per_head)
