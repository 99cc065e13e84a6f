"""DeepSeek Sparse Attention (DeepSeek-V3.2, arXiv 2512.02556, Sec. 2.1): a lightning indexer scores every earlier
token for each query, and the main attention is a softmax over the top-k of them only.

    I_ts = sum_{j=1}^{H_I} w_tj ReLU(q^I_tj . k^I_s)

q^I: H_I heads of width d_I from the layer's input x (`dsa_index_heads`, `dsa_index_dim`), k^I: one head of width
d_I shared by them, w: H_I weights from x scaled by H_I^-1/2 d_I^-1/2 (as the reference code scales them). Each
query keeps the top `dsa_topk` tokens of I_t among the keys it sees (causally masked before the choice: no future
leak); nothing is forced unless `dsa_force_first` (the first text token and the learned sink tokens before it, within
the k). The main attention is the layer's softmax over the kept keys, so its rows sum to one.

Training (Sec. 2.1.1), through the model's auxiliary-loss slot (`aux_losses`, "dsa_kl", summed over the layers):
    L_I = KL(p_t || softmax(I_t)),  p_t the main attention summed over the heads and L1-normalised (detached),
over every key the query sees during the dense warm-up (the first `dsa_warmup_steps` training steps, in which the
main attention is dense) and over the kept keys afterwards. The step comes from training (`set_step`, called by the
LightningModule) and is saved with the weights, so a checkpoint measures in the phase it was trained in.

Decided here (the paper trains from a dense checkpoint, this framework from scratch):
- The indexer's input is detached in both phases, so the KL trains the indexer alone (the paper freezes everything
  else in the warm-up and detaches the input afterwards); the rest of the model trains on the language-model loss
  throughout, with dense attention in the warm-up. The top-k choice passes no gradient, so the indexer learns from
  the KL only.
- RoPE: q^I and k^I rotate their first min(d_I, head width) channels with the layer's RoPE (the reference rotates a
  part of each indexer head); no LayerNorm on k^I and no FP8 (the reference's, for its kernels).
- The KL is the mean over query rows (and batch) of sum_s p_ts (log p_ts - log softmax(I_t)_s); a K / KV bias slot
  is always kept by the main attention and is not part of the indexer's set.
- No fused kernel: the explicit row chunks (the indexer scores of a chunk are (B, H_I, R, n_keys)); the KL's chunks
  keep their indexer scores for backward.

Retrofit (`init_from=` a softmax model, the paper's own setting; conf/experiment/dsa_retrofit.yaml is its two-stage
recipe): the indexer starts fresh, and the model is the checkpoint's at step 0 (to float32 rounding: the explicit
softmax against the fused one) while the attention is dense, i.e. with a warm-up (dsa_warmup_steps > 0) or a top-k
that keeps every key (dsa_topk >= block_size + n_sink_tokens); sparse from step 0 it is not the identity.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch
from torch import nn

from ..masks import Layout
from ..registry import ATTENTION_OPS, ConfigError, check_positive_int
from .base import AttentionOp, masked_softmax


@ATTENTION_OPS.register("dsa")
class DeepSeekSparseAttention(AttentionOp):
    """Softmax over the top-k keys of a lightning indexer trained by a KL to the main attention."""

    sparse = True
    takes_selection = False  # its indexer selects the keys (model.sparsity=topk / moba would select on top)
    rows_sum_to_one = True
    rotated = ("q_index", "k_index")
    retrofit = "the identity while dense (dsa_warmup_steps > 0, or dsa_topk >= every key); the indexer fresh"

    @dataclasses.dataclass
    class Knobs:
        dsa_index_heads: int = 4  # H_I
        dsa_index_dim: int = 32  # d_I
        dsa_topk: int = 16  # keys each query keeps
        # dense training steps first (only the indexer learns from the KL); the contract also tries 0 (sparse at once)
        dsa_warmup_steps: int = dataclasses.field(default=100, metadata={"cases": (100, 0)})
        dsa_force_first: bool = False  # keep the first text token (and the sink tokens) within the top-k

    def __init__(self, cfg: Any):
        super().__init__(cfg)
        d, self.index_heads, self.index_dim = cfg.d_model, cfg.dsa_index_heads, cfg.dsa_index_dim
        self.index_q = nn.Linear(d, self.index_heads * self.index_dim, bias=False)
        self.index_k = nn.Linear(d, self.index_dim, bias=False)
        self.index_w = nn.Linear(d, self.index_heads, bias=False)
        self.w_scale = (self.index_heads * self.index_dim) ** -0.5
        self.topk, self.warmup = cfg.dsa_topk, cfg.dsa_warmup_steps
        self.n_first = cfg.n_sink_tokens + 1 if cfg.dsa_force_first else 0  # positions kept within the top-k
        self.set_step(0)

    @classmethod
    def validate(cls, cfg: Any) -> None:
        for key in ("dsa_index_heads", "dsa_index_dim"):
            check_positive_int(cfg, key)
        k, T = cfg.dsa_topk, cfg.block_size
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= T:
            raise ConfigError(f"model.dsa_topk={k!r} must be an integer in 1..model.block_size={T} (the keys each "
                              f"query keeps); allowed: 1..{T}")
        w = cfg.dsa_warmup_steps
        if not isinstance(w, int) or isinstance(w, bool) or w < 0:
            raise ConfigError(f"model.dsa_warmup_steps={w!r} must be an integer >= 0 (dense training steps first)")
        if cfg.dsa_force_first and k < cfg.n_sink_tokens + 1:
            raise ConfigError(f"model.dsa_topk={k} cannot hold the {cfg.n_sink_tokens + 1} positions "
                              f"model.dsa_force_first=true keeps (the first text token and model.n_sink_tokens="
                              f"{cfg.n_sink_tokens} sink tokens); allowed: >= {cfg.n_sink_tokens + 1}")

    @classmethod
    def retrofit_identity(cls, cfg: Any) -> bool:
        return cfg.dsa_warmup_steps > 0 or cfg.dsa_topk >= cfg.block_size + cfg.n_sink_tokens

    # ------------------------------------------------------------------------------------------- the step
    def set_step(self, step: int) -> None:
        """The training step about to run: dense attention while step < dsa_warmup_steps."""
        self.step = int(step)
        self.dense = self.step < self.warmup  # a bool, read in the forward (a compiled model recompiles once)

    def get_extra_state(self) -> dict[str, int]:
        return {"step": self.step}

    def set_extra_state(self, state: dict[str, int]) -> None:
        self.set_step(state["step"])

    # ------------------------------------------------------------------------------------------- the indexer
    def project(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """x (B, N, d) -> the indexer's queries (B, H_I, N, d_I), key (B, 1, N, d_I) and weights (B, H_I, N, 1), from
        x detached (the indexer learns from its KL alone)."""
        x = x.detach()
        B, N, _ = x.shape
        q = self.index_q(x).view(B, N, self.index_heads, self.index_dim).transpose(1, 2)  # (B, H_I, N, d_I)
        w = (self.index_w(x) * self.w_scale).transpose(1, 2)[..., None]  # (B, N, H_I) -> (B, H_I, N, 1)
        return {"q_index": q, "k_index": self.index_k(x)[:, None], "w_index": w}

    def index_scores(self, rows: torch.Tensor, extra: dict[str, torch.Tensor]) -> torch.Tensor:
        """I_ts of query rows at positions `rows` against every key position s: (B, R, P)."""
        q, w = extra["q_index"][:, :, rows], extra["w_index"][:, :, rows]  # (B, H_I, R, d_I), (B, H_I, R, 1)
        return (torch.relu(q @ extra["k_index"].transpose(-1, -2)) * w).sum(1)  # (B, H_I, R, P) -> (B, R, P)

    def attended(self, layout: Layout, rows: torch.Tensor, extra: Optional[dict[str, torch.Tensor]]) -> torch.Tensor:
        """The keys the main attention of query rows reads, bool, broadcasting against (B, H, R, n_keys): every key
        it sees in the warm-up; after it, the bias slots and the top-k of I_t among the positions it sees."""
        seen = layout.mask(rows)  # (R, n_keys), or (H, R, n_keys) with per-head masks
        if self.dense:
            return seen
        if not extra:
            raise ValueError("model.attn_op=dsa selects its keys with its indexer: pass the `extra` its layer recorded "
                             "at hook_extra (Attention.probs(q, k, layout, rows, extra))")
        S0, P = layout.n_slots, layout.n_key_pos
        sees = seen[..., S0:] if seen.dim() == 2 else seen[..., S0:].any(0)  # (R, P): seen by some head
        with torch.no_grad():  # the choice passes no gradient
            score = self.index_scores(rows, extra).masked_fill(~sees, float("-inf"))  # (B, R, P)
            first = torch.arange(P, device=score.device) < self.n_first
            score = score.masked_fill(sees & first, float("inf"))
            top = score.topk(min(self.topk, P), dim=-1).indices  # (B, R, k)
            kept = torch.zeros_like(score, dtype=torch.bool).scatter(-1, top, True) & sees
        if S0:
            kept = torch.cat([kept.new_ones(*kept.shape[:-1], S0), kept], dim=-1)  # (B, R, n_keys)
        return seen & kept[:, None]  # (B, 1 or H, R, n_keys)

    # ------------------------------------------------------------------------------------------- attention
    def probs(self, q: torch.Tensor, k: torch.Tensor, layout: Layout, rows: torch.Tensor, scale: float,
              extra: Optional[dict[str, torch.Tensor]] = None) -> torch.Tensor:
        """softmax(q . k * scale + bias) over the attended keys: (B, H, R, n_keys), zero elsewhere."""
        s = (q @ k.transpose(-1, -2)) * scale  # (B, H, R, n_keys)
        bias = layout.bias(rows)
        if bias is not None:
            s = s + bias.to(s.dtype)
        return masked_softmax(s, self.attended(layout, rows, extra))

    def aux_losses(self, q: torch.Tensor, k: torch.Tensor, layout: Layout, scale: float,
                   extra: dict[str, torch.Tensor], chunk: int) -> dict[str, torch.Tensor]:
        """{"dsa_kl": KL(p_t || softmax(I_t))} over the attended keys, the mean over query rows and batch; p_t is
        detached, the gradient reaches the indexer only."""
        B, H, S0 = q.shape[0], q.shape[1], layout.n_slots
        total = q.new_zeros(())
        for r0 in range(0, layout.n_pos, chunk):
            rows = layout.rows(r0, r0 + chunk)
            with torch.no_grad():
                attended = self.attended(layout, rows, extra)
                p = self.probs(q[:, :, r0:r0 + chunk], k, layout, rows, scale, extra)[..., S0:].sum(1)  # (B, R, P)
                p = p / p.sum(-1, keepdim=True).clamp_min(torch.finfo(p.dtype).tiny)
                keys = torch.broadcast_to(attended, (B, H, *attended.shape[-2:])).any(1)[..., S0:]  # (B, R, P)
            log_i = masked_log_softmax(self.index_scores(rows, extra), keys)  # (B, R, P)
            total = total + (torch.xlogy(p, p) - p * log_i).sum()
        return {"dsa_kl": total / (B * layout.n_pos)}


def masked_log_softmax(s: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """log softmax of s over the entries `keys`, zero elsewhere (and in a row without keys, gradient included)."""
    s = s.masked_fill(~keys, float("-inf")).masked_fill(~keys.any(-1, keepdim=True), 0.0)
    return torch.log_softmax(s, dim=-1).masked_fill(~keys, 0.0)
