"""KV-cache policies: which keys a cache keeps when it holds more than its budget, each a registered component
(`CACHE_POLICIES`, name -> class) with its own knobs, for `sinklab eval retrieval`, `eval streaming` and `sample`.

The cache (`sinklab.model.kv_cache.KVCache`) asks its policy after a forward (evict while decoding) or once, when told
(`KVCache.compress`: compress the prompt, then ask). A policy sees each layer's keys, the state it keeps per key
(e.g. the attention a key has received) and the positions the keys came in at, and returns the keys to keep: the same
number in every kv head (the cache gathers them, so a step attends to O(budget) keys; positions are re-indexed inside
the cache as StreamingLLM does, RoPE re-rotated at the new places), or, for a policy whose heads keep different numbers
(`masks = True`: DuoAttention's per-head split), a mask over the keys, which never move (their positions stay those
they came in at). Learned sink tokens (model.n_sink_tokens) are always kept, outside the budget; K / KV bias slots and
sink logits are not in the cache at all.

`budget` counts the text keys kept between steps; the token being fed comes on top (a step attends to budget + 1).

  dense       never evicts
  streaming   the first `first` + the most recent budget - first (StreamingLLM, arXiv 2309.17453)
  window      the most recent budget (streaming with first = 0)
  h2o         heavy hitters: the keys with the largest attention accumulated over every query so far, plus the most
              recent `recent` share of the budget (H2O, arXiv 2306.14048), per kv head
  tova        the keys with the largest attention from the latest query, averaged over the layer's heads (TOVA,
              "Transformers are Multi-State RNNs", arXiv 2401.06104), per layer
  snapkv      the attention of the last `window` queries, summed, average-pooled over `kernel` neighbouring keys; the
              window's own keys always kept (SnapKV, arXiv 2404.14469; kvpress's defaults window 64, kernel 5, here
              scaled to small contexts), per kv head
  pyramidkv   SnapKV's scores under a budget that shrinks linearly with depth, the mean budget over the layers the
              one given (PyramidKV, arXiv 2406.02069; kvpress's `beta` schedule), per kv head
  keynorm     the keys of lowest L2 norm (Devoto et al. 2024, kvpress's KnormPress), per kv head
  duo         a per-head split: retrieval heads keep every key, streaming heads the first `first` + the most recent
              `recent` (DuoAttention, arXiv 2410.10819); the `retrieval` share of the heads with the highest score is
              chosen once, when the cache first passes its budget, by the attention a streaming cache would lose
              (the mass outside first + recent of the queries seen so far: an on-the-fly score), or named
              (`heads`: [[layer, head], ...])

Attention-based policies (`needs_maps`) get each forward's attention of its queries over the cached keys through
`observe` (the map the model computes, summed over a GQA group); an op without an explicit map (NSA / DSA, which
keep per-token tensors of their own) is refused by the cache in one line.
"""
from __future__ import annotations

import math
from typing import ClassVar, Optional, Sequence

import torch
import torch.nn.functional as F

from sinklab.errors import UserError
from sinklab.registries import NameRegistry


class CachePolicyRegistry(NameRegistry[type["CachePolicy"]]):
    what = "cache policy"
    unknown = UserError


CACHE_POLICIES = CachePolicyRegistry()


class CachePolicy:
    """Which keys a KV cache keeps (module docstring). Subclasses set `needs_maps` and implement `scores` (keep the
    highest) or override `keep`; a policy with knobs declares them as __init__ keyword arguments (checked by
    `build`)."""

    name: ClassVar[str] = ""
    needs_maps: ClassVar[bool] = False  # `observe` each forward's attention map
    masks: ClassVar[bool] = False  # keeps a mask over keys that never move instead of gathering them

    def __init__(self, budget: Optional[int] = None):
        if budget is not None and budget < 1:
            raise UserError(f"cache policy {self.name}: budget {budget} must be >= 1")
        self.budget = budget

    def describe(self) -> dict:
        """The policy and its knobs, as outputs name it."""
        return {"policy": self.name, **{k: v for k, v in vars(self).items() if not k.startswith("_")}}

    def capacity(self, layer: int, n_layer: int, n_text: Optional[int] = None) -> Optional[int]:
        """Text keys layer `layer` keeps after an eviction of n_text held (None: it never evicts)."""
        return self.budget

    def check(self, context: Optional[int]) -> None:
        """Refuse, in one line, knobs that do not fit a model of this context (None: no limit)."""
        if self.budget is not None and context is not None and self.budget >= context:
            raise UserError(f"cache policy {self.name}: budget {self.budget} must be < the model context {context} "
                            "(the token fed comes on top)")

    # --------------------------------------------------------------------------------------------- state
    def observe(self, state: dict, probs: torch.Tensor) -> None:
        """probs (B, Hkv, N, L): the attention of a forward's N queries over the layer's L cached keys (the new ones
        included), summed over each kv head's query heads; update `state` (name -> (..., L) tensors the cache
        gathers along the keys with them)."""

    def scores(self, state: dict, keys: torch.Tensor, layer: int) -> torch.Tensor:
        """(B, Hkv, L) how much each text key is worth keeping (the highest are kept); keys (B, Hkv, L, hd)."""
        raise NotImplementedError

    def keep(self, state: dict, keys: torch.Tensor, layer: int, n: int) -> torch.Tensor:
        """Indices (B, Hkv, n) of the text keys to keep, ascending, out of the L in keys (B, Hkv, L, hd)."""
        top = self.scores(state, keys, layer).topk(n, dim=-1).indices  # (B, Hkv, n)
        return top.sort(dim=-1).values

    def choose(self, states: Sequence[dict]) -> object:
        """What a `masks` policy decides once, from every layer's state, when the cache first passes its budget (the
        cache keeps it and passes it to `mask`); None by default."""
        return None

    def mask(self, state: dict, keys: torch.Tensor, layer: int, choice: object) -> torch.Tensor:
        """(B, Hkv, L) True where a text key stays visible (a `masks` policy); `choice`: what `choose` decided."""
        raise NotImplementedError


def grown(t: Optional[torch.Tensor], shape: Sequence[int], like: torch.Tensor) -> torch.Tensor:
    """t (..., L0) zero-padded along its last dim to `shape` (..., L); zeros of `shape` when None."""
    if t is None:
        return like.new_zeros(shape)
    return F.pad(t, (0, shape[-1] - t.shape[-1]))


def gather_state(state: dict, idx: torch.Tensor, n_keys: int) -> None:
    """A policy's per-key state follows the keys a cache kept: each tensor of `state` whose last dim indexes the
    n_keys keys ((B, Hkv, n_keys) or (B, Hkv, w, n_keys)) is gathered at idx (B, Hkv, n) along that dim, in place."""
    B, Hkv, n = idx.shape
    for name, t in state.items():
        if isinstance(t, torch.Tensor) and t.shape[-1] == n_keys:
            state[name] = t.gather(-1, idx.view(B, Hkv, *[1] * (t.dim() - 3), n).expand(*t.shape[:-1], n))


def newest(n_keys: int, n: int, like: torch.Tensor) -> torch.Tensor:
    """(n,) the indices of the n most recent of n_keys keys."""
    return torch.arange(n_keys - n, n_keys, device=like.device)


def with_kept(scores: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """scores (B, Hkv, L) with the keys `kept` (indices (k,)) raised above every other."""
    scores = scores.clone()
    scores[..., kept] = math.inf
    return scores


@CACHE_POLICIES.register("dense")
class Dense(CachePolicy):
    """Never evicts (budget None)."""

    def __init__(self, budget: Optional[int] = None):
        super().__init__(None)


@CACHE_POLICIES.register("streaming")
class Streaming(CachePolicy):
    """The first `first` text keys and the most recent budget - first (StreamingLLM)."""

    def __init__(self, budget: int, first: int = 4):
        super().__init__(budget)
        if not 0 <= first <= budget:
            raise UserError(f"cache policy {self.name}: first {first} must be in [0, budget {budget}]")
        self.first = first

    def keep(self, state: dict, keys: torch.Tensor, layer: int, n: int) -> torch.Tensor:
        L = keys.shape[2]
        idx = torch.cat([torch.arange(self.first, device=keys.device), newest(L, n - self.first, keys)])
        return idx.expand(*keys.shape[:2], n)  # (B, Hkv, n)


@CACHE_POLICIES.register("window")
class Window(Streaming):
    """The most recent `budget` keys (window attention)."""

    def __init__(self, budget: int):
        super().__init__(budget, first=0)


@CACHE_POLICIES.register("h2o")
class HeavyHitters(CachePolicy):
    """Accumulated attention (state `acc`) plus the most recent `recent` share of the budget (H2O)."""

    needs_maps = True

    def __init__(self, budget: int, recent: float = 0.5):
        super().__init__(budget)
        if not 0.0 <= recent < 1.0:
            raise UserError(f"cache policy {self.name}: recent {recent} must be in [0, 1) (the recent share of the "
                            "budget; the rest are heavy hitters)")
        self.recent = recent

    def observe(self, state: dict, probs: torch.Tensor) -> None:
        B, Hkv, _, L = probs.shape
        state["acc"] = grown(state.get("acc"), (B, Hkv, L), probs) + probs.sum(2)  # (B, Hkv, L)

    def scores(self, state: dict, keys: torch.Tensor, layer: int) -> torch.Tensor:
        n_recent = int(self.recent * self.budget)
        return with_kept(state["acc"], newest(keys.shape[2], n_recent, keys))


@CACHE_POLICIES.register("tova")
class TOVA(CachePolicy):
    """The attention of the latest query, averaged over the layer's heads (state `last`): one kept set per layer."""

    needs_maps = True

    def observe(self, state: dict, probs: torch.Tensor) -> None:
        state["last"] = probs[:, :, -1].mean(1, keepdim=True).expand(-1, probs.shape[1], -1)  # (B, Hkv, L)

    def scores(self, state: dict, keys: torch.Tensor, layer: int) -> torch.Tensor:
        return state["last"]


@CACHE_POLICIES.register("snapkv")
class SnapKV(CachePolicy):
    """The attention of the last `window` queries (state `rows`, (B, Hkv, window, L)), summed and average-pooled over
    `kernel` keys; the window's keys always kept."""

    needs_maps = True

    def __init__(self, budget: int, window: int = 8, kernel: int = 5):
        super().__init__(budget)
        if not 1 <= window <= budget:
            raise UserError(f"cache policy {self.name}: window {window} must be in [1, budget {budget}] (its keys "
                            "are always kept)")
        if kernel < 1 or kernel % 2 == 0:
            raise UserError(f"cache policy {self.name}: kernel {kernel} must be an odd number >= 1")
        self.window, self.kernel = window, kernel

    def observe(self, state: dict, probs: torch.Tensor) -> None:
        B, Hkv, N, L = probs.shape
        rows = grown(state.get("rows"), (B, Hkv, 0 if state.get("rows") is None else state["rows"].shape[2], L), probs)
        state["rows"] = torch.cat([rows, probs], dim=2)[:, :, -self.window:]  # (B, Hkv, <= window, L)

    def pooled(self, state: dict) -> torch.Tensor:
        votes = state["rows"].sum(2)  # (B, Hkv, L)
        B, Hkv, L = votes.shape
        return F.avg_pool1d(votes.reshape(B * Hkv, 1, L), self.kernel, stride=1, padding=self.kernel // 2,
                            count_include_pad=False).view(B, Hkv, L)

    def scores(self, state: dict, keys: torch.Tensor, layer: int) -> torch.Tensor:
        return with_kept(self.pooled(state), newest(keys.shape[2], self.window, keys))


@CACHE_POLICIES.register("pyramidkv")
class PyramidKV(SnapKV):
    """SnapKV under per-layer budgets: beyond the window, layer l keeps max - l * step keys, from max at the first
    layer to min = (budget - window) / beta at the last, their mean over the layers (budget - window); where max is more
    than the prompt holds, max is what it holds and min rises to keep the mean (kvpress)."""

    def __init__(self, budget: int, window: int = 8, kernel: int = 5, beta: float = 20.0):
        super().__init__(budget, window, kernel)
        if beta < 1:
            raise UserError(f"cache policy {self.name}: beta {beta} must be >= 1 (the first layer's share over the "
                            "last's)")
        self.beta = beta

    def capacity(self, layer: int, n_layer: int, n_text: Optional[int] = None) -> int:
        if n_layer == 1:
            return self.budget
        spare = self.budget - self.window
        low = int(spare / self.beta)
        high = 2 * spare - low
        if n_text is not None and high > n_text - self.window:  # the first layers cannot keep more than there is
            high = n_text - self.window
            low = 2 * spare - high
        step = (high - low) / (n_layer - 1)
        return self.window + int(round(high - layer * step))


@CACHE_POLICIES.register("keynorm")
class KeyNorm(CachePolicy):
    """The keys of lowest L2 norm (the cache's keys: before RoPE where they move, after it where they do not; a
    rotation keeps the norm)."""

    def scores(self, state: dict, keys: torch.Tensor, layer: int) -> torch.Tensor:
        return -keys.float().norm(dim=-1)  # (B, Hkv, L)


@CACHE_POLICIES.register("duo")
class DuoAttention(CachePolicy):
    """Retrieval heads keep every key, streaming heads the first `first` + the `recent` most recent (module
    docstring); the budget is that of a streaming head, first + recent (recent: budget - first by default)."""

    needs_maps = True
    masks = True

    def __init__(self, budget: Optional[int] = None, first: int = 4, recent: Optional[int] = None,
                 retrieval: float = 0.5, heads: Optional[list] = None):
        if recent is None:  # a streaming head's recent keys: what the budget leaves after the first, else 16
            recent = 16 if budget is None else budget - first
        if first < 0 or recent < 1:
            raise UserError(f"cache policy duo: first {first} must be >= 0 and recent {recent} >= 1 (budget = first "
                            "+ recent: a streaming head's keys)")
        if not 0.0 <= retrieval <= 1.0:
            raise UserError(f"cache policy duo: retrieval {retrieval} must be in [0, 1] (the share of retrieval heads)")
        super().__init__(first + recent if budget is None else budget)
        if self.budget != first + recent:
            raise UserError(f"cache policy duo: budget {self.budget} must equal first + recent = {first + recent} "
                            "(a streaming head's keys; retrieval heads keep every one)")
        self.first, self.recent, self.retrieval = first, recent, retrieval
        self.heads = None if heads is None else [tuple(int(v) for v in h) for h in heads]

    def capacity(self, layer: int, n_layer: int, n_text: Optional[int] = None) -> Optional[int]:
        return None  # retrieval heads keep every key: nothing is gathered away

    def observe(self, state: dict, probs: torch.Tensor) -> None:
        B, Hkv, N, L = probs.shape
        lost = probs.clone()
        lost[..., :self.first] = 0
        q_pos = torch.arange(L - N, L, device=probs.device)[:, None]  # each query's own position
        k_pos = torch.arange(L, device=probs.device)[None, :]
        lost = lost.masked_fill(k_pos >= q_pos - self.recent, 0)  # the recent keys a streaming head sees
        state["lost"] = state.get("lost", 0) + lost.sum((0, 2, 3))  # (Hkv,): summed over the batch too

    def choose(self, states: Sequence[dict]) -> set:
        """(layer, kv head) of the retrieval heads: those named, or the `retrieval` share of the heads whose
        queries put the most attention where a streaming head keeps no key."""
        if self.heads is not None:
            return set(self.heads)
        ranked = sorted(((float(v), layer, h) for layer, state in enumerate(states)
                         for h, v in enumerate(state.get("lost", ()))), reverse=True)
        n = int(round(self.retrieval * len(ranked)))
        return {(layer, h) for _, layer, h in ranked[:n]}

    def mask(self, state: dict, keys: torch.Tensor, layer: int, choice: object) -> torch.Tensor:
        B, Hkv, L, _ = keys.shape
        visible = torch.zeros(B, Hkv, L, dtype=torch.bool, device=keys.device)
        visible[..., :self.first] = True
        visible[..., max(L - self.recent, 0):] = True
        for h in range(Hkv):
            if (layer, h) in choice:
                visible[:, h] = True
        return visible


def build(name: str, budget: Optional[int], **knobs) -> CachePolicy:
    """The policy `name` with `budget` and its knobs; an unknown knob is one line naming the allowed ones."""
    import inspect

    cls = CACHE_POLICIES.get(name)
    allowed = [p for p in inspect.signature(cls.__init__).parameters if p not in ("self", "budget")]
    bad = [k for k in knobs if k not in allowed]
    if bad:
        raise UserError(f"cache policy {name}: unknown knob {bad[0]!r}; allowed: {', '.join(allowed) or '(none)'}")
    if budget is None and name != "dense" and name != "duo":
        raise UserError(f"cache policy {name}: needs a budget (the text keys kept)")
    return cls(budget, **knobs)
