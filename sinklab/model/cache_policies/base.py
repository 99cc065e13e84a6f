"""What every KV-cache policy shares (`sinklab.model.cache_policies`, whose docstring says what each keeps): the
interface `CachePolicy`, the registry `CACHE_POLICIES`, `build` (a policy from its name, budget and knobs, checked in
one line) and the helpers the policies use on their per-key state."""
from __future__ import annotations

import inspect
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
    """Which keys a KV cache keeps (`sinklab.model.cache_policies`). Subclasses set `needs_maps` and implement
    `scores` (keep the highest) or override `keep`; a policy with knobs declares them as __init__ keyword arguments
    (checked by `build`), and says what it was checked against and where it differs (`reference`, `differences`,
    `rules`). What the commands ask of a policy is declared here as class attributes (`needs_budget`,
    `prefill_only`, `per_layer`, `masks`), never decided by its name."""

    name: ClassVar[str] = ""
    needs_maps: ClassVar[bool] = False  # `observe` each forward's attention map
    masks: ClassVar[bool] = False  # keeps a mask over keys that never move instead of gathering them
    needs_budget: ClassVar[bool] = True  # `build` refuses it without a budget (else the policy has its own default)
    prefill_only: ClassVar[bool] = False  # a method that compresses once, after the prompt: not run while decoding
    per_layer: ClassVar[bool] = False  # its layers keep different numbers of keys (`capacity` depends on the layer)
    reference: ClassVar[str] = ""  # the method's paper and the code its kept keys were checked against
    differences: ClassVar[tuple[str, ...]] = ()  # where it differs from that code, each naming its knob if any
    rules: ClassVar[tuple[str, ...]] = ()  # knobs choosing the reference's rule or another: recorded per result

    def __init__(self, budget: Optional[int] = None):
        if budget is not None and budget < 1:
            raise UserError(f"cache policy {self.name}: budget {budget} must be >= 1")
        self.budget = budget

    @classmethod
    def uniform(cls) -> bool:
        """Whether every layer and kv head keeps as many keys, gathered: what one attention mask for the whole model
        serves (a transformers model takes no other)."""
        return not cls.masks and not cls.per_layer

    def describe(self) -> dict:
        """The policy and its knobs, as outputs name it."""
        return {"policy": self.name, **{k: v for k, v in vars(self).items() if not k.startswith("_")}}

    def knobs(self) -> dict:
        """Every knob it runs with, the defaults included (what a result records beside the knobs it was given)."""
        return {k: v for k, v in self.describe().items() if k not in ("policy", "budget")}

    def one_of(self, knob: str, value, allowed: Sequence) -> None:
        """Refuse, in one line, a knob value outside `allowed` (a rule's name, or true / false)."""
        if value not in allowed or type(value) is not type(allowed[0]):
            shown = ", ".join(str(a).lower() if isinstance(a, bool) else str(a) for a in allowed)
            raise UserError(f"cache policy {self.name}: {knob} {value!r}; allowed: {shown}")

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


def knob_defaults(cls: type[CachePolicy]) -> dict:
    """A policy's knobs (its __init__ keyword arguments but the budget) -> their defaults."""
    return {p: v.default for p, v in inspect.signature(cls.__init__).parameters.items() if p not in ("self", "budget")}


def build(name: str, budget: Optional[int], **knobs) -> CachePolicy:
    """The policy `name` with `budget` and its knobs; an unknown knob, or a number knob given something else, is one
    line naming the allowed ones."""
    cls = CACHE_POLICIES.get(name)
    params = knob_defaults(cls)
    bad = [k for k in knobs if k not in params]
    if bad:
        raise UserError(f"cache policy {name}: unknown knob {bad[0]!r}; allowed: {', '.join(params) or '(none)'}")
    for knob, value in knobs.items():
        number = isinstance(params[knob], (int, float)) and not isinstance(params[knob], bool)
        if number and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise UserError(f"cache policy {name}: {knob} {value!r} must be a number (default {params[knob]})")
    if budget is None and cls.needs_budget:
        raise UserError(f"cache policy {name}: needs a budget (the text keys kept)")
    return cls(budget, **knobs)
