"""Linear recurrent layer mixers: Gated DeltaNet and a plain gated linear attention, as attention ops, so that a
layer pattern mixes them with any softmax variant (`model.layer_pattern=GDDD model.pattern_ops=D:gated_deltanet`).

Gated DeltaNet (Yang, Kautz, Hatamizadeh 2024, "Gated Delta Networks", arXiv 2412.06464): each head keeps a matrix
memory S (d_k x d_v) that every token decays and corrects by the delta rule,

    S_t = alpha_t (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,        o_t = S_t^T q_t / sqrt(d_k),

beta_t = sigmoid(b(x_t)) the writing strength, alpha_t = exp(-A softplus(a(x_t) + dt_bias)) the decay (A > 0 per
head, Mamba-2's parametrisation), q, k, v after a short causal depthwise convolution (kernel `model.conv_size`) and
SiLU, q and k L2-normalised; each head's output goes through an RMSNorm gated by SiLU(g(x_t)).
`gated_linear` is the same layer without the delta rule (S_t = alpha_t S_{t-1} + k_t v_t^T: a gated linear
attention with one decay per head, Mamba-2's SSD without its skip term): the second family of the interface.

The layer computes q, k, v with its own projections; the op takes them through `prepare` (the convolutions and the
norm, before the hook points, so that a measurement records what the recurrence reads), reads its gates from the
layer's input (`project`) and computes

- training and prefill: the chunked form (`chunked_gated_delta`, chunks of `model.linear_chunk`): inside a chunk the
  delta rule's corrections are one triangular solve (the UT transform, the paper's WY representation), across
  chunks the memory is carried; memory and time linear in T;
- decoding with a KV cache: the recurrent form (`recurrent_gated_delta`), one token at a time from the memory the
  cache holds for the layer (`KVCache.recurrent_state`): the conv's last inputs and S, never evicted, so decoding
  costs the same at any context;
- for the metrics: the effective attention (`effective_attention`), the matrix M with o_t = sum_s M[t, s] v_s that
  the recurrence applies to the values, exactly (O(T^2 d) per head, for short probes). Its rows are not normalised
  (`row_normalised` false): the sink metric reports Sink* beside Sink.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar, Optional

import torch
import torch.nn.functional as F
from torch import nn

from sinklab.errors import UserError

from ..masks import Layout
from ..registry import ATTENTION_OPS, ConfigError, check_positive_int
from .base import AttentionOp


def l2_normalise(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(|x|^2 + eps) over the last dimension."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def chunked_gated_delta(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, decay: torch.Tensor,
                        beta: Optional[torch.Tensor], chunk: int = 64,
                        state: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule in chunks. q, k (B, H, T, dk) (q already scaled), v (B, H, T, dv), decay = log alpha
    (B, H, T) <= 0, beta (B, H, T) or None (no delta rule: gated linear attention), state S (B, H, dk, dv) or None
    (zeros) -> o (B, H, T, dv), the final S.

    Inside a chunk, with G_t = alpha_1 .. alpha_t (from the chunk's start) and S_0 the memory before it, the delta
    rule writes u_t = beta_t (v_t - alpha_t S_{t-1}^T k_t), i.e. (I + L) U = beta V - (beta G K) S_0 with
    L[t, j] = beta_t (G_t / G_j) k_t . k_j for j < t: one unit lower-triangular solve per chunk (the UT transform)
    gives U = U~ - W S_0. Then o_t = G_t S_0^T q_t + sum_{j <= t} (G_t / G_j) (q_t . k_j) u_j and the memory after
    the chunk is G_C S_0 + sum_j (G_C / G_j) k_j u_j^T."""
    B, H, T, dk = k.shape
    dv = v.shape[-1]
    pad = (-T) % chunk  # padded positions: k = 0 and alpha = 1 leave the memory as it is
    if pad:
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        decay = F.pad(decay, (0, pad))
        beta = F.pad(beta, (0, pad)) if beta is not None else None
    n = (T + pad) // chunk
    # (B, H, n * C, d) -> (B, H, n, C, d): the sequence cut into n chunks of C
    q, k, v = (t.reshape(B, H, n, chunk, t.shape[-1]) for t in (q, k, v))
    g = decay.reshape(B, H, n, chunk).cumsum(-1)  # (B, H, n, C): log G_t inside each chunk
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    # (B, H, n, C, C): G_t / G_j where j <= t, 0 above the diagonal (masked in log space: no overflow)
    pair = (g[..., :, None] - g[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    if beta is not None:
        b = beta.reshape(B, H, n, chunk, 1)
        lower = ((b * k) @ k.transpose(-1, -2) * pair).tril(-1)  # (B, H, n, C, C): L, strictly lower
        system = lower + torch.eye(chunk, dtype=q.dtype, device=q.device)  # I + L
        u = torch.linalg.solve_triangular(system, b * v, upper=False, unitriangular=True)  # (B, H, n, C, dv): U~
        w = torch.linalg.solve_triangular(system, b * g.exp()[..., None] * k, upper=False,
                                          unitriangular=True)  # (B, H, n, C, dk): W
    else:
        u, w = v, None
    intra = (q @ k.transpose(-1, -2)) * pair  # (B, H, n, C, C): (G_t / G_j) q_t . k_j, j <= t
    q_in = q * g.exp()[..., None]  # (B, H, n, C, dk): G_t q_t, what reads the memory before the chunk
    k_out = k * (g[..., -1:] - g).exp()[..., None]  # (B, H, n, C, dk): (G_C / G_j) k_j, what the chunk writes
    S = state if state is not None else q.new_zeros(B, H, dk, dv)
    outs = []
    for i in range(n):
        ui = u[:, :, i] - w[:, :, i] @ S if w is not None else u[:, :, i]  # (B, H, C, dv): the values written
        outs.append(q_in[:, :, i] @ S + intra[:, :, i] @ ui)  # (B, H, C, dv)
        S = S * g[:, :, i, -1].exp()[..., None, None] + k_out[:, :, i].transpose(-1, -2) @ ui  # (B, H, dk, dv)
    return torch.cat(outs, dim=2)[:, :, :T], S


def recurrent_gated_delta(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, decay: torch.Tensor,
                          beta: Optional[torch.Tensor],
                          state: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The same recurrence one token at a time (decoding; the reference of the chunked form); arguments and results
    as `chunked_gated_delta`'s."""
    B, H, T, dk = k.shape
    S = state if state is not None else q.new_zeros(B, H, dk, v.shape[-1])  # (B, H, dk, dv)
    outs = []
    for t in range(T):
        S = S * decay[:, :, t].exp()[..., None, None]
        kt = k[:, :, t]  # (B, H, dk)
        if beta is not None:  # the delta rule: write the error of what the memory predicts for k_t
            write = beta[:, :, t, None] * (v[:, :, t] - (kt[..., None] * S).sum(-2))  # (B, H, dv)
        else:
            write = v[:, :, t]
        S = S + kt[..., None] * write[..., None, :]
        outs.append((q[:, :, t, :, None] * S).sum(-2))  # (B, H, dv): S^T q_t
    return torch.stack(outs, dim=2), S


def effective_attention(q: torch.Tensor, k: torch.Tensor, decay: torch.Tensor, beta: Optional[torch.Tensor],
                        rows: torch.Tensor) -> torch.Tensor:
    """The matrix the recurrence applies to the values, for query rows at positions `rows` (R,): q (B, H, R, dk)
    (scaled), k (B, H, P, dk), decay, beta (B, H, P) -> M (B, H, R, P) with o_t = sum_s M[t, s] v_s exactly (from a
    zero memory at position 0). M[t, s] = beta_s k_s^T A_{s+1} .. A_t q_t with A_r = alpha_r (I - beta_r k_r k_r^T)
    (alpha_r I without the delta rule, and beta = 1): built from s = last row down to 0, each row's vector
    A_{s+1} .. A_t q_t carried (zero until s reaches its own position, so M is zero above the diagonal)."""
    P = k.shape[2]
    last = int(rows.max()) + 1 if rows.numel() else 0
    carried = torch.zeros_like(q)  # (B, H, R, dk)
    cols = []
    for s in range(last - 1, -1, -1):
        carried = torch.where((rows == s)[:, None], q, carried)  # row t starts at s = t with q_t
        ks = k[:, :, s, None]  # (B, H, 1, dk)
        dot = (carried * ks).sum(-1)  # (B, H, R): k_s . carried
        if beta is not None:
            bs = beta[:, :, s, None]  # (B, H, 1)
            cols.append(bs * dot)
            carried = carried - (bs * dot)[..., None] * ks  # (I - beta_s k_s k_s^T) carried
        else:
            cols.append(dot)
        carried = carried * decay[:, :, s, None, None].exp()  # alpha_s
    M = torch.stack(cols[::-1], dim=-1) if cols else q.new_zeros(*q.shape[:3], 0)  # (B, H, R, last)
    return F.pad(M, (0, P - last))


class RecurrentOp(AttentionOp):
    """A linear recurrent mixer (module docstring): its short convolutions, gates, output norm and the three forms;
    a subclass says whether it writes by the delta rule (`delta`)."""

    delta: ClassVar[bool] = True
    recurrent = True  # the layer hands it q, k, v of the new positions only, and its memory lives in the KV cache
    takes_rope = False  # position comes from the convolution and the decay
    has_logits = False
    takes_selection = False

    @dataclasses.dataclass
    class Knobs:
        linear_chunk: int = 64  # positions per chunk of the chunked (training) form
        conv_size: int = 4  # kernel of the short causal convolutions on q, k and v (1: a per-channel scale)

    def __init__(self, cfg: Any):
        super().__init__(cfg)
        H, Hkv, hd, d = cfg.n_head, cfg.kv_heads, cfg.hd, cfg.d_model
        self.hd, self.chunk, self.conv_size, self.layer = hd, cfg.linear_chunk, cfg.conv_size, 0
        # depthwise convolutions, one kernel per channel: (channels, conv_size)
        self.q_conv = nn.Parameter(torch.empty(H * hd, cfg.conv_size))
        self.k_conv = nn.Parameter(torch.empty(Hkv * hd, cfg.conv_size))
        self.v_conv = nn.Parameter(torch.empty(Hkv * hd, cfg.conv_size))
        self.a_proj = nn.Linear(d, H, bias=False)  # the decay's input
        self.b_proj = nn.Linear(d, H, bias=False) if self.delta else None  # beta's
        self.g_proj = nn.Linear(d, H * hd, bias=False)  # the output gate's
        self.A_log = nn.Parameter(torch.empty(H))
        self.dt_bias = nn.Parameter(torch.empty(H))
        self.norm_weight = nn.Parameter(torch.empty(hd))
        self.init_parameters(cfg.std, 0.0)

    def init_parameters(self, std: float, bias_std: float) -> None:
        """Projections N(0, std); convolutions U(-1/sqrt(K), 1/sqrt(K)) (torch's default); A ~ U(1, 16) and dt ~
        log-uniform in [1e-3, 1e-1] with dt_bias = softplus^-1(dt) (Mamba-2's, as the paper); norm weight one."""
        for conv in (self.q_conv, self.k_conv, self.v_conv):
            nn.init.uniform_(conv, -1 / math.sqrt(self.conv_size), 1 / math.sqrt(self.conv_size))
        for proj in (self.a_proj, self.b_proj, self.g_proj):
            if proj is not None:
                nn.init.normal_(proj.weight, std=std)
        with torch.no_grad():
            self.A_log.copy_(torch.empty_like(self.A_log).uniform_(1, 16).log())
            dt = torch.empty_like(self.dt_bias).uniform_(math.log(1e-3), math.log(1e-1)).exp()
            self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))
        nn.init.ones_(self.norm_weight)

    @classmethod
    def validate(cls, cfg: Any) -> None:
        for key in ("linear_chunk", "conv_size"):
            check_positive_int(cfg, key)
        refused = [(key, value, allowed) for key, value, allowed in (
            ("window", cfg.window, "null (a recurrent layer sees the whole past)"),
            ("prefix_len", cfg.prefix_len, "0 (it is causal only)"),
            ("attn_bias", cfg.attn_bias, "none"),
            ("sparsity", cfg.sparsity, "none"),
            ("gate", cfg.gate, "none (it has its own SiLU output gate; in a layer pattern model.gate gates the softmax "
                               "layers only)"),
        ) if value not in (None, 0, "none")]
        if refused:
            key, value, allowed = refused[0]
            raise ConfigError(f"model.{key}={value} does not apply to model.attn_op={cls.name}; allowed: {allowed}")

    @classmethod
    def row_normalised(cls, cfg: Any) -> bool:
        return False

    @classmethod
    def fusable(cls, cfg: Any) -> bool:
        return True  # the chunked form

    def bind_layer(self, layer: int) -> None:
        self.layer = layer  # its memory's place in a KV cache

    # ------------------------------------------------------------------ what the layer calls
    def prepare(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                cache: Optional[Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The projections q (B, H, N, hd), k, v (B, Hkv, N, hd) -> what the recurrence reads: each through its
        short causal convolution and SiLU, q and k L2-normalised. A KV cache holds the last conv_size - 1 inputs."""
        state = cache.recurrent_state(self.layer, q.shape[2]) if cache is not None else None
        q = l2_normalise(self.convolve(q, self.q_conv, state, "q"))
        k = l2_normalise(self.convolve(k, self.k_conv, state, "k"))
        return q, k, self.convolve(v, self.v_conv, state, "v")

    def convolve(self, x: torch.Tensor, weight: torch.Tensor, state: Optional[dict], name: str) -> torch.Tensor:
        """SiLU of the causal depthwise convolution of x (B, h, N, hd) over time, after the inputs a cache holds."""
        B, h, N, hd = x.shape
        x = x.transpose(2, 3).reshape(B, h * hd, N)  # (B, h, N, hd) -> (B, h * hd, N): channels, time
        past = state.get(f"conv_{name}") if state is not None else None
        if past is None:
            past = x.new_zeros(B, h * hd, self.conv_size - 1)
        x = torch.cat([past, x], dim=2)  # (B, h * hd, K - 1 + N)
        if state is not None:
            state[f"conv_{name}"] = x[:, :, x.shape[2] - (self.conv_size - 1):]
        y = F.conv1d(x, weight[:, None], groups=h * hd)  # (B, h * hd, N)
        return F.silu(y).view(B, h, hd, N).transpose(2, 3)  # -> (B, h, N, hd)

    def project(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """x (B, N, d) -> {decay: log alpha (B, H, N, 1), gate: the output gate's input (B, H, N, hd), and beta
        (B, H, N, 1) with the delta rule}."""
        B, N, _ = x.shape
        decay = -self.A_log.exp() * F.softplus(self.a_proj(x) + self.dt_bias)  # (B, N, H)
        gate = self.g_proj(x).view(B, N, self.n_head, self.hd).transpose(1, 2)  # (B, N, H * hd) -> (B, H, N, hd)
        out = {"decay": decay.transpose(1, 2)[..., None], "gate": gate}  # decay (B, N, H) -> (B, H, N, 1)
        if self.delta:
            out["beta"] = torch.sigmoid(self.b_proj(x)).transpose(1, 2)[..., None]  # (B, N, H) -> (B, H, N, 1)
        return out

    def gates(self, extra: dict[str, torch.Tensor]) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """decay and beta (B, H, N) from `project`'s tensors (beta None without the delta rule)."""
        beta = extra["beta"][..., 0] if self.delta else None
        return extra["decay"][..., 0], beta

    def gated_norm(self, o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """Each head's output (B, H, N, hd): RMSNorm over its channels, times SiLU(gate)."""
        o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + 1e-6) * self.norm_weight
        return o * F.silu(gate)

    def fused(self, q, k, v, layout, scale, backend, extra=None):
        """The chunked form over the new positions (from the memory a KV cache holds, the recurrent form while
        decoding fewer than a chunk of tokens); q (B, H, N, hd), k, v (B, H, N, hd) -> (B, H, N, hd)."""
        self.check_layout(layout, explicit=False)
        decay, beta = self.gates(extra)
        cache = layout.cache
        state = cache.recurrent_state(self.layer, q.shape[2]) if cache is not None else None
        memory = state.get("memory") if state is not None else None
        # in float32 whatever the autocast (the triangular solve and the decays' exponentials, as transformers' and
        # flash-linear-attention's kernels do); the memory is kept in float32
        args = [t.float() if t is not None else None for t in (q * scale, k, v, decay, beta)]
        if state is not None and q.shape[2] < self.chunk:
            o, memory = recurrent_gated_delta(*args, memory)
        else:
            o, memory = chunked_gated_delta(*args, self.chunk, memory)
        if state is not None:
            state["memory"] = memory
        return self.gated_norm(o.to(v.dtype), extra["gate"])

    def probs(self, q: torch.Tensor, k: torch.Tensor, layout: Layout, rows: torch.Tensor, scale: float,
              extra: Optional[dict[str, torch.Tensor]] = None) -> torch.Tensor:
        """The effective attention of query rows (`effective_attention`): (B, H, R, n_keys)."""
        self.check_layout(layout, explicit=True)
        decay, beta = self.gates(extra)
        M = effective_attention((q * scale).float(), k.float(), decay.float(),
                                beta.float() if beta is not None else None, rows)
        return M.to(q.dtype)

    def attend(self, q, k, v, layout, rows, scale, extra):
        """The output of query rows through the effective attention (the explicit path): M @ v, gated and normed."""
        return self.gated_norm(self.probs(q, k, layout, rows, scale, extra) @ v, extra["gate"][:, :, rows])

    def check_layout(self, layout: Layout, explicit: bool) -> None:
        if not layout.plain_causal:
            raise UserError(f"model.attn_op={self.name} runs its recurrence over the plain causal sequence: a mask "
                            "of an intervention (a key dropped) does not apply to it; allowed: no extra mask")
        if explicit and layout.cache is not None:
            raise UserError(f"model.attn_op={self.name}: the effective attention needs the whole sequence, not a KV "
                            "cache's memory; allowed: a forward without a cache")


@ATTENTION_OPS.register("gated_deltanet")
class GatedDeltaNet(RecurrentOp):
    """Gated DeltaNet: the gated delta rule, with its short convolutions, L2-normalised q / k and gated output norm."""

    delta = True


@ATTENTION_OPS.register("gated_linear")
class GatedLinearAttention(RecurrentOp):
    """Gated linear attention with one decay per head (S_t = alpha_t S_{t-1} + k_t v_t^T), no delta rule."""

    delta = False
