"""The KV cache's eviction (StreamingLLM: keep the first tokens and the recent ones, positions re-indexed inside the
cache) and dense decoding past the training context. That a cache that never evicts gives the full forward's logits
for every component is a contract test (tests/model/test_contracts.py)."""
import pytest
import torch

from sinklab.model.kv_cache import KVCache
from tests.helpers import small_model, token_ids


@pytest.mark.parametrize("case", [{}, {"n_sink_tokens": 2}, {"attn_bias": "kv", "pos": "alibi"},
                                  {"rope_heads": [1], "n_kv_head": 2},
                                  {"rope_head_fractions": [0.5, 0.0], "n_kv_head": 2}, {"pos": "nape", "n_kv_head": 2}],
                         ids=["rope", "sink_tokens", "kv_bias_alibi", "rope_heads_gqa", "head_fractions_gqa", "nape_gqa"])
def test_an_evicting_cache_reindexes_the_kept_tokens(case):
    """In a 1-layer model a cached key depends on its token only (RoPE is applied at read time), so streaming with
    x first and y recent tokens equals the full forward of [first x] + [last y] + the new token, renumbered 0.. (with a
    per-head RoPE spec each kept key takes its kv head's table)."""
    m = small_model(n_layer=1, **case)
    idx = token_ids(B=2, T=20)
    x, y = 2, 5
    cache = m.new_cache(keep_first=x, recent=y)
    for t in range(idx.shape[1]):
        out = m(idx[:, t:t + 1], cache=cache)[:, -1]
        kept = idx[:, :t + 1] if t < x + y else torch.cat([idx[:, :x], idx[:, t - y:t], idx[:, t:t + 1]], dim=1)
        torch.testing.assert_close(out, m(kept)[:, -1], atol=2e-5, rtol=1e-5, msg=f"token {t}")
        assert cache.length == m.cfg.n_sink_tokens + min(t + 1, x + y)
    assert cache.seen == idx.shape[1]


def test_window_attention_is_the_cache_without_first_tokens():
    m = small_model(n_layer=1)
    idx = token_ids(B=1, T=12)
    cache = m.new_cache(keep_first=0, recent=4)
    for t in range(idx.shape[1]):
        out = m(idx[:, t:t + 1], cache=cache)[:, -1]
    torch.testing.assert_close(out, m(idx[:, -5:])[:, -1], atol=2e-5, rtol=1e-5)


def test_dense_decoding_goes_past_the_context_with_rope_and_stops_with_absolute_positions():
    m = small_model(block_size=8)
    cache = m.new_cache()
    for t in range(12):  # RoPE tables are computed past the 8 precomputed positions
        out = m(token_ids(B=1, T=1, seed=t), cache=cache)
    assert torch.isfinite(out).all() and cache.length == 12
    learned = small_model(block_size=8, pos="learnable")
    cache = learned.new_cache()
    learned(token_ids(B=1, T=8), cache=cache)
    with pytest.raises(ValueError, match=r"position 8 is past the 8 positions .*allowed: a cache that evicts"):
        learned(token_ids(B=1, T=1), cache=cache)


def test_a_prefix_lm_decodes_only_after_a_prompt_that_covers_the_prefix():
    m = small_model(prefix_len=4)
    cache = m.new_cache()
    m(token_ids(B=1, T=3), cache=cache)
    with pytest.raises(ValueError, match="model.prefix_len=4"):
        m(token_ids(B=1, T=1), cache=cache)


@pytest.mark.parametrize("kw", [{"keep_first": 4}, {"recent": 8}, {"keep_first": -1, "recent": 8},
                                {"keep_first": 4, "recent": 0}])
def test_a_half_or_negative_eviction_policy_is_refused(kw):
    with pytest.raises(ValueError, match="KVCache: keep_first="):
        KVCache(2, **kw)
