"""KV-cache policies: which keys a cache keeps when it holds more than its budget, each a registered component
(`CACHE_POLICIES`, name -> class) with its own knobs, for `sinklab eval retrieval`, `eval streaming` and `sample`.
Every module of this package is imported, and so registered, here: a new policy is one module (docs/extending.md,
"Add a cache policy"); its class docstring says what it keeps, and the reference pages list it.

The cache (`sinklab.model.kv_cache.KVCache`) asks its policy after a forward (evict while decoding) or once, when told
(`KVCache.compress`: compress the prompt, then ask). A policy sees each layer's keys, the state it keeps per key
(e.g. the attention a key has received) and the positions the keys came in at, and returns the keys to keep: the same
number in every kv head (the cache gathers them, so a step attends to O(budget) keys; positions are re-indexed inside
the cache as StreamingLLM does, RoPE re-rotated at the new places), or, for a policy whose heads keep different numbers
(`masks = True`), a mask over the keys, which never move (their positions stay those they came in at). Learned sink
tokens (model.n_sink_tokens) are always kept, outside the budget; K / KV bias slots and sink logits are not in the
cache at all.

`budget` counts the text keys kept between steps; the token being fed comes on top (a step attends to budget + 1).
What the commands ask of a policy is declared by its class (`CachePolicy`): whether it needs a budget
(`needs_budget`), runs at prefill only (`prefill_only`), keeps different numbers of keys per layer (`per_layer`) or
per head (`masks`), and reads attention maps (`needs_maps`).

Each policy says what it was checked against (`reference`) and where it differs from that code (`differences`,
each naming the knob that switches it, where there is one); `rules` are the knobs that choose between the
reference's rule and another, which `sinklab eval retrieval` records beside every result. The kept keys of the
policies whose `reference` names a press of NVIDIA kvpress 0.5.5 are compared with that press's on one model and
prompt set by tests/model/test_kvpress_parity.py (scripts/kvpress_parity.py runs kvpress in a venv of its own;
.ci/run runs both); docs/cache_policies.md is the table.

Attention-based policies (`needs_maps`) get each forward's attention of its queries over the cached keys through
`observe` (the map the model computes, summed over a GQA group); an op without an explicit map (NSA / DSA, which
keep per-token tensors of their own) is refused by the cache in one line.
"""
from __future__ import annotations

from sinklab.registries import discover

from .base import (CACHE_POLICIES, CachePolicy, CachePolicyRegistry, build, gather_state, grown,  # noqa: F401
                   knob_defaults, newest, with_kept)
from .streaming import Dense, Streaming  # noqa: F401  (first: the dense cache and StreamingLLM lead every listing)

discover(__name__)
