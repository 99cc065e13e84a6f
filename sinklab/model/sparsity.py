"""Sparse attention patterns (`model.sparsity`): which of the keys its layout lets it see each query attends to.

A sparsity is applied to the layer's attention operation, whatever it normalises with: a **fixed pattern** is a mask
function on top of the layout (`Layout.restricted`), so the explicit map, a fused kernel (SDPA's dense mask,
FlexAttention's block mask) and the metrics see the same keys; a **selection** picks keys per query from the
operation's causally masked logits (or from the keys themselves), on the explicit path, so nothing is chosen among
keys the query may not see (a top-k over unmasked scores leaks the future). Both compose with the sink logit
(`model.sink_logit`), attention biases (bias slots are always kept, outside the budget) and gates.

- `none`: every visible key (the default);
- `topk`: the k largest logits per query (NSA's "Exact-Top" baseline), `topk_force_first` keeps position 0 within k;
- `moba`: MoBA (Lu et al. 2025, arXiv 2502.13189): key blocks of `moba_block` tokens scored by <q, mean key of the
  block>, the query's own block always (causally masked) plus the top `moba_topk - 1` earlier blocks; block 0 is not
  forced (`moba_force_first` forces it within the budget); parameter-free;
- `ashape`: StreamingLLM's A-shape, the `ashape_window` most recent positions plus the first `ashape_first`;
- `strided`: the Sparse Transformer's strided heads (Child et al. 2019, arXiv 1904.10509): the first half of the heads
  sees the last `strided_stride` positions, the others every `strided_stride`-th position back from the query;
  `strided_force_first` adds position 0 to every head;
- `bigbird`: BigBird's block pattern used causally (Zaheer et al. 2020, arXiv 2007.14062): blocks of `bigbird_block`,
  the query's own block and `bigbird_window` blocks before it, the first `bigbird_global` blocks, and
  `bigbird_random` random earlier blocks per head and query block (drawn once from a fixed seed and the layer).
Positions count from 0 over the sequence (learned sink tokens first): "position 0" is the first token a query can
see. Designs that force the first token or block have a knob for it, and so do those that lack one.

Retrofit (a sparsity added to a trained dense model): none has parameters, and none is the identity in general (a
query reads fewer keys); each is at any step where its budget keeps every key: top-k with topk_k >= the context's
positions, MoBA with moba_topk >= its blocks, the A-shape with ashape_window + ashape_first >= the positions, BigBird
with its own, window and global blocks covering the context; strided heads never are.
"""
from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Optional

import torch

from .masks import Layout, MaskMod, causal, first_positions, sliding_window, strided_heads
from .registry import ATTENTION_OPS, SPARSITIES, Component, ConfigError, check_positive_int


class Sparsity(Component):
    """The interface. A fixed pattern returns its `pattern()` mask function (over positions; `per_head` when it
    depends on the head); a selection sets `selects` and implements `keep`. `restrict` hands the layer the layout it
    attends through."""

    selects: ClassVar[bool] = False  # chooses keys from the scores (the explicit path, or flex through `flex_mask`)
    # a selection FlexAttention can run: `flex_mask(q, k, layout)` gives its choice as a mask_mod (B and H dependent)
    flex_selects: ClassVar[bool] = False
    per_head: ClassVar[bool] = False  # its pattern depends on the head
    llama = False  # LLaMA attends to every key: only `none` (Dense) is LLaMA's
    retrofit = "no parameters; the identity where it keeps every key"

    def __init__(self, cfg: Any, layer: int = 0):
        self.n_head, self.layer = cfg.n_head, layer

    def pattern(self, device: torch.device) -> Optional[MaskMod]:
        """The fixed mask function over positions (b, h, q, kv) -> bool this sparsity adds, or None; the tensors it
        reads live on `device` (a mask_mod compiled into a CUDA kernel can create no buffer, not even a copy)."""
        return None

    def restrict(self, layout: Layout) -> Layout:
        """The layout a layer with this sparsity attends through (built once per forward and pattern)."""
        pattern = self.pattern(layout.device)
        if pattern is None and not self.selects:
            return layout
        key = ("sparsity", self.name, self.pattern_key())
        return layout.restricted(key, pattern or causal, heads=self.n_head if self.per_head else None,
                                 selector=self if self.selects else None)

    def pattern_key(self) -> tuple:
        """What makes two layers' patterns the same (they share one restricted layout per forward)."""
        return ()

    def keep(self, q: torch.Tensor, k: torch.Tensor, s: torch.Tensor, seen: torch.Tensor, n_slots: int,
             rows: torch.Tensor) -> torch.Tensor:
        """A selection: q (B, H, R, hd), k (B, H, n_keys, hd), logits s (B, H, R, n_keys), visibility seen
        ((H,) R, n_keys), `n_slots` bias slots first, query positions rows (R,) -> the kept keys (B, H, R, n_keys), a
        subset of `seen` that keeps every visible slot."""
        raise NotImplementedError

    @classmethod
    def validate(cls, cfg: Any) -> None:
        if cls.selects and not ATTENTION_OPS.selected(cfg).takes_selection:
            allowed = ", ".join(op.name for op in ATTENTION_OPS if op.takes_selection)
            raise ConfigError(f"model.sparsity={cfg.sparsity} selects keys from an operation's logits, which "
                              f"model.attn_op={cfg.attn_op} does not compute per key; allowed attn_op with it: {allowed}")


@SPARSITIES.register("none")
class Dense(Sparsity):
    """Every key the layout lets a query see."""

    llama = True


def check_range(cfg: Any, key: str, low: int, high: int, what: str) -> None:
    """model.<key> must be an integer in [low, high] (`what` says what the upper end is)."""
    value = getattr(cfg, key)
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise ConfigError(f"model.{key}={value!r} is out of range; allowed: {low}..{high} ({what})")


def check_divides(cfg: Any, key: str) -> None:
    """model.<key> (a block size) must divide the context model.block_size."""
    check_positive_int(cfg, key)
    block = getattr(cfg, key)
    if cfg.block_size % block:
        divisors = [d for d in range(1, cfg.block_size + 1) if cfg.block_size % d == 0]
        raise ConfigError(f"model.{key}={block} does not divide the context model.block_size={cfg.block_size}; "
                          f"allowed: {', '.join(map(str, divisors))}")


def forced_position(s: torch.Tensor, seen: torch.Tensor, n_slots: int) -> torch.Tensor:
    """s with the logit of position 0 (key column n_slots) set to +inf where it is visible: a top-k keeps it."""
    s = s.clone()
    col = s[..., n_slots]
    s[..., n_slots] = torch.where(seen[..., n_slots].expand_as(col), torch.full_like(col, float("inf")), col)
    return s


@SPARSITIES.register("topk")
class TopK(Sparsity):
    """The `topk_k` largest causally masked logits per query; the bias slots kept besides."""

    selects = True

    @dataclasses.dataclass
    class Knobs:
        topk_k: int = 16
        topk_force_first: bool = False  # position 0 always kept, within the k

    def __init__(self, cfg: Any, layer: int = 0):
        super().__init__(cfg, layer)
        self.k, self.force_first = cfg.topk_k, cfg.topk_force_first

    @classmethod
    def validate(cls, cfg: Any) -> None:
        super().validate(cfg)
        n_keys = cfg.block_size + cfg.n_sink_tokens
        check_range(cfg, "topk_k", 2 if cfg.topk_force_first else 1, n_keys,
                    f"the keys a query can see at most{'; topk_force_first=true keeps position 0 within k' if cfg.topk_force_first else ''}")

    @classmethod
    def retrofit_identity(cls, cfg: Any) -> bool:
        return cfg.topk_k >= cfg.block_size + cfg.n_sink_tokens

    def keep(self, q, k, s, seen, n_slots, rows):
        real = s[..., n_slots:].masked_fill(~seen[..., n_slots:], float("-inf"))  # (B, H, R, P) causally masked
        if self.force_first:
            real = forced_position(real, seen[..., n_slots:], 0)
        top = real.topk(min(self.k, real.shape[-1]), dim=-1).indices
        chosen = torch.zeros_like(real, dtype=torch.bool).scatter_(-1, top, True)
        return torch.cat([seen[..., :n_slots].expand(*chosen.shape[:-1], n_slots), chosen], -1) & seen


@SPARSITIES.register("moba")
class MoBA(Sparsity):
    """MoBA's block router (module docstring): per query, its own block and the top `moba_topk - 1` earlier blocks by
    <q, mean key of the block>; no gradient through the choice (it has no parameters). With attn_backend=flex the
    choice is a block-table mask_mod, so the selected blocks run in FlexAttention's kernel."""

    selects = flex_selects = True

    @dataclasses.dataclass
    class Knobs:
        moba_block: int = 8
        moba_topk: int = 2  # blocks per query, its own included
        moba_force_first: bool = False  # block 0 always kept, within moba_topk

    def __init__(self, cfg: Any, layer: int = 0):
        super().__init__(cfg, layer)
        self.block, self.k, self.force_first = cfg.moba_block, cfg.moba_topk, cfg.moba_force_first

    @classmethod
    def validate(cls, cfg: Any) -> None:
        super().validate(cfg)
        check_divides(cfg, "moba_block")
        n_blocks = -(-(cfg.block_size + cfg.n_sink_tokens) // cfg.moba_block)
        check_range(cfg, "moba_topk", 2 if cfg.moba_force_first else 1, n_blocks,
                    "blocks of the context, the query's own included"
                    + ("; moba_force_first=true needs the own block and block 0" if cfg.moba_force_first else ""))

    @classmethod
    def retrofit_identity(cls, cfg: Any) -> bool:
        return cfg.moba_topk >= -(-(cfg.block_size + cfg.n_sink_tokens) // cfg.moba_block)

    def chosen_blocks(self, q: torch.Tensor, k: torch.Tensor, n_slots: int, rows: torch.Tensor) -> torch.Tensor:
        """q (B, H, R, hd) at positions rows (R,), k (B, H, n_keys, hd) -> (B, H, R, nb) bool: the blocks each query
        attends to (its own, and the top earlier ones by <q, mean key>)."""
        B, H = q.shape[:2]
        keys = k[:, :, n_slots:]  # (B, H, P, hd), P key positions
        P, L = keys.shape[2], self.block
        n_blocks = -(-P // L)
        padded = torch.nn.functional.pad(keys, (0, 0, 0, n_blocks * L - P))
        means = padded.view(B, H, n_blocks, L, -1).sum(3) / L  # (B, H, nb, hd); only complete blocks are scored
        gate = q.detach() @ means.detach().transpose(-1, -2)  # (B, H, R, nb)
        own = rows // L  # (R,) the query's own block
        blocks = torch.arange(n_blocks, device=q.device)
        earlier = blocks[None, :] < own[:, None]  # (R, nb): complete blocks before the query's own
        gate = gate.masked_fill(~earlier, float("-inf"))
        if self.force_first:
            gate = forced_position(gate, earlier, 0)
        chosen = torch.zeros_like(gate, dtype=torch.bool)
        n_pick = min(self.k - 1, n_blocks)
        if n_pick:
            chosen.scatter_(-1, gate.topk(n_pick, dim=-1).indices, True)
        return (chosen & earlier) | (blocks[None, :] == own[:, None])  # the own block always

    def keep(self, q, k, s, seen, n_slots, rows):
        chosen = self.chosen_blocks(q, k, n_slots, rows)  # (B, H, R, nb)
        key_block = torch.arange(k.shape[2] - n_slots, device=s.device) // self.block  # (P,)
        kept = chosen[..., key_block]  # (B, H, R, P)
        return torch.cat([torch.ones_like(kept[..., :n_slots]), kept], -1) & seen

    def flex_mask(self, q: torch.Tensor, k: torch.Tensor, layout: Layout) -> MaskMod:
        """The selection as a FlexAttention mask_mod over this forward's query rows and key indices (bias slots
        first), on top of the layout's: a (B, H, N, nb) table of chosen blocks looked up by key block."""
        n_slots, L = layout.n_slots, self.block
        chosen = self.chosen_blocks(q, k, n_slots, layout.rows())  # (B, H, N, nb)
        visible = layout.key_mask_mod()

        def mask(b, h, q_idx, kv_idx):
            block = (kv_idx - n_slots).clamp(min=0) // L
            return visible(b, h, q_idx, kv_idx) & ((kv_idx < n_slots) | chosen[b, h, q_idx, block])
        return mask


@SPARSITIES.register("ashape")
class AShape(Sparsity):
    """The `ashape_window` most recent positions and the first `ashape_first` (0: a plain window)."""

    @dataclasses.dataclass
    class Knobs:
        ashape_window: int = 12
        ashape_first: int = 4

    def __init__(self, cfg: Any, layer: int = 0):
        super().__init__(cfg, layer)
        self.window, self.first = cfg.ashape_window, cfg.ashape_first

    @classmethod
    def validate(cls, cfg: Any) -> None:
        super().validate(cfg)
        check_range(cfg, "ashape_window", 1, cfg.block_size, "the context model.block_size")
        check_range(cfg, "ashape_first", 0, cfg.block_size, "the context model.block_size")

    @classmethod
    def retrofit_identity(cls, cfg: Any) -> bool:
        return cfg.ashape_window + cfg.ashape_first >= cfg.block_size + cfg.n_sink_tokens

    def pattern_key(self) -> tuple:
        return self.window, self.first

    def pattern(self, device: torch.device) -> MaskMod:
        window = sliding_window(self.window)
        if not self.first:
            return window
        first = first_positions(self.first)
        return lambda b, h, q, kv: window(b, h, q, kv) | first(b, h, q, kv)


@SPARSITIES.register("strided")
class Strided(Sparsity):
    """Half the heads local (the last `strided_stride` positions), half strided (every `strided_stride`-th)."""

    per_head = True

    @dataclasses.dataclass
    class Knobs:
        strided_stride: int = 8
        strided_force_first: bool = False  # position 0 visible to every head

    def __init__(self, cfg: Any, layer: int = 0):
        super().__init__(cfg, layer)
        self.stride, self.force_first = cfg.strided_stride, cfg.strided_force_first

    @classmethod
    def validate(cls, cfg: Any) -> None:
        super().validate(cfg)
        check_range(cfg, "strided_stride", 1, cfg.block_size, "the context model.block_size")
        if cfg.n_head < 2:
            raise ConfigError(f"model.sparsity=strided needs local and strided heads, got model.n_head={cfg.n_head}; "
                              f"allowed: n_head >= 2")

    def pattern_key(self) -> tuple:
        return self.stride, self.force_first

    def pattern(self, device: torch.device) -> MaskMod:
        heads = strided_heads(self.stride, self.n_head // 2)
        if not self.force_first:
            return heads
        first = first_positions(1)
        return lambda b, h, q, kv: heads(b, h, q, kv) | first(b, h, q, kv)


@SPARSITIES.register("bigbird")
class BigBird(Sparsity):
    """Blocks of `bigbird_block`: the own block, `bigbird_window` before it, the first `bigbird_global`, and
    `bigbird_random` random earlier blocks per head and query block; a (H, nb, nb) table of visible blocks."""

    per_head = True
    SEED = 1729  # with the layer index: every model draws the same random blocks

    @dataclasses.dataclass
    class Knobs:
        bigbird_block: int = 8
        bigbird_window: int = 1  # blocks before the query's own
        bigbird_global: int = 1  # the first blocks every query sees (0: none)
        bigbird_random: int = 1  # random earlier blocks per head and query block

    def __init__(self, cfg: Any, layer: int = 0):
        super().__init__(cfg, layer)
        self.block, self.window, self.first = cfg.bigbird_block, cfg.bigbird_window, cfg.bigbird_global
        self.n_blocks = -(-(cfg.block_size + cfg.n_sink_tokens) // self.block)
        self.random = self.random_blocks(cfg.bigbird_random, layer)  # (H, nb, nb) bool

    def pattern_key(self) -> tuple:
        return self.layer,  # the random blocks differ by layer (the knobs are the model's)

    @classmethod
    def retrofit_identity(cls, cfg: Any) -> bool:
        """Its own, window and global blocks cover the context (the random ones are not counted on)."""
        n_blocks = -(-(cfg.block_size + cfg.n_sink_tokens) // cfg.bigbird_block)
        return 1 + cfg.bigbird_window + cfg.bigbird_global >= n_blocks

    @classmethod
    def validate(cls, cfg: Any) -> None:
        super().validate(cfg)
        check_divides(cfg, "bigbird_block")
        n_blocks = cfg.block_size // cfg.bigbird_block
        for key in ("bigbird_window", "bigbird_global", "bigbird_random"):
            check_range(cfg, key, 0, n_blocks, f"blocks in the context, model.block_size / model.bigbird_block")

    def random_blocks(self, n_random: int, layer: int) -> torch.Tensor:
        """(H, nb, nb) bool: key block kb is one of the `n_random` distinct blocks drawn for head h and query block
        qb among the earlier blocks that neither the window nor the global blocks cover (fewer where fewer are
        left)."""
        nb = self.n_blocks
        table = torch.zeros(self.n_head, nb, nb, dtype=torch.bool)
        g = torch.Generator().manual_seed(self.SEED + layer)
        for h in range(self.n_head):
            for qb in range(nb):
                free = torch.arange(self.first, max(self.first, qb - self.window))  # not seen otherwise
                table[h, qb, free[torch.randperm(len(free), generator=g)[:n_random]]] = True
        return table

    def pattern(self, device: torch.device) -> MaskMod:
        L, window, first, nb = self.block, self.window, self.first, self.n_blocks
        if self.random.device != device:
            self.random = self.random.to(device)
        random = self.random

        def mask(b, h, q_idx, kv_idx):
            qb, kb = q_idx // L, kv_idx // L
            near = (qb - kb <= window) | (kb < first)  # the own block, the window's and the global ones
            # positions past the trained context (a dense KV cache decoding on) reuse the last query block's draw
            drawn = random[h, qb.clamp(max=nb - 1), kb.clamp(max=nb - 1)]
            return near | drawn
        return mask
