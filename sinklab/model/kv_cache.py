"""A KV cache for incremental decoding, optionally evicting as StreamingLLM does (Xiao et al. 2024, "Efficient
Streaming Language Models with Attention Sinks").

Per layer it holds the keys and values of the positions seen so far, (B, n_kv_heads, L, hd), as the layer computed
them (after a G3 / G2 gate), before the kv heads' repeat and without the K / KV bias slot (the attention prepends
it). A cache that evicts holds the keys before RoPE: the attention rotates them at their place in the cache on every
step, so evicting positions re-indexes the kept ones, as StreamingLLM does ("positions within the cache"). A cache
that never evicts never moves a key, so it holds them after RoPE (`stores_rotated`) and a step rotates only its new
keys: O(1) RoPE work per step instead of O(L) past thousands of tokens. It gives the full forward's logits.

Eviction, after each forward: with `keep_first` x and `recent` y set, the cache keeps the model's learned sink tokens,
the first x text tokens and the y most recent ones; a forward's new tokens see all of them and themselves. x = 0 is
window attention; no eviction (both None) is dense attention, which goes past the training context.

An attention operation with per-token tensors of its own (`AttentionOp.project`: NSA's branch keys, DSA's indexer)
keeps them here too, per layer and name (`extend_extra`), in a dense cache only.
"""
from __future__ import annotations

from typing import Optional

import torch


class KVCache:
    """Keys and values per layer, and the eviction policy (keep the first `keep_first` tokens and the `recent`
    last). `n_sink` learned sink tokens (model.n_sink_tokens) are always kept, before the first tokens.

    Storage: one preallocated buffer per layer for the keys and one for the values, (B, Hkv, room, hd), written in
    place; `room` doubles when a dense cache outgrows it (an evicting one never needs more than its capacity plus a
    forward's tokens). So a decoding step copies only its new keys (and, when evicting, the `recent` kept ones), not
    the whole cache: O(1) per step instead of O(L). `extend` returns views of the buffers, valid until the next
    forward writes them."""

    def __init__(self, n_layer: int, n_sink: int = 0, keep_first: Optional[int] = None,
                 recent: Optional[int] = None):
        if (keep_first is None) != (recent is None):
            raise ValueError(f"KVCache: keep_first={keep_first} and recent={recent} must both be set (evicting) or "
                             "both None (dense)")
        if keep_first is not None and (keep_first < 0 or recent < 1):
            raise ValueError(f"KVCache: keep_first={keep_first} must be >= 0 and recent={recent} >= 1")
        self.n_sink, self.keep_first, self.recent = n_sink, keep_first, recent
        self.k: list[Optional[torch.Tensor]] = [None] * n_layer  # buffers (B, Hkv, room, hd)
        self.v: list[Optional[torch.Tensor]] = [None] * n_layer
        # per layer, the operation's own per-token tensors (`extend_extra`): name -> buffer (B, h, room, w)
        self.extra: list[dict[str, torch.Tensor]] = [{} for _ in range(n_layer)]
        self.length = 0  # positions held (sink tokens included) before the next forward
        self.seen = 0  # text tokens the model has been given, evicted ones included
        self._filled = 0  # positions written by the forward in progress (length + its new ones)

    @property
    def stores_rotated(self) -> bool:
        """Keys are stored after RoPE (a dense cache: no key ever changes place), else before it."""
        return self.recent is None

    @property
    def capacity(self) -> Optional[int]:
        """Positions kept after a forward (sink tokens included), None without eviction."""
        return None if self.recent is None else self.n_sink + self.keep_first + self.recent

    def extend(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append a forward's new keys and values (B, Hkv, N, hd) to the layer's; return all of them (views)."""
        self.k[layer] = buf_k = self.grown(self.k[layer], k)
        self.v[layer] = buf_v = self.grown(self.v[layer], v)
        end = self.length + k.shape[2]
        buf_k[:, :, self.length:end] = k
        buf_v[:, :, self.length:end] = v
        self._filled = end
        return buf_k[:, :, :end], buf_v[:, :, :end]  # (B, Hkv, length + N, hd)

    def extend_extra(self, layer: int, name: str, t: torch.Tensor) -> torch.Tensor:
        """Append a forward's per-token tensor `name` of the layer's operation (`AttentionOp.project`), (B, h, N, w),
        to the positions held; return all of them (a view). Only a dense cache holds them (the attention refuses an
        evicting one before it gets here): nothing ever moves them."""
        store = self.extra[layer]
        store[name] = buf = self.grown(store.get(name), t)
        end = self.length + t.shape[2]
        buf[:, :, self.length:end] = t
        return buf[:, :, :end]  # (B, h, length + N, w)

    def grown(self, buf: Optional[torch.Tensor], new: torch.Tensor) -> torch.Tensor:
        """`buf` (B, h, room, w), or a larger buffer holding its first `length` positions, with room for `new`
        (B, h, N, w) after them: room doubles (at least), so that appending is amortised O(N)."""
        end = self.length + new.shape[2]
        if buf is not None and buf.shape[2] >= end and buf.shape[:2] == new.shape[:2] and buf.dtype == new.dtype:
            return buf
        room = max(end, 2 * buf.shape[2] if buf is not None else 0, (self.capacity or 0) + new.shape[2])
        grown = new.new_empty(new.shape[0], new.shape[1], room, new.shape[3])  # (B, h, room, w)
        if self.length:
            grown[:, :, :self.length] = buf[:, :, :self.length]
        return grown

    def commit(self, n_tokens: int) -> None:
        """After a forward that gave the model `n_tokens` text tokens: count them, then evict."""
        self.seen += n_tokens
        self.length = self._filled
        keep = self.capacity
        if keep is None or self.length <= keep:
            return
        head, L = self.n_sink + self.keep_first, self.length
        for store in (self.k, self.v):
            for t in store:  # the recent ones move to just after the head, in place (the source copied first)
                t[:, :, head:keep] = t[:, :, L - self.recent:L].clone()
        self.length = keep
