"""TOVA: the latest query's attention (`sinklab.model.cache_policies`)."""
from __future__ import annotations

import torch

from .base import CACHE_POLICIES, CachePolicy, newest, with_kept


@CACHE_POLICIES.register("tova")
class TOVA(CachePolicy):
    """The attention of the latest query, averaged over the layer's heads (state `last`): one kept set per layer;
    with `keep_last`, the latest key is kept whatever its score."""

    needs_maps = True
    rules = ("keep_last",)
    reference = ("TOVA (Oren et al., \"Transformers are Multi-State RNNs\", arXiv 2401.06104; schwartz-lab-NLP/TOVA) "
                 "and kvpress 0.5.5's TOVAPress, which keeps the keys of keep_last=true "
                 "(tests/model/test_kvpress_parity.py)")
    differences = (
        "keep_last=false (the default, TOVA's rule): the latest key competes on its own attention like any other; "
        "kvpress's TOVAPress always keeps it (its comment: 'a very slight difference from TOVA'): keep_last=true",)

    def __init__(self, budget: int, keep_last: bool = False):
        super().__init__(budget)
        self.one_of("keep_last", keep_last, (False, True))
        self.keep_last = keep_last

    def observe(self, state: dict, probs: torch.Tensor) -> None:
        state["last"] = probs[:, :, -1].mean(1, keepdim=True).expand(-1, probs.shape[1], -1)  # (B, Hkv, L)

    def scores(self, state: dict, keys: torch.Tensor, layer: int) -> torch.Tensor:
        last = state["last"]
        return with_kept(last, newest(keys.shape[2], 1, keys)) if self.keep_last else last
