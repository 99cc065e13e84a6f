"""The `random` cache policy (sinklab/model/cache_policies/random_keys.py): a uniform, seeded subset of the keys. What
every policy must do (a step equals the forward of the kept tokens, per kv head, in a transformers model too) is
tests/model/test_cache_policies.py's, which runs it without an edit."""
import pytest
import torch

from sinklab.errors import UserError
from sinklab.model import cache_policies as cp
from tests.helpers import small_model, token_ids


def kept(policy: cp.CachePolicy, shape=(1, 2, 20), n: int = 8) -> torch.Tensor:
    """The indices (B, Hkv, n) the policy keeps of keys of `shape` (B, Hkv, L)."""
    return policy.keep({}, torch.zeros(*shape, 4), 0, n)


def test_every_key_is_kept_as_often_as_any_other():
    """Over 4000 draws of 8 of 20 keys each key is kept 0.4 of the time (sd 0.008: within 0.04), and a draw is 8
    distinct keys."""
    policy = cp.build("random", 8)
    draws = torch.cat([kept(policy, (1, 1, 20)) for _ in range(4000)])[:, 0]  # (4000, 8)
    assert all(len(set(d.tolist())) == 8 for d in draws[:50])
    share = torch.bincount(draws.flatten(), minlength=20).float() / len(draws)
    assert (share - 0.4).abs().max() < 0.04, share


def test_the_seed_decides_the_keys_and_each_kv_head_draws_its_own():
    a, b, other = cp.build("random", 8), cp.build("random", 8), cp.build("random", 8, seed=1)
    first = kept(a)
    assert torch.equal(first, kept(b))
    assert not torch.equal(first, kept(other))
    assert not torch.equal(first[0, 0], first[0, 1])
    assert not torch.equal(first, kept(a))  # the generator moves on: the next eviction draws again


def test_reseed_draws_kvpresss_scores_at_every_call():
    """reseed=true: each call scores the keys with torch.rand over (batch, kv head, key) from a generator seeded
    with `seed`, as kvpress's RandomPress does, so every layer keeps the same places."""
    policy = cp.build("random", 8, seed=3, reseed=True)
    keys = torch.randn(2, 2, 20, 4)
    want = torch.rand(2, 2, 20, generator=torch.Generator().manual_seed(3)).topk(8).indices.sort().values
    assert torch.equal(policy.keep({}, keys, 0, 8), want)
    assert torch.equal(policy.keep({}, keys, 1, 8), want)


def test_a_cache_keeps_its_budget_of_random_keys_and_decodes():
    m = small_model(n_layer=2, n_kv_head=2)
    cache = m.new_cache(policy=cp.build("random", 6))
    idx = token_ids(B=1, T=16)
    outs = [m(idx[:, t:t + 1], cache=cache)[:, -1] for t in range(idx.shape[1])]
    assert cache.length == 6 and torch.isfinite(torch.cat(outs)).all()
    held = cache.origins(0)[0]  # (Hkv, 6): the tokens each kv head holds, each head its own draw
    assert held.shape == (2, 6) and not torch.equal(held[0], held[1])


def test_bad_settings_are_one_line():
    with pytest.raises(UserError, match="cache policy random: reseed 'yes'; allowed: false, true"):
        cp.build("random", 8, reseed="yes")
    with pytest.raises(UserError, match="cache policy random: needs a budget"):
        cp.build("random", None)
