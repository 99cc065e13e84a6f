"""A KV cache for incremental decoding, optionally evicting as StreamingLLM does (Xiao et al. 2024, "Efficient
Streaming Language Models with Attention Sinks").

Per layer it holds the keys and values of the positions seen so far, (B, n_kv_heads, L, hd), as the layer computed
them (after a G3 / G2 gate) but before RoPE, before the kv heads' repeat and without the K / KV bias slot: the
attention rotates the keys at their place in the cache on every step and prepends the slot itself. So a cache that
evicts positions re-indexes the kept ones, as StreamingLLM does ("positions within the cache"), and one that never
evicts gives the full forward's logits.

Eviction, after each forward: with `keep_first` x and `recent` y set, the cache keeps the model's learned sink tokens,
the first x text tokens and the y most recent ones; a forward's new tokens see all of them and themselves. x = 0 is
window attention; no eviction (both None) is dense attention, which goes past the training context.
"""
from __future__ import annotations

from typing import Optional

import torch


class KVCache:
    """Keys and values per layer, and the eviction policy (keep the first `keep_first` tokens and the `recent`
    last). `n_sink` learned sink tokens (model.n_sink_tokens) are always kept, before the first tokens."""

    def __init__(self, n_layer: int, n_sink: int = 0, keep_first: Optional[int] = None,
                 recent: Optional[int] = None):
        if (keep_first is None) != (recent is None):
            raise ValueError(f"KVCache: keep_first={keep_first} and recent={recent} must both be set (evicting) or "
                             "both None (dense)")
        if keep_first is not None and (keep_first < 0 or recent < 1):
            raise ValueError(f"KVCache: keep_first={keep_first} must be >= 0 and recent={recent} >= 1")
        self.n_sink, self.keep_first, self.recent = n_sink, keep_first, recent
        self.k: list[Optional[torch.Tensor]] = [None] * n_layer
        self.v: list[Optional[torch.Tensor]] = [None] * n_layer
        self.length = 0  # positions held (sink tokens included) before the next forward
        self.seen = 0  # text tokens the model has been given, evicted ones included

    @property
    def capacity(self) -> Optional[int]:
        """Positions kept after a forward (sink tokens included), None without eviction."""
        return None if self.recent is None else self.n_sink + self.keep_first + self.recent

    def extend(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append a forward's new keys and values (B, Hkv, N, hd) to the layer's; return all of them."""
        if self.k[layer] is not None:
            k = torch.cat([self.k[layer], k], dim=2)  # (B, Hkv, L + N, hd)
            v = torch.cat([self.v[layer], v], dim=2)
        self.k[layer], self.v[layer] = k, v
        return k, v

    def commit(self, n_tokens: int) -> None:
        """After a forward that gave the model `n_tokens` text tokens: count them, then evict."""
        self.seen += n_tokens
        self.length = self.k[0].shape[2] if self.k[0] is not None else self.length
        keep = self.capacity
        if keep is None or self.length <= keep:
            return
        head = self.n_sink + self.keep_first
        for store in (self.k, self.v):
            for i, t in enumerate(store):
                store[i] = torch.cat([t[:, :, :head], t[:, :, t.shape[2] - self.recent:]], dim=2)
        self.length = keep
