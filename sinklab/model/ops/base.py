"""The interface of an attention operation: what it computes, what it declares, and how it runs fused."""
from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Optional

import torch

from ..backends import AttentionBackend
from ..masks import Layout
from ..registry import Component


class AttentionOp(Component, torch.nn.Module):
    """Turns queries and keys into an attention map for a set of query rows.

    A subclass registers itself with `@ATTENTION_OPS.register(name)` and defines `normalise` (logits -> map), or
    `probs` for an operation without logits. It declares:
      row_normalised(cfg)  whether every row of its map sums to one (else the metric also reports Sink*)
      has_logits           whether it has logits that ALiBi / relative biases can be added to
      fusable(cfg)         whether it has a fused path with this config (backend, masks, model.attn_memory): the
                           layer calls `fused` only then
      fused(...)           a fused kernel's output (softmax: through the backend), or None where this call cannot
                           take it (the backend refuses, an intervention's mask): the explicit map then
      llama_ok(cfg)        whether transformers' LLaMA can represent it (export-hf asks)
      output(o)            what the op does to the heads' output after the map (differential attention's norm)
      bind_layer(layer)    told its layer's index once, when the layer is built (a depth-dependent constant)
    Its parameters (a learned sink logit, a feature map) are submodules / parameters of the op.

    An operation that needs more than q, k, v (its own keys and values, gates, an indexer), all optional:
      project(x)           per-token tensors of its own from the layer's input x, {name: (B, h, N, w)}; the layer
                           rotates those named in `rotated` as keys, extends them through a KV cache and passes them,
                           over every key position, as `extra` to `probs`, `attend` and `aux_losses` (an op whose
                           `project` returns nothing is called without `extra`, as before)
      attend(...)          the output of query rows (map @ v unless its branches have values of their own)
      aux_losses(...)      losses it adds to the training loss during a training forward (an indexer's KL)
      set_step(step)       told the training step before each training forward (a warm-up)

    A recurrent operation (`recurrent`: a linear recurrent mixer, `ops/recurrent.py`) keeps a memory instead of
    keys: the layer hands `prepare(q, k, v, cache)` the projections of the new positions only (no RoPE unless
    `takes_rope`, nothing appended to the cache's keys), the op keeps its memory in the cache
    (`KVCache.recurrent_state`, never evicted) and `fused(..., extra)` computes the output; `probs` is its effective
    attention, what the metrics score.
    """

    has_logits: ClassVar[bool] = True
    # a sparse operation: each query attends to a subset of the keys its layout lets it see (a fixed pattern, or a
    # selection made from the scores); the `sparse` metric scores it on the keys each query can see
    sparse: ClassVar[bool] = False
    # its map comes from per-key logits through `normalise` (AttentionOp.probs), so a sparsity that selects keys from
    # the logits (model.sparsity=topk, moba) can apply; False for an op with its own `probs`
    takes_selection: ClassVar[bool] = True
    rows_sum_to_one: ClassVar[bool] = False  # what row_normalised says unless a knob decides
    # the tensors of `project` that take RoPE as the keys do (on their first min(width, head width) channels)
    rotated: ClassVar[tuple[str, ...]] = ()
    # a recurrent mixer (class docstring): its memory, not keys, in a KV cache; `prepare` transforms q, k, v
    recurrent: ClassVar[bool] = False
    takes_rope: ClassVar[bool] = True  # the layer rotates q and k (under a RoPE model.pos)

    def __init__(self, cfg: Any):
        super().__init__()
        self.n_head = cfg.n_head

    @classmethod
    def row_normalised(cls, cfg: Any) -> bool:
        return cls.rows_sum_to_one

    @classmethod
    def fusable(cls, cfg: Any) -> bool:
        """Whether this operation has a fused path under this config (checked without building it); the layer calls
        `fused` only where it has."""
        return False

    def fused(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: Layout, scale: float,
              backend: AttentionBackend) -> Optional[torch.Tensor]:
        """q (B, H, N, hd), k and v (B, H, n_keys, hd) -> (B, H, N, hd), or None where this call has no fused path.
        Called only where `fusable(cfg)`."""
        return None

    def restrict(self, layout: Layout) -> Layout:
        """The layout this operation attends through: `layout` itself, or with its fixed sparse pattern on top
        (`Layout.restricted`), so that the explicit map, a fused kernel and the metrics see the same keys."""
        return layout

    def bind_layer(self, layer: int) -> None:
        """The index of the layer this op belongs to (from 0); most ops do not depend on it."""

    def prepare(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                cache: Optional[Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A recurrent op's own transform of the projections of the new positions, q (B, H, N, hd), k and v
        (B, Hkv, N, hd), before the hook points (short convolutions, whose earlier inputs a KV cache keeps); called
        only where `recurrent`."""
        return q, k, v

    def project(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """x (B, N, d), the layer's (normed) input -> per-token tensors of the op's own, {name: (B, h, N, w)}, time on
        dim 2; none by default. The layer extends them through a KV cache (an evicting cache is refused), so
        `extra[name]` covers every key position 0 .. n_key_pos - 1 and a query row at position t reads
        `extra[name][:, :, t]`. The layer's `hook_extra` sees the dict, so a measurement can replay the maps."""
        return {}

    def set_step(self, step: int) -> None:
        """The training step about to run (from the LightningModule, before each training forward)."""

    def aux_losses(self, q: torch.Tensor, k: torch.Tensor, layout: Layout, scale: float,
                   extra: dict[str, torch.Tensor], chunk: int) -> dict[str, torch.Tensor]:
        """Scalar losses this op adds to the training loss, {name: loss}, computed in a training forward (grad
        enabled, module in train mode) from the layer's q (B, H, N, hd) and k (B, H, n_keys, hd), in row chunks of
        `chunk`; the model sums each name over its layers (`Transformer.aux_losses`). None by default."""
        return {}

    def output(self, o: torch.Tensor) -> torch.Tensor:
        """The heads' output map @ v (B, H, N, hd), fused or explicit -> what the layer's attention outputs."""
        return o

    def probs(self, q: torch.Tensor, k: torch.Tensor, layout: Layout, rows: torch.Tensor, scale: float,
              extra: Optional[dict[str, torch.Tensor]] = None) -> torch.Tensor:
        """Explicit map for query rows: q (B, H, R, hd), k (B, H, n_keys, hd) -> A (B, H, R, n_keys); `extra`: the
        tensors of `project` (an op without them may leave the argument out of its own `probs`)."""
        return self.normalise(*self.logits(q, k, layout, rows, scale))

    def logits(self, q: torch.Tensor, k: torch.Tensor, layout: Layout, rows: torch.Tensor,
               scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """The logits of query rows and the keys each sees, before `normalise`: q (B, H, R, hd), k (B, H, n_keys,
        hd) -> (s (B, H, R, n_keys), seen ((B,) (H,) R, n_keys)). Only an op whose map is `normalise` of them (one
        that keeps this class's `probs`) has them (`sinklab.model.hooked`: blocks.{i}.attn.hook_attn_scores)."""
        seen = layout.mask(rows)  # ((H,) R, n_keys)
        s = (q @ k.transpose(-1, -2)) * scale  # (B, H, R, n_keys)
        bias = layout.bias(rows)
        if bias is not None:
            s = s + bias.to(s.dtype)
        if layout.selector is not None:  # a sparsity's choice among the visible keys (B, H, R, n_keys)
            seen = layout.selector.keep(q, k, s, seen, layout.n_slots, rows)
        return s, seen

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: Layout, rows: torch.Tensor,
               scale: float, extra: dict[str, torch.Tensor]) -> torch.Tensor:
        """The output of query rows of an op with `project` tensors, q (B, H, R, hd) -> (B, H, R, hd): the map @ v,
        unless the op's branches have values of their own (NSA)."""
        return self.probs(q, k, layout, rows, scale, extra) @ v

    def normalise(self, s: torch.Tensor, seen: torch.Tensor) -> torch.Tensor:
        """logits s (B, H, R, n_keys) and visibility seen (R, n_keys) -> the map, zero where not seen."""
        raise NotImplementedError


def masked_softmax(s: torch.Tensor, seen: torch.Tensor) -> torch.Tensor:
    """softmax of s over the entries `seen` (broadcast against s), zero elsewhere; a row that sees nothing is zero
    (not NaN, in the gradient too): a sparse branch may have no key for a query (NSA's first compressed block is
    complete only at position l - 1)."""
    s = s.masked_fill(~seen, float("-inf"))
    s = s.masked_fill(~seen.any(-1, keepdim=True), 0.0)  # an empty row: finite logits, masked below
    return torch.softmax(s, dim=-1).masked_fill(~seen, 0.0)


class NormalisableOp(AttentionOp):
    """An operation whose rows may be divided by their sum (`model.attn_normalize`)."""

    @dataclasses.dataclass
    class Knobs:
        attn_normalize: bool = False  # divide each row by its sum

    def __init__(self, cfg: Any):
        super().__init__(cfg)
        self.normalize = cfg.attn_normalize

    @classmethod
    def row_normalised(cls, cfg: Any) -> bool:
        return cfg.attn_normalize

    def rows_to_one(self, a: torch.Tensor) -> torch.Tensor:
        return a / (a.sum(-1, keepdim=True) + 1e-8) if self.normalize else a
