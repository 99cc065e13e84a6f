"""Linear-attention kernels: phi(q) phi(k)^T / sqrt(d_h) on the visible keys, with phi = elu + 1, the identity or a
per-layer MLP (`model.kernel_map`), rows optionally normalised. No logits, so no ALiBi / relative bias.

With `model.attn_memory=linear` and a plain causal mask, the output comes from the causal linear-attention form
(Katharopoulos et al. 2020, "Transformers are RNNs": o_i = phi(q_i)^T sum_{j<=i} phi(k_j) v_j^T, its row sum
phi(q_i)^T sum_{j<=i} phi(k_j)) computed chunkwise as flash-linear-attention does (Yang et al. 2024, GLA): a causal
(C, C) block inside each chunk of C queries, the running sums for the keys before it. No map is built: memory and
time are linear in T. A row's division by its sum is the same division of the output (A / z) @ v = (A @ v) / z.
Bias slots and a KV cache's earlier keys are seen by every query: they start the running sums."""
from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..masks import Layout
from ..registry import ATTENTION_OPS
from .base import NormalisableOp


class KernelMLP(nn.Module):
    """Per-layer feature map Linear - ReLU - Linear shared by q and k."""

    def __init__(self, hd: int):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(hd, hd), nn.ReLU(), nn.Linear(hd, hd))

    def init_parameters(self, std: float, bias_std: float) -> None:
        """Weights N(0, std), biases zero, in registration order."""
        for name, p in self.named_parameters():
            if name.endswith("weight"):
                nn.init.normal_(p, std=std)
            else:
                nn.init.zeros_(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


@ATTENTION_OPS.register("kernel")
class KernelAttention(NormalisableOp):
    """phi(q) phi(k)^T on the visible keys (linear attention), phi chosen by kernel_map."""

    has_logits = False

    @dataclasses.dataclass
    class Knobs(NormalisableOp.Knobs):
        kernel_map: str = dataclasses.field(default="elu", metadata={"choices": ("identity", "elu", "mlp")})

    @classmethod
    def resolve(cls, cfg: Any) -> type:
        return {"identity": KernelAttention, "elu": EluKernel, "mlp": MLPKernel}[cfg.kernel_map]

    @classmethod
    def row_normalised(cls, cfg: Any) -> bool:
        return False  # kernel maps can be negative: the metric also scores them renormalised

    def feature_map(self, x: torch.Tensor) -> torch.Tensor:
        """The identity (this class); the variants below map q and k first."""
        return x

    @classmethod
    def fusable(cls, cfg: Any) -> bool:
        return cfg.memory == "linear" and cfg.backend != "explicit" and not cfg.prefix_len and cfg.window is None

    def divisor(self, z: torch.Tensor) -> torch.Tensor:
        """Row sums z -> what a normalised row is divided by. Identity and MLP features can sum to ~0: only rows
        whose |sum| exceeds 1 are divided."""
        return z.abs().clamp(min=1.0)

    takes_selection = False  # its own probs: no per-key logits for a sparsity to select from

    def probs(self, q: torch.Tensor, k: torch.Tensor, layout: Layout, rows: torch.Tensor,
              scale: float) -> torch.Tensor:
        seen = layout.mask(rows)
        a = (self.feature_map(q) @ self.feature_map(k).transpose(-1, -2)) * scale * seen
        return a / self.divisor(a.sum(-1, keepdim=True)) if self.normalize else a

    def fused(self, q, k, v, layout, scale, backend):
        """The causal linear form (module docstring) where the mask is plain causal, else None."""
        if not layout.plain_causal:
            return None
        o, z = causal_linear_attention(self.feature_map(q), self.feature_map(k), v, layout.n_slots + layout.start)
        o, z = o * scale, z * scale
        return o / self.divisor(z) if self.normalize else o


def causal_linear_attention(fq: torch.Tensor, fk: torch.Tensor, v: torch.Tensor, n_first: int,
                            chunk: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """sum_j (fq_i . fk_j) v_j and sum_j fq_i . fk_j over the keys query i sees: the first `n_first` keys (bias slots,
    cached positions) and, causally, the rest (query i sees key n_first + j for j <= i).
    fq (B, H, N, f), fk (B, H, n_first + N, f), v (B, H, n_first + N, hd) -> (B, H, N, hd), (B, H, N, 1)."""
    state = fk[:, :, :n_first].transpose(-1, -2) @ v[:, :, :n_first]  # (B, H, f, hd): sum_j fk_j v_j^T so far
    total = fk[:, :, :n_first].sum(2, keepdim=True)  # (B, H, 1, f): sum_j fk_j so far
    outs, sums = [], []
    for c0 in range(0, fq.shape[2], chunk):
        qc = fq[:, :, c0:c0 + chunk]  # (B, H, C, f)
        kc, vc = fk[:, :, n_first + c0:n_first + c0 + chunk], v[:, :, n_first + c0:n_first + c0 + chunk]
        a = (qc @ kc.transpose(-1, -2)).tril()  # (B, H, C, C): the chunk's own keys, causally
        outs.append(a @ vc + qc @ state)
        sums.append(a.sum(-1, keepdim=True) + qc @ total.transpose(-1, -2))
        state = state + kc.transpose(-1, -2) @ vc
        total = total + kc.sum(2, keepdim=True)
    return torch.cat(outs, dim=2), torch.cat(sums, dim=2)


class EluKernel(KernelAttention):
    """phi = elu + 1: positive features, so rows are divided by their sum."""

    def feature_map(self, x: torch.Tensor) -> torch.Tensor:
        return F.elu(x) + 1.0

    def divisor(self, z: torch.Tensor) -> torch.Tensor:
        return z + 1e-8


class MLPKernel(KernelAttention):
    """phi = a per-layer MLP shared by q and k."""

    def __init__(self, cfg: Any):
        super().__init__(cfg)
        self.phi = KernelMLP(cfg.hd)

    def feature_map(self, x: torch.Tensor) -> torch.Tensor:
        return self.phi(x)
