"""Native Sparse Attention (Yuan et al., "Native Sparse Attention: Hardware-Aligned and Natively Trainable Sparse
Attention", arXiv 2502.11089, Sec. 3.2-3.3). Each query t reads three branches, each with keys and values of its own,
mixed by gates from the layer's input (Eq. 5):

    o_t = sum_{c in (cmp, slc, win)} g_t^c Attn(q_t, K_t^c, V_t^c),    g_t = sigmoid(x_t W_g) in [0, 1]^3 per head

- cmp (Eq. 7): blocks of l keys with stride d, block i = positions i d .. i d + l - 1, each compressed by phi, an MLP
  over the block's keys plus a learned intra-block position table; query t sees block i once all its tokens are
  visible (causally: i d + l - 1 <= t). Values alike, with their own phi.
- slc (Eq. 8-10): p_cmp = softmax(q_t . K_cmp) over the visible compressed blocks scores the selection blocks of l'
  positions, summed over the query heads that share a kv head (GQA, Eq. 10); the top n blocks are kept, and the
  query attends to their tokens (causally masked) with the layer's own k and v. Forced within the n: the first block
  (`nsa_force_initial`) and the query's own block and the ones before it (`nsa_force_local`, 2: the paper's
  "1 initial block and 2 local blocks"). The choice is made on causally masked scores only (no future leak).
- win: the last w positions (`nsa_window`), with their own keys and values.

Decided here (the paper leaves it open, or this framework asks it):
- Eq. 9 maps compressed scores onto selection blocks by their spatial overlap: p_slc[j] = sum_{m < l'/d} sum_{n < l/d}
  p_cmp[(l'/d) j + m - n], i.e. each compressed block counts with the number of strides d it shares with selection
  block j. The printed index (l'/d) j - m - n reaches blocks before j: with the paper's l = 32, d = 16, l' = 64 it
  sums compressed blocks 4j - 4 .. 4j, and 4j - 4 (positions 64j - 64 .. 64j - 33) lies wholly in block j - 1; the
  two forms agree where l' = d (one compressed block per selection block). Tested in tests/model/test_nsa_dsa.py.
- RoPE: the layer's q and k and the window's keys are rotated at their positions; a compressed key is phi of the
  un-rotated keys of its block (phi sees the intra-block position instead), rotated at the block's last position, so
  q_t . K_cmp[i] sees the distance from t to the end of block i, as a token key there would. Compressed values are
  not rotated. ALiBi / relative biases are added to the token branches, and to a block at its last position.
- Gates: one linear map from x to 3 scores per head (Eq. 5's MLP as a single layer), sigmoid.
- phi: Linear(l hd, l hd) - ReLU - Linear(l hd, hd) over the flattened block (as the pure-PyTorch port), weights
  N(0, init_std), biases zero, the position tables N(0, init_std).
- A query that sees no complete compressed block yet (t < l - 1) gets nothing from that branch (no memory slots).
- The model's masks apply to every branch on top of its own rule (a window, a prefix LM's bidirectional prefix, an
  intervention's hidden key: a compressed block is visible only if all its tokens are); a K / KV bias slot belongs
  to the selected branch, which reads the layer's keys and values, and is always kept there.
- The map the metrics score (`probs`) is the gates' sum of the three branch maps over the key positions, a compressed
  block's weight spread evenly over its l tokens: sum_c g_t^c A^c; its rows sum to g^cmp (where a block is visible)
  + g^slc + g^win, not one, so the sink metric also reports the renormalised Sink*. `branch_maps` gives the three
  maps ungated, `gates` the gates of query rows, and `hook_gate` sees every forward's gates (B, H, N, 3).
- Compressed keys are computed per row chunk from the per-token ones (kept in a KV cache, dense only, with the
  window's keys and values); no fused kernel: every forward runs the explicit row chunks. Each branch's logits
  take its mask (0 / -inf) and bias in the batched matmul that makes them, so the map is a plain softmax (a hidden
  key's weight an exact 0) and no (B, H, R, n_keys) mask is applied to it or its gradient; the selected branch's
  chosen blocks are added per block. The maps and gradients equal the masked formula's to float32 rounding
  (tests/model/test_nsa_dsa.py); docs/performance.md has the training step's speed.

Retrofit (`init_from=` a softmax model): the gates' weights zero (g = 1/2 on each branch), the compressed values zero
(phi_v's last layer), the window's key and value projections copies of the layer's: o = (slc + win) / 2, two sparse
parts of the checkpoint's dense attention. It is that attention (to float32 rounding) where both see every key: every
selection block kept (nsa_slc_topn = the context's blocks), a window of the whole context (nsa_window = block_size, no
sink tokens), and the window's keys and values those of the layer (no QK-norm, K / KV slot, or gate at G2 / G3).
"""
from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any, NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..hooks import HookPoint
from ..masks import Layout
from ..positional.rope import RotaryAt
from ..registry import ATTENTION_OPS, POSITIONS, ConfigError, check_positive_int
from .base import AttentionOp

BRANCHES = ("cmp", "slc", "win")  # the order of the gates' last axis


class BlockCompressor(nn.Module):
    """phi of Eq. 7: the l per-token vectors of each block (B, h, nb, l, hd), each plus its learned intra-block
    position, through an MLP over the whole block -> one vector per block (B, h, nb, hd)."""

    def __init__(self, block: int, hd: int):
        super().__init__()
        self.pos = nn.Parameter(torch.zeros(block, hd))  # (l, hd)
        self.mlp = nn.Sequential(nn.Linear(block * hd, block * hd), nn.ReLU(), nn.Linear(block * hd, hd))

    def init_parameters(self, std: float, bias_std: float) -> None:
        """The position table and the weights N(0, std), the biases zero, in registration order."""
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            else:
                nn.init.normal_(p, std=std)

    def forward(self, blocks: torch.Tensor) -> torch.Tensor:
        return self.mlp((blocks + self.pos).flatten(-2))  # (B, h, nb, l, hd) -> (B, h, nb, l * hd) -> (B, h, nb, hd)


class Branches(NamedTuple):
    """The three branches of a chunk of R query rows (P key positions, nb complete compressed blocks)."""

    cmp: torch.Tensor  # (B, H, R, nb) over the compressed blocks
    cmp_values: torch.Tensor  # (B, H, nb, hd)
    blocks: torch.Tensor  # (nb, l) the positions of each compressed block
    slc: torch.Tensor  # (B, H, R, n_slots + P) over the layer's keys, the selected blocks' tokens only
    win: torch.Tensor  # (B, H, R, P) over the window's own keys
    gate: torch.Tensor  # (B, H, R, 3) g^cmp, g^slc, g^win


@ATTENTION_OPS.register("nsa")
class NativeSparseAttention(AttentionOp):
    """Compressed, selected and sliding-window branches with keys and values of their own, mixed by sigmoid gates."""

    sparse = True
    takes_selection = False  # it selects blocks itself (model.sparsity=topk / moba would select on top)
    rows_sum_to_one = False  # the gates do not sum to one
    rotated = ("k_win",)  # the window's keys take RoPE as the layer's keys; compressed ones are rotated per block
    retrofit = "o = (selected + window) / 2 over the layer's keys: the identity where both see every key"

    @dataclasses.dataclass
    class Knobs:
        nsa_cmp_block: int = 8  # l: positions per compressed block
        nsa_cmp_stride: int = 4  # d: stride between compressed blocks (d | l)
        # l': positions per selection block (d | l'); the contract tries 4 too, where T = 24 has 6 blocks to choose from
        nsa_slc_block: int = dataclasses.field(default=8, metadata={"cases": (8, 4)})
        nsa_slc_topn: int = 4  # n: selection blocks kept per query, the forced ones included
        nsa_window: int = 16  # w: the window branch's positions
        nsa_force_initial: bool = True  # the first selection block is always kept
        nsa_force_local: int = 2  # the query's own selection block and the ones before it, always kept

    def __init__(self, cfg: Any):
        super().__init__(cfg)
        d, hd, H, Hkv = cfg.d_model, cfg.hd, cfg.n_head, cfg.kv_heads
        self.n_kv, self.hd = Hkv, hd
        self.block, self.stride, self.slc_block = cfg.nsa_cmp_block, cfg.nsa_cmp_stride, cfg.nsa_slc_block
        self.top_n, self.window = cfg.nsa_slc_topn, cfg.nsa_window
        self.force_initial, self.force_local = cfg.nsa_force_initial, cfg.nsa_force_local
        # each branch's own keys and values from the layer's input (the selected branch reads the layer's k and v)
        self.k_cmp_proj = nn.Linear(d, Hkv * hd, bias=False)
        self.v_cmp_proj = nn.Linear(d, Hkv * hd, bias=False)
        self.k_win_proj = nn.Linear(d, Hkv * hd, bias=False)
        self.v_win_proj = nn.Linear(d, Hkv * hd, bias=False)
        self.compress_k, self.compress_v = BlockCompressor(self.block, hd), BlockCompressor(self.block, hd)
        self.gate_proj = nn.Linear(d, H * len(BRANCHES), bias=False)
        self.hook_gate = HookPoint()  # the gates (B, H, N, 3) of every forward
        self.overlaps: dict[tuple, torch.Tensor] = {}  # Eq. 9's matrix by (nb, n_slc, device, dtype), built once
        self.rotates_in = partial(POSITIONS.selected(cfg).rotates, cfg)  # layer -> whether it takes RoPE
        self.rotates = self.rotates_in(0)

    @classmethod
    def validate(cls, cfg: Any) -> None:
        for key in ("nsa_cmp_block", "nsa_cmp_stride", "nsa_slc_block", "nsa_slc_topn", "nsa_window"):
            check_positive_int(cfg, key)
        local, T = cfg.nsa_force_local, cfg.block_size
        if not isinstance(local, int) or isinstance(local, bool) or local < 0:
            raise ConfigError(f"model.nsa_force_local={local!r} must be an integer >= 0 (local selection blocks "
                              "always kept)")
        for key in ("nsa_cmp_block", "nsa_slc_block"):
            if getattr(cfg, key) % cfg.nsa_cmp_stride:
                raise ConfigError(f"model.nsa_cmp_stride={cfg.nsa_cmp_stride} must divide model.{key}="
                                  f"{getattr(cfg, key)} (NSA needs d | l and d | l'); allowed: "
                                  f"{divisors(getattr(cfg, key))}")
            if T % getattr(cfg, key):
                raise ConfigError(f"model.{key}={getattr(cfg, key)} must divide the context model.block_size={T}; "
                                  f"allowed: {divisors(T)}")
        forced = int(cfg.nsa_force_initial) + local
        n_slc = -(-(T + cfg.n_sink_tokens) // cfg.nsa_slc_block)  # selection blocks of the context
        if cfg.nsa_slc_topn < forced:
            raise ConfigError(f"model.nsa_slc_topn={cfg.nsa_slc_topn} is smaller than the {forced} forced selection "
                              f"blocks (nsa_force_initial={str(cfg.nsa_force_initial).lower()}, nsa_force_local="
                              f"{local}); allowed: >= {forced}")
        if cfg.nsa_slc_topn > n_slc:  # more than the context holds: every block selected, i.e. dense selection
            raise ConfigError(f"model.nsa_slc_topn={cfg.nsa_slc_topn} exceeds the {n_slc} selection blocks of the "
                              f"context (model.block_size={T} / model.nsa_slc_block={cfg.nsa_slc_block}); allowed: "
                              f"{max(forced, 1)}..{n_slc}")
        if cfg.nsa_window > T:
            raise ConfigError(f"model.nsa_window={cfg.nsa_window} exceeds the context model.block_size={T}; "
                              f"allowed: 1..{T}")

    @classmethod
    def retrofit_identity(cls, cfg: Any) -> bool:
        n_pos = cfg.block_size + cfg.n_sink_tokens
        plain = cfg.qk_norm == "none" and cfg.attn_bias in ("none", "v") and \
            not (cfg.gate in ("headwise", "elementwise") and cfg.gate_position in ("G2", "G3"))
        return plain and cfg.nsa_window >= n_pos and cfg.nsa_slc_topn * cfg.nsa_slc_block >= n_pos

    def retrofit_init(self, parent: nn.Module) -> None:
        """The start of the module docstring's Retrofit, `parent` the layer's attention (its k and v projections)."""
        nn.init.zeros_(self.gate_proj.weight)
        for p in self.compress_v.mlp[-1].parameters():
            nn.init.zeros_(p)
        self.k_win_proj.weight.copy_(parent.k_proj.weight)
        self.v_win_proj.weight.copy_(parent.v_proj.weight)

    def bind_layer(self, layer: int) -> None:
        self.rotates = self.rotates_in(layer)  # a per-layer NoPE layer rotates no compressed key either

    # ------------------------------------------------------------------------------------------- per token
    def project(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """x (B, N, d) -> the compressed and window branches' keys and values (B, Hkv, N, hd) and the gates
        (B, H, N, 3)."""
        B, N, _ = x.shape

        def heads(proj: nn.Linear, h: int) -> torch.Tensor:
            return proj(x).view(B, N, h, -1).transpose(1, 2)  # (B, N, h * w) -> (B, h, N, w)

        gate = self.hook_gate(torch.sigmoid(heads(self.gate_proj, self.n_head)))  # (B, H, N, 3)
        return {"k_cmp": heads(self.k_cmp_proj, self.n_kv), "v_cmp": heads(self.v_cmp_proj, self.n_kv),
                "k_win": heads(self.k_win_proj, self.n_kv), "v_win": heads(self.v_win_proj, self.n_kv), "gate": gate}

    def compressed(self, extra: dict[str, torch.Tensor],
                   layout: Layout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """K_cmp, V_cmp (B, Hkv, nb, hd) of the nb = floor((P - l) / d) + 1 complete blocks of the P key positions,
        and the blocks' positions (nb, l); each key rotated at its block's last position (module docstring)."""
        P, device = layout.n_key_pos, extra["k_cmp"].device
        nb = max(0, (P - self.block) // self.stride + 1)
        blocks = (torch.arange(nb, device=device) * self.stride)[:, None] + torch.arange(self.block, device=device)
        m = self.block // self.stride  # strides per block

        def windows(t: torch.Tensor) -> torch.Tensor:
            """(B, Hkv, P, hd) -> (B, Hkv, nb, l, hd): block i is the strides i .. i + m - 1, so the blocks are m
            shifted views of the strides, stacked (t[:, :, blocks] alike, with a cheaper backward)."""
            if not nb:  # fewer than l positions: no complete block
                return t[:, :, blocks]
            strides = t[:, :, :(nb + m - 1) * self.stride].unflatten(2, (-1, self.stride))  # (B, Hkv, nb+m-1, d, hd)
            return torch.stack([strides[:, :, j:j + nb] for j in range(m)], 3).flatten(3, 4)

        kc = self.compress_k(windows(extra["k_cmp"]))  # (B, Hkv, nb, l, hd) -> (B, Hkv, nb, hd)
        vc = self.compress_v(windows(extra["v_cmp"]))
        rope = layout.rotary_at(P) if self.rotates and layout.rotary_at is not None else None
        if rope is not None:
            ends = blocks[:, -1]
            kc = RotaryAt(rope.cos[ends], rope.sin[ends])(kc)
        return kc, vc, blocks

    # ------------------------------------------------------------------------------------------- per query
    def group(self, t: torch.Tensor) -> torch.Tensor:
        """(B, Hkv, ...) -> (B, H, ...): each kv head's tensor for each query head of its group."""
        return t if self.n_head == self.n_kv else t.repeat_interleave(self.n_head // self.n_kv, dim=1)

    def branches(self, q: torch.Tensor, k: torch.Tensor, layout: Layout, rows: torch.Tensor, scale: float,
                 extra: Optional[dict[str, torch.Tensor]]) -> Branches:
        """The three branches of query rows: q (B, H, R, hd), the layer's k (B, H, n_slots + P, hd).

        The two token branches' (B, H, R, n_keys) logits are the costly tensors: each is made by one batched matmul
        that adds its additive mask (0 where seen, -inf elsewhere, and the bias), and its map is the plain softmax
        of those (a hidden key's weight is exp(-inf) = 0, and so is its gradient); only rows that see no key at all,
        found on the small masks, are set apart (`sparse_softmax`). Equal to masked_softmax of the scaled logits."""
        if not extra:
            raise ValueError("model.attn_op=nsa computes its maps from its own per-token tensors: pass the `extra` "
                             "its layer recorded at hook_extra (Attention.probs(q, k, layout, rows, extra))")
        S0, P, ls = layout.n_slots, layout.n_key_pos, self.slc_block
        seen = layout.mask(rows)  # (R, n_keys), or (H, R, n_keys) with per-head masks
        bias = layout.bias(rows)  # (H, R, n_keys) or None
        seen_pos = seen[..., S0:]  # (.., R, P): the key positions, without the bias slots
        # what the token logits add: 0 where the query sees the key, -inf where not, plus the bias ((H,) R, n_keys)
        hidden = torch.zeros(seen.shape, dtype=q.dtype, device=q.device).masked_fill_(~seen, float("-inf"))
        if bias is not None:
            hidden = hidden + bias.to(q.dtype)

        # compressed: the blocks all of whose tokens the query sees (causally: i d + l - 1 <= t)
        kc, vc, blocks = self.compressed(extra, layout)
        complete = seen_pos[..., blocks].all(-1)  # seen_pos[..., blocks]: (.., R, nb, l) -> (.., R, nb)
        ends = hidden[..., S0 + blocks[:, -1]]  # (.., R, nb): the bias (and mask) at each block's last position
        a_cmp = sparse_softmax(masked_logits(q, self.group(kc), scale, ends.masked_fill(~complete, float("-inf"))),
                               ~complete.any(-1))

        # selected: the tokens of the chosen blocks (and the bias slots), through the layer's keys
        chosen = self.group(self.select(a_cmp, rows, seen_pos))  # (B, H, R, n_slc)
        drop = torch.zeros(chosen.shape, dtype=q.dtype, device=q.device).masked_fill_(~chosen, float("-inf"))
        # the logits of the blocks not chosen -inf, by blocks where the positions fill whole blocks
        s = masked_logits(q, k, scale, hidden)  # (B, H, R, n_slots + P)
        if S0 == 0 and P % ls == 0:  # (B, H, R, n_slc, l') + (B, H, R, n_slc, 1): no (B, H, R, P) mask built
            s = (s.unflatten(-1, (-1, ls)) + drop[..., None]).flatten(-2)
        else:  # a partial last block (decoding) or bias slots (always kept)
            drop = drop[..., None].expand(*chosen.shape, ls).flatten(-2)[..., :P]  # (B, H, R, n_slc) -> (.., P)
            s = s + F.pad(drop, (S0, 0))
        # a row sees no key if no slot and none of its chosen blocks' tokens is seen
        empty = ~((self.blockwise(seen_pos) & chosen).any(-1) | seen[..., :S0].any(-1))  # (B, H, R)
        a_slc = sparse_softmax(s, empty)

        # window: the last w positions, through the window's own keys
        near = (rows[:, None] - torch.arange(P, device=q.device)) < self.window  # (R, P)
        s = masked_logits(q, self.group(extra["k_win"]), scale, hidden[..., S0:].masked_fill(~near, float("-inf")))
        a_win = sparse_softmax(s, ~(seen_pos & near).any(-1))  # (B, H, R, P); empty: (.., R)
        return Branches(a_cmp, self.group(vc), blocks, a_slc, a_win, self.gates(extra, rows))

    def select(self, a_cmp: torch.Tensor, rows: torch.Tensor, seen_pos: torch.Tensor) -> torch.Tensor:
        """Eq. 9-10: the compressed map a_cmp (B, H, R, nb) -> the kept selection blocks (B, Hkv, R, n_slc), bool:
        the forced blocks and the best-scored others, n in all, among the blocks with a token the query sees."""
        B, H, R, nb = a_cmp.shape
        P, device = seen_pos.shape[-1], a_cmp.device
        n_slc = -(-P // self.slc_block)
        p = a_cmp.view(B, self.n_kv, H // self.n_kv, R, nb).sum(2)  # Eq. 10, a group's heads: (B, Hkv, R, nb)
        key = (nb, n_slc, device, p.dtype)
        if key not in self.overlaps:
            self.overlaps[key] = self.overlap(nb, n_slc, device).to(p.dtype)
        p = p @ self.overlaps[key]  # Eq. 9: (B, Hkv, R, n_slc)
        visible = self.blockwise(seen_pos if seen_pos.dim() == 2 else seen_pos.any(0))  # (R, n_slc): a token seen
        back = rows[:, None] // self.slc_block - torch.arange(n_slc, device=device)  # (R, n_slc): blocks back
        forced = (back >= 0) & (back < self.force_local)
        if self.force_initial:
            forced[:, 0] = True
        score = p.masked_fill(forced & visible, float("inf")).masked_fill(~visible, float("-inf"))
        top = score.topk(min(self.top_n, n_slc), dim=-1).indices  # (B, Hkv, R, n)
        return torch.zeros_like(score, dtype=torch.bool).scatter(-1, top, True) & visible

    def blockwise(self, seen_pos: torch.Tensor) -> torch.Tensor:
        """(.., R, P) key positions a query sees -> (.., R, n_slc): the selection blocks with a token it sees."""
        P, ls = seen_pos.shape[-1], self.slc_block
        padded = F.pad(seen_pos, (0, -(-P // ls) * ls - P))  # (.., R, n_slc l'): the last block filled up with False
        return padded.unflatten(-1, (-1, ls)).any(-1)  # (.., R, n_slc, l') -> (.., R, n_slc)

    def overlap(self, nb: int, n_slc: int, device: torch.device) -> torch.Tensor:
        """Eq. 9 as a matrix M (nb, n_slc), p_slc = p_cmp @ M: M[i, j] = #{(m, n): (l'/d) j + m - n = i, m < l'/d,
        n < l/d}, the number of strides d that compressed block i shares with selection block j."""
        a, b = self.slc_block // self.stride, self.block // self.stride
        j = torch.arange(n_slc, device=device)
        mat = torch.zeros(nb, n_slc, device=device)
        for m in range(a):
            for n in range(b):
                i = a * j + m - n  # one compressed block per selection block j: the (i, j) pairs are distinct
                ok = (i >= 0) & (i < nb)
                mat[i[ok], j[ok]] += 1
        return mat

    def gates(self, extra: dict[str, torch.Tensor], rows: torch.Tensor) -> torch.Tensor:
        """g_t^cmp, g_t^slc, g_t^win of query rows at positions `rows`: (B, H, R, 3)."""
        return extra["gate"][:, :, rows]

    def branch_maps(self, q: torch.Tensor, k: torch.Tensor, layout: Layout, rows: torch.Tensor, scale: float,
                    extra: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Each branch's map over the layer's keys (B, H, R, n_slots + P), ungated: "cmp" with a block's weight
        spread evenly over its l tokens, "slc", "win" (the window's own keys, at their positions)."""
        b = self.branches(q, k, layout, rows, scale, extra)
        nb, P = b.blocks.shape[0], layout.n_key_pos
        spread = b.cmp.new_zeros(nb, P)  # (nb, P): 1 / l on each block's tokens
        spread[torch.arange(nb, device=q.device)[:, None], b.blocks] = 1.0 / self.block
        slots = b.slc.new_zeros(*b.slc.shape[:-1], layout.n_slots)
        return {"cmp": torch.cat([slots, b.cmp @ spread], -1), "slc": b.slc, "win": torch.cat([slots, b.win], -1)}

    def probs(self, q: torch.Tensor, k: torch.Tensor, layout: Layout, rows: torch.Tensor, scale: float,
              extra: Optional[dict[str, torch.Tensor]] = None) -> torch.Tensor:
        """The map the metrics score: sum_c g^c A^c over the key positions (module docstring), (B, H, R, n_keys)."""
        maps, g = self.branch_maps(q, k, layout, rows, scale, extra), self.gates(extra, rows)
        return sum(g[..., c:c + 1] * maps[name] for c, name in enumerate(BRANCHES))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: Layout, rows: torch.Tensor,
               scale: float, extra: dict[str, torch.Tensor]) -> torch.Tensor:
        """Eq. 5: sum_c g^c A^c V^c for query rows, each branch through its own values: (B, H, R, hd)."""
        b = self.branches(q, k, layout, rows, scale, extra)
        g = b.gate
        return (g[..., 0:1] * (b.cmp @ b.cmp_values) + g[..., 1:2] * (b.slc @ v)
                + g[..., 2:3] * (b.win @ self.group(extra["v_win"])))


def masked_logits(q: torch.Tensor, k: torch.Tensor, scale: float, add: torch.Tensor) -> torch.Tensor:
    """(q @ k^T) * scale + add in one batched matmul: q (B, H, R, hd), k (B, H, n, hd), add broadcast against
    (B, H, R, n) (a mask's 0 / -inf and a bias) -> (B, H, R, n)."""
    B, H, R, hd = q.shape
    n = k.shape[-2]
    add = add.expand(B, H, R, n).reshape(B * H, R, n)  # a view where `add` is shared by the batch and the heads
    s = torch.baddbmm(add, q.reshape(B * H, R, hd), k.reshape(B * H, n, hd).transpose(1, 2), alpha=scale)
    return s.view(B, H, R, n)  # (B H, R, n) -> (B, H, R, n)


def sparse_softmax(s: torch.Tensor, empty: torch.Tensor) -> torch.Tensor:
    """softmax of logits s (B, H, R, n) that are -inf where a key is hidden; the rows `empty` ((B,) (H,) R, bool:
    those that see no key) zero, in the gradient too: masked_softmax's map, without its passes over the map (the
    check for empty rows reads the small masks; on a GPU it is one host sync).
    On the CPU a last axis shorter than 16 is padded with -inf keys (weight 0) to 16: PyTorch's AVX-512 softmax
    takes a slow path below a vector of 16 floats (8x slower at n = 15, the preset's compressed blocks)."""
    gone = empty[..., None] if empty.any() else None  # (.., R, 1)
    if gone is not None:
        s = s.masked_fill(gone, 0.0)  # finite logits in a row that sees nothing, zeroed below
    n = s.shape[-1]
    if s.device.type == "cpu" and 0 < n < 16:
        a = torch.softmax(F.pad(s, (0, 16 - n), value=float("-inf")), dim=-1)[..., :n]
    else:
        a = torch.softmax(s, dim=-1)
    return a if gone is None else a.masked_fill(gone, 0.0)


def divisors(n: int) -> str:
    return ", ".join(str(x) for x in range(1, n + 1) if n % x == 0)
