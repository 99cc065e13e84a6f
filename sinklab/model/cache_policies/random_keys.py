"""A uniformly random subset of the keys: the baseline that knows nothing (`sinklab.model.cache_policies`)."""
from __future__ import annotations

import torch

from .base import CACHE_POLICIES, CachePolicy


@CACHE_POLICIES.register("random")
class RandomKeys(CachePolicy):
    """A uniformly random `budget` of the keys, drawn per kv head from a generator seeded by `seed` (the same seed
    keeps the same keys): each key's score is a uniform draw and the highest are kept. A baseline for the other
    policies: what keeping the budget is worth without reading the attention or the keys. `reseed`: the generator is
    seeded again before every draw (kvpress's rule), so that every layer and every eviction of one length keeps the
    same places."""

    rules = ("reseed",)
    reference = ("kvpress's RandomPress (NVIDIA kvpress, kvpress/presses/random_press.py, as of kvpress 0.4.1: each "
                 "key scored by torch.rand over (batch, kv head, key) from a CPU generator seeded with `seed` at every "
                 "call, the highest kept), whose scores reseed=true draws; not in tests/model/test_kvpress_parity.py's "
                 "record")
    differences = (
        "reseed=false (the default): one generator per policy, seeded once, so each layer and each eviction draws "
        "its own subset; kvpress seeds a fresh generator at every call, so that at one prompt length every layer "
        "keeps the same places: reseed=true",
        "seed 0 by default, so that a run is reproducible; kvpress's default (None) draws from torch's global "
        "generator",
        "the scores are drawn in float32 and moved to the keys' device; kvpress draws them in the keys' dtype (the "
        "same numbers for float32 keys)",
        "under the decoding protocol it evicts after every token, each time a fresh draw over the keys held; kvpress "
        "compresses once, after the prompt (sinklab's prefill protocol)")

    def __init__(self, budget: int, seed: int = 0, reseed: bool = False):
        super().__init__(budget)
        self.one_of("reseed", reseed, (False, True))
        self.seed, self.reseed = seed, reseed
        self._generator = torch.Generator().manual_seed(seed)

    def scores(self, state: dict, keys: torch.Tensor, layer: int) -> torch.Tensor:
        if self.reseed:
            self._generator.manual_seed(self.seed)
        return torch.rand(*keys.shape[:-1], generator=self._generator).to(keys.device)  # (B, Hkv, L)
