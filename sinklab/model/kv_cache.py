"""A KV cache for incremental decoding that evicts by a policy (`sinklab.model.cache_policies`): StreamingLLM's first +
recent tokens (Xiao et al. 2024, "Efficient Streaming Language Models with Attention Sinks"), a window, the
attention-selected policies (H2O, TOVA, SnapKV, PyramidKV), key norms, or DuoAttention's per-head split.

Per layer it holds the keys and values of the positions seen so far, (B, n_kv_heads, L, hd), as the layer computed
them (after a G3 / G2 gate), before the kv heads' repeat and without the K / KV bias slot (the attention prepends
it). A cache whose policy moves keys holds them before RoPE: the attention rotates them at their place in the cache
on every step, so evicting positions re-indexes the kept ones, as StreamingLLM does ("positions within the cache").
A cache that never moves a key (dense, or a policy that masks keys instead of dropping them) holds them after RoPE
(`stores_rotated`) and a step rotates only its new keys: O(1) RoPE work per step instead of O(L) past thousands of
tokens. A dense cache gives the full forward's logits.

Eviction: after each forward (`evict="decoding"`, StreamingLLM's protocol), or only when `compress()` is called
(`evict="prefill"`: compress the prompt once, then decode the question into a cache that grows, kvpress's protocol
with its KeyRerotationPress: a plain kvpress press keeps each key at the position it came in at).
The policy picks, per layer and kv head, the text keys to keep; the model's learned sink tokens are always kept,
before them. The keys kept move to the front in their order (gathered: a step then attends to O(budget) keys);
`origin` says where each came from (the index of the text token, -1 for a learned sink token). A policy whose layers
or heads keep different numbers of keys masks the others (`visible`, applied by the attention on top of its mask):
PyramidKV's shorter layers (the free slots first, so the kept keys stay next to the new ones) and DuoAttention's
streaming heads (its keys never move). Attention-based policies get each forward's map through `observe`.

An attention operation with per-token tensors of its own (`AttentionOp.project`: NSA's branch keys, DSA's indexer)
keeps them here too, per layer and name (`extend_extra`), in a dense cache only.

A recurrent layer (`AttentionOp.recurrent`: Gated DeltaNet, gated linear attention) holds no keys: its memory (the
short convolutions' last inputs, the matrix memory) is `recurrent_state(layer)`, a fixed size whatever the context,
and no policy ever evicts it; the policies evict and mask the keys of the other layers only.
"""
from __future__ import annotations

from typing import Optional

import torch

from .cache_policies import CachePolicy, Dense, Streaming, gather_state

EVICT = ("decoding", "prefill")


class KVCache:
    """Keys and values per layer, and the eviction policy (module docstring); `keep_first` x and `recent` y are
    StreamingLLM's policy (the first x tokens and the y last; `policy` for any other). `n_sink` learned sink tokens
    (model.n_sink_tokens) are always kept, before the text's keys.

    Storage: one preallocated buffer per layer for the keys and one for the values, (B, Hkv, room, hd), written in
    place; `room` doubles when the cache outgrows it (an evicting one never needs more than its capacity plus a
    forward's tokens). So a decoding step copies only its new keys (and, when evicting, the kept ones), not the whole
    cache: O(1) per step without eviction, O(budget) with. `extend` returns views of the buffers, valid until the next
    forward writes them."""

    def __init__(self, n_layer: int, n_sink: int = 0, keep_first: Optional[int] = None,
                 recent: Optional[int] = None, policy: Optional[CachePolicy] = None, evict: str = "decoding"):
        if (keep_first is None) != (recent is None):
            raise ValueError(f"KVCache: keep_first={keep_first} and recent={recent} must both be set (evicting) or "
                             "both None (dense)")
        if keep_first is not None and (keep_first < 0 or recent < 1):
            raise ValueError(f"KVCache: keep_first={keep_first} must be >= 0 and recent={recent} >= 1")
        if keep_first is not None:
            if policy is not None:
                raise ValueError("KVCache: keep_first / recent or a policy, not both")
            policy = Streaming(keep_first + recent, first=keep_first)
        if evict not in EVICT:
            raise ValueError(f"KVCache: evict={evict!r}; allowed: {', '.join(EVICT)}")
        self.policy = policy if policy is not None else Dense()
        self.evict_on_commit = evict == "decoding"
        self.n_layer, self.n_sink = n_layer, n_sink
        self.k: list[Optional[torch.Tensor]] = [None] * n_layer  # buffers (B, Hkv, room, hd)
        self.v: list[Optional[torch.Tensor]] = [None] * n_layer
        # per layer, the operation's own per-token tensors (`extend_extra`): name -> buffer (B, h, room, w)
        self.extra: list[dict[str, torch.Tensor]] = [{} for _ in range(n_layer)]
        # per layer, the policy's state over the text keys (`CachePolicy.observe`): name -> (..., L - n_sink)
        self.state: list[dict] = [{} for _ in range(n_layer)]
        # per layer, a recurrent op's memory (`recurrent_state`): name -> tensor, never evicted
        self.recurrent: list[dict] = [{} for _ in range(n_layer)]
        # per layer, where each key came from (B, Hkv, L): the text token's index, -1 for a sink token (evicting
        # policies only: a dense cache's is its place)
        self.origin: list[Optional[torch.Tensor]] = [None] * n_layer
        # per layer, (B, Hkv, L) True where a key is visible, or None (all are)
        self.visible: list[Optional[torch.Tensor]] = [None] * n_layer
        self.choice: object = None  # what a masking policy decided once (`CachePolicy.choose`)
        self.length = 0  # positions held (sink tokens included) before the next forward
        self.seen = 0  # text tokens the model has been given, evicted ones included
        self._filled = 0  # positions written by the forward in progress (length + its new ones)

    @property
    def moves_keys(self) -> bool:
        """Keys are dropped and the kept ones moved to the front (an evicting policy that does not mask)."""
        return self.policy.budget is not None and not self.policy.masks

    @property
    def stores_rotated(self) -> bool:
        """Keys are stored after RoPE (no key ever changes place), else before it."""
        return not self.moves_keys

    @property
    def wants_maps(self) -> bool:
        """The policy observes each forward's attention map (`observe`)."""
        return self.policy.needs_maps

    @property
    def capacity(self) -> Optional[int]:
        """Positions kept after an eviction (sink tokens included; the largest layer's), None if none evicts."""
        if not self.moves_keys:
            return None
        return self.n_sink + max(self.policy.capacity(layer, self.n_layer) for layer in range(self.n_layer))

    def extend(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append a forward's new keys and values (B, Hkv, N, hd) to the layer's; return all of them (views)."""
        self.k[layer] = buf_k = self.grown(self.k[layer], k)
        self.v[layer] = buf_v = self.grown(self.v[layer], v)
        end = self.length + k.shape[2]
        buf_k[:, :, self.length:end] = k
        buf_v[:, :, self.length:end] = v
        self._filled = end
        B, Hkv, N = k.shape[:3]
        if self.moves_keys:  # where the new keys come from: sink tokens (a first forward's first n_sink), text
            sink = self.n_sink if self.length == 0 else 0
            new = torch.cat([torch.full((sink,), -1), torch.arange(self.seen, self.seen + N - sink)]).to(k.device)
            old = self.origin[layer] if self.length else new[:0].expand(B, Hkv, 0)
            self.origin[layer] = torch.cat([old[:, :, :self.length], new.expand(B, Hkv, N)], dim=2)
        if self.visible[layer] is not None:
            self.visible[layer] = torch.cat([self.visible[layer][:, :, :self.length],
                                             self.visible[layer].new_ones(B, Hkv, N)], dim=2)
        return buf_k[:, :, :end], buf_v[:, :, :end]  # (B, Hkv, length + N, hd)

    def visible_keys(self, layer: int) -> Optional[torch.Tensor]:
        """(Hkv, L) the keys the layer's queries may see, or None (all): the attention's mask on top of its own
        (one batch row's: a cache that masks decodes one sequence at a time)."""
        visible = self.visible[layer]
        return None if visible is None else visible[0, :, :self._filled]

    def origins(self, layer: int) -> torch.Tensor:
        """(B, Hkv, L) the text token each held key came from (-1: a learned sink token; a masked key's too)."""
        if self.moves_keys:
            origin = self.origin[layer][:, :, :self.length].clone()
        else:
            B, Hkv = self.k[layer].shape[:2]
            origin = (torch.arange(self.length, device=self.k[layer].device) - self.n_sink).expand(B, Hkv, -1).clone()
            origin[..., :self.n_sink] = -1
        if self.visible[layer] is not None:
            origin[~self.visible[layer][:, :, :self.length]] = -1
        return origin

    def observe(self, layer: int, probs: torch.Tensor) -> None:
        """A forward's attention map of the layer, probs (B, H, N, L) over the keys held (bias slots dropped), to
        the policy: summed over each kv head's query heads, the text keys only."""
        B, H, N, L = probs.shape
        Hkv = self.k[layer].shape[1]
        per_kv = probs.detach().float().view(B, Hkv, H // Hkv, N, L).sum(2)  # (B, Hkv, N, L)
        self.policy.observe(self.state[layer], per_kv[..., self.n_sink:])

    def recurrent_state(self, layer: int, n_new: int) -> dict:
        """The memory of a recurrent layer (name -> tensor, the op reads and replaces its entries), in a forward of
        n_new positions: counted as held, as `extend` counts a softmax layer's keys."""
        self._filled = self.length + n_new
        return self.recurrent[layer]

    def key_layers(self) -> list[int]:
        """The layers that hold keys (not recurrent ones): those a policy evicts or masks."""
        return [layer for layer in range(self.n_layer) if self.k[layer] is not None]

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
        """After a forward that gave the model `n_tokens` text tokens: count them, then evict (evict="decoding")."""
        self.seen += n_tokens
        self.length = self._filled
        if self.evict_on_commit:
            self.compress()

    def compress(self) -> None:
        """Apply the policy now: every layer keeps its budget of text keys (those it picks), or masks the others."""
        if self.policy.masks:
            self.remask()
        elif self.moves_keys:
            self.evict()

    def text_keys(self, layer: int) -> torch.Tensor:
        """The layer's text keys held, (B, Hkv, L - n_sink, hd) (a view)."""
        return self.k[layer][:, :, self.n_sink:self.length]

    def remask(self) -> None:
        """A masking policy's visible keys, once the cache holds more text keys than its budget."""
        if self.length - self.n_sink <= self.policy.budget:
            return
        if self.choice is None:
            self.choice = self.policy.choose(self.state)
        for layer in self.key_layers():
            keys = self.text_keys(layer)
            B, Hkv = keys.shape[:2]
            sinks = torch.ones(B, Hkv, self.n_sink, dtype=torch.bool, device=keys.device)
            self.visible[layer] = torch.cat([sinks, self.policy.mask(self.state[layer], keys, layer, self.choice)], 2)

    def evict(self) -> None:
        """Keep each layer's picked text keys (and the sink tokens), moved to the front in their order; a layer that
        keeps fewer than the largest has free slots first, masked."""
        n_text = self.length - self.n_sink
        caps = {layer: min(self.policy.capacity(layer, self.n_layer, n_text), n_text) for layer in self.key_layers()}
        if not caps or min(caps.values()) >= n_text:  # nothing to evict (or only recurrent layers)
            return
        width = max(caps.values())
        S = self.n_sink
        for layer, n in caps.items():
            keys = self.text_keys(layer)
            B, Hkv, _, hd = keys.shape
            idx = self.policy.keep(self.state[layer], keys, layer, n)  # (B, Hkv, n), text indices ascending
            free = width - n
            if free:  # the free slots point at the first kept key, masked
                idx = torch.cat([idx[..., :1].expand(B, Hkv, free), idx], dim=-1)
                hidden = torch.zeros(B, Hkv, free, dtype=torch.bool, device=keys.device)
                shown = torch.ones(B, Hkv, S, dtype=torch.bool, device=keys.device)
                self.visible[layer] = torch.cat([shown, hidden, shown.new_ones(B, Hkv, n)], dim=2)
            at = idx[..., None].expand(B, Hkv, width, hd)
            for buf in (self.k[layer], self.v[layer]):  # gathered before the buffer is written
                buf[:, :, S:S + width] = buf[:, :, S:self.length].gather(2, at)
            self.origin[layer] = torch.cat([self.origin[layer][:, :, :S],
                                            self.origin[layer][:, :, S:self.length].gather(2, idx)], dim=2)
            gather_state(self.state[layer], idx, n_text)  # the policy's per-key state follows its keys
        self.length = S + width
