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
  h2o         heavy hitters: the keys with the largest attention accumulated over every query so far (`normalize`:
              divided by how many queries saw each key, as kvpress's ObservedAttentionPress), plus the most recent
              `recent` share of the budget (H2O, arXiv 2306.14048), per kv head
  tova        the keys with the largest attention from the latest query, averaged over the layer's heads (TOVA,
              "Transformers are Multi-State RNNs", arXiv 2401.06104; `keep_last`: the latest key always kept, as
              kvpress's TOVAPress), per layer
  snapkv      the attention of the last `window` queries, summed, average-pooled over `kernel` neighbouring keys; the
              window's own keys always kept (SnapKV, arXiv 2404.14469; kvpress's defaults window 64, kernel 5, here
              scaled to small contexts); `pooling`: the reference code's rule (the keys before the window only, the
              zero padding counted in the mean) or sinklab's (every key, the padding left out), per kv head
  pyramidkv   SnapKV's scores under a budget that shrinks linearly with depth, the mean budget over the layers the
              one given (PyramidKV, arXiv 2406.02069; `schedule`: the PyramidKV code's per-layer sizes, the window on
              top of the pyramid, or kvpress's PyramidKVPress, the window inside it), per kv head
  keynorm     the keys of lowest L2 norm (Devoto et al. 2024, arXiv 2406.11430; kvpress's KnormPress), per kv head
  duo         a per-head split: retrieval heads keep every key, streaming heads the first `first` + the most recent
              `recent` (DuoAttention, arXiv 2410.10819); the `retrieval` share of the heads with the highest score is
              chosen once, when the cache first passes its budget, by the attention a streaming head would lose
              (the mass outside first + recent of the queries seen so far: an on-the-fly score), or named
              (`heads`: [[layer, head], ...])

Each policy says what it was checked against (`reference`) and where it differs from that code (`differences`,
each naming the knob that switches it, where there is one); `rules` are the knobs that choose between the
reference's rule and another, which `sinklab eval retrieval` records beside every result. The kept keys of
streaming, keynorm, snapkv, pyramidkv, h2o and tova are compared with NVIDIA kvpress 0.5.5's presses on one model
and prompt set by tests/model/test_kvpress_parity.py (scripts/kvpress_parity.py runs kvpress in a venv of its own;
.ci/run runs both); docs/cache_policies.md is the table.

Attention-based policies (`needs_maps`) get each forward's attention of its queries over the cached keys through
`observe` (the map the model computes, summed over a GQA group); an op without an explicit map (NSA / DSA, which
keep per-token tensors of their own) is refused by the cache in one line.
"""
from __future__ import annotations

from .base import (CACHE_POLICIES, CachePolicy, CachePolicyRegistry, build, gather_state, grown, newest,  # noqa: F401
                   with_kept)
# each module registers its policies; this order is the registry's (the order errors list them in)
from .streaming import Dense, Streaming, Window  # noqa: F401
from .h2o import HeavyHitters  # noqa: F401
from .tova import TOVA  # noqa: F401
from .snapkv import PyramidKV, SnapKV  # noqa: F401
from .keynorm import KeyNorm  # noqa: F401
from .duo import DuoAttention  # noqa: F401
