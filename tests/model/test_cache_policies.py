"""KV-cache policies (sinklab.model.cache_policies): each decodes what a recomputation with the keys it kept gives.

In a 1-layer model a cached key depends on its own token only (RoPE is applied where it sits in the cache), so a
step through an evicting cache equals a fresh forward over the kept tokens, in their order, plus the new one, wherever
every head keeps the same keys: MQA (one kv head) makes that so for the per-head policies. With several kv heads each
head's kept keys are checked against the keys of the tokens the cache says it kept (`origins`)."""
import math

import pytest
import torch

from sinklab.errors import UserError
from sinklab.model import cache_policies as cp
from tests.helpers import small_model, token_ids

BUDGET = 8
KNOBS = {"snapkv": {"window": 3, "kernel": 3}, "pyramidkv": {"window": 3, "kernel": 3},
         "streaming": {"first": 2}, "duo": {"first": 2, "recent": 6}}


def policy(name: str, **extra) -> cp.CachePolicy:
    return cp.build(name, BUDGET, **{**KNOBS.get(name, {}), **extra})


def protocol(name: str) -> str:
    return "prefill" if cp.CACHE_POLICIES.get(name).prefill_only else "decoding"


# the policies that gather the keys they keep (the others keep every key, or a mask over keys that never move)
MOVING = [n for n in cp.CACHE_POLICIES.names() if policy(n).capacity(0, 1) is not None]


@pytest.mark.parametrize("name", MOVING)
@pytest.mark.parametrize("case", [{"pos": "rope"}, {"pos": "alibi", "attn_bias": "kv"}, {"n_sink_tokens": 2}],
                         ids=["rope", "alibi_kv_bias", "sink_tokens"])
def test_a_step_equals_the_forward_of_the_kept_tokens(name, case):
    """MQA, one layer: decoding one token at a time (pyramidkv: a prompt compressed once, then the rest one at a
    time), every step's logits equal the forward of the tokens the cache holds (renumbered 0..) and the new one."""
    m = small_model(n_layer=1, n_kv_head=1, **case)
    idx = token_ids(B=1, T=20)
    cache = m.new_cache(policy=policy(name), evict=protocol(name))
    start = 12 if protocol(name) == "prefill" else 0
    if start:
        m(idx[:, :start], cache=cache)
        cache.compress()
        assert cache.length == m.cfg.n_sink_tokens + BUDGET
    for t in range(start, idx.shape[1]):
        held = cache.origins(0)[0, 0] if cache.length else torch.zeros(0, dtype=torch.long)
        held = held[held >= 0]  # the text tokens held before this step
        out = m(idx[:, t:t + 1], cache=cache)[:, -1]
        kept = torch.cat([idx[0, held], idx[0, t:t + 1]])[None]
        torch.testing.assert_close(out, m(kept)[:, -1], atol=3e-5, rtol=1e-5, msg=f"{name}, token {t}")
        if protocol(name) == "decoding":
            assert cache.length == m.cfg.n_sink_tokens + min(t + 1, BUDGET)


@pytest.mark.parametrize("name", MOVING)
def test_each_kv_head_attends_to_the_keys_of_the_tokens_it_kept(name):
    """Two kv heads that may keep different tokens: the keys and values a step attends to, per head, are the
    dense forward's keys of the tokens the cache says it holds, rotated at their places in the cache."""
    m = small_model(n_layer=1, n_head=4, n_kv_head=2)
    idx = token_ids(B=1, T=18)
    attn = m.blocks[0].attn
    seen = {}
    hooks = [attn.hook_k.register_forward_hook(lambda _m, _i, o: seen.__setitem__("k", o)),
             attn.hook_v.register_forward_hook(lambda _m, _i, o: seen.__setitem__("v", o))]
    raw = {}
    hooks += [attn.k_proj.register_forward_hook(lambda _m, _i, o: raw.__setitem__("k", o)),
              attn.v_proj.register_forward_hook(lambda _m, _i, o: raw.__setitem__("v", o))]
    m(idx)  # the dense forward: every token's key before RoPE and its value, (1, T, Hkv * hd)
    hd = m.cfg.hd
    k_all, v_all = (raw[n].view(1, -1, 2, hd).transpose(1, 2)[0] for n in ("k", "v"))  # (Hkv, T, hd)
    cache = m.new_cache(policy=policy(name), evict=protocol(name))
    differ = False
    for t in range(idx.shape[1]):
        origin = cache.origins(0)[0] if cache.length else torch.zeros(2, 0, dtype=torch.long)  # (Hkv, L)
        m(idx[:, t:t + 1], cache=cache)
        if protocol(name) == "prefill" and t == 10:
            cache.compress()
        L = origin.shape[1] + 1
        rope = m.pos.rotary(L)
        for h in range(2):
            rows = torch.cat([origin[h], torch.tensor([t])])
            want_k = rope(k_all[h, rows][None, None])[0, 0]  # (L, hd) at their places 0 .. L - 1
            torch.testing.assert_close(seen["k"][0, 2 * h], want_k, atol=2e-5, rtol=1e-5)
            torch.testing.assert_close(seen["v"][0, 2 * h], v_all[h, rows], atol=2e-5, rtol=1e-5)
        differ |= bool((origin[0] != origin[1]).any())
    for hook in hooks:
        hook.remove()
    if name in ("h2o", "snapkv", "keynorm", "pyramidkv"):
        assert differ, f"{name}: the two kv heads never kept different tokens (the per-head choice is untested)"


def test_an_attention_policy_keeps_what_its_scores_rank_highest():
    """H2O keeps the recent share plus the keys with the most accumulated attention; keynorm the lowest norms."""
    m = small_model(n_layer=1, n_kv_head=1)
    idx = token_ids(B=1, T=16)
    cache = m.new_cache(policy=cp.build("h2o", 6, recent=0.5), evict="prefill")
    m(idx, cache=cache)
    acc = cache.state[0]["acc"][0, 0]  # (16,) attention received from the 16 queries
    cache.compress()
    heavy = set(acc[:13].topk(3).indices.tolist())
    assert set(cache.origins(0)[0, 0].tolist()) == heavy | {13, 14, 15}
    cache = m.new_cache(policy=cp.build("keynorm", 5), evict="prefill")
    m(idx, cache=cache)
    norms = cache.text_keys(0)[0, 0].norm(dim=-1)
    cache.compress()
    assert set(cache.origins(0)[0, 0].tolist()) == set(norms.topk(5, largest=False).indices.tolist())


def snapkv_state(votes: list[float], window: int) -> dict:
    """A SnapKV state whose window rows sum to `votes` over the keys (one batch row, one kv head)."""
    rows = torch.zeros(1, 1, window, len(votes))
    rows[0, 0, 0] = torch.tensor(votes)
    return {"rows": rows}


def test_snapkv_pools_as_the_reference_code_or_as_sinklab_did():
    """pooling=reference (the default): the votes of the keys before the window, average-pooled over the kernel with
    the zero padding counted (F.avg_pool1d's default, as the SnapKV, PyramidKV and kvpress code pool), the window at
    +inf; pooling=sinklab: every key's votes, the window's included, the padding left out of the mean."""
    votes = [3.0, 0.3, 0.6, 0.0, 1.2, 1.2, 1.2, 0.0, 5.0, 0.0]  # 8 keys before a window of 2
    ref = cp.build("snapkv", 4, window=2, kernel=3).pooled(snapkv_state(votes, 2))[0, 0]
    assert ref.tolist() == pytest.approx([1.1, 1.3, 0.3, 0.6, 0.8, 1.2, 0.8, 0.4, math.inf, math.inf])
    own = cp.build("snapkv", 4, window=2, kernel=3, pooling="sinklab").pooled(snapkv_state(votes, 2))[0, 0]
    assert own.tolist() == pytest.approx([1.65, 1.3, 0.3, 0.6, 0.8, 1.2, 0.8, 6.2 / 3, 5 / 3, 2.5])
    keys = torch.zeros(1, 1, 10, 4)  # the first key kept only where its edge is not divided by the kernel
    for pooling, kept in (("reference", [1, 5, 8, 9]), ("sinklab", [0, 7, 8, 9])):
        p = cp.build("snapkv", 4, window=2, kernel=3, pooling=pooling)
        assert p.keep(snapkv_state(votes, 2), keys, 0, 4)[0, 0].tolist() == kept, pooling


def test_h2o_normalize_divides_by_the_queries_that_saw_each_key():
    """normalize=true (kvpress's ObservedAttentionPress): the attention a key received over the number of queries
    that saw it; a prompt of 5 queries, then one more token, with key 0 always a sink."""
    p = cp.build("h2o", 2, recent=0.0, normalize=True)
    probs = torch.tril(torch.ones(5, 5)) / torch.arange(1, 6)[:, None]  # uniform causal attention
    state = {}
    p.observe(state, probs[None, None])
    assert state["seen"][0, 0].tolist() == [5, 4, 3, 2, 1]
    p.observe(state, torch.full((1, 1, 1, 6), 1 / 6))
    assert state["seen"][0, 0].tolist() == [6, 5, 4, 3, 2, 1]
    mean = p.scores(state, torch.zeros(1, 1, 6, 4), 0)[0, 0]
    torch.testing.assert_close(mean, state["acc"][0, 0] / torch.tensor([6.0, 5, 4, 3, 2, 1]))
    summed = cp.build("h2o", 2, recent=0.0)
    state = {}
    summed.observe(state, probs[None, None])
    assert "seen" not in state and summed.scores(state, torch.zeros(1, 1, 5, 4), 0).argmax() == 0


def test_tova_keep_last_keeps_the_latest_key_whatever_its_score():
    state = {"last": torch.tensor([[[0.5, 0.3, 0.15, 0.05]]])}
    keys = torch.zeros(1, 1, 4, 4)
    assert cp.build("tova", 2).keep(state, keys, 0, 2)[0, 0].tolist() == [0, 1]
    assert cp.build("tova", 2, keep_last=True).keep(state, keys, 0, 2)[0, 0].tolist() == [0, 3]


@pytest.mark.parametrize("budget,window,beta,sizes", [
    (16, 4, 2, [24, 19, 13, 8]), (32, 4, 2, [48, 37, 27, 16]), (32, 8, 20, [56, 40, 24, 8]),
    (16, 8, 20, [16, 16, 16, 16])])
def test_pyramidkv_schedule_kvpress_gives_kvpresss_sizes(budget, window, beta, sizes):
    """schedule=kvpress: the per-layer sizes kvpress 0.5.5's PyramidKVPress kept on a 4-layer model and prompts of
    64 tokens (scripts/kvpress_parity.py's record): the window inside the pyramid, clamped to the prompt, and
    SnapKV's uniform budget where the last layer's share falls below the window (budget 16, beta 20)."""
    p = cp.build("pyramidkv", budget, window=window, beta=beta, schedule="kvpress")
    assert [p.capacity(layer, 4, 64) for layer in range(4)] == sizes
    assert p.capacity(0, 4) >= max(sizes)  # without a prompt length: an upper bound (the cache's room)


def test_pyramidkv_budgets_shrink_with_depth_around_the_budget():
    p = cp.build("pyramidkv", 32, window=4)
    caps = [p.capacity(layer, 4) for layer in range(4)]
    assert caps == sorted(caps, reverse=True) and caps[0] > caps[-1] >= 4
    assert abs(sum(caps) / 4 - 32) <= 1
    m = small_model(n_layer=4, block_size=64)
    cache = m.new_cache(policy=p, evict="prefill")
    m(token_ids(B=1, T=48), cache=cache)
    cache.compress()
    caps = [p.capacity(layer, 4, 48) for layer in range(4)]  # the first layer keeps at most the 48 there are
    assert caps[0] == 48 and abs(sum(caps) / 4 - 32) <= 1
    assert cache.length == max(caps)
    for layer, cap in enumerate(caps):  # a shorter layer's free slots are masked, first
        visible = cache.visible[layer]
        assert (visible is None and cap == max(caps)) or int(visible[0, 0].sum()) == cap
    out = m(token_ids(B=1, T=1, seed=3), cache=cache)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("retrieval", [0.0, 1.0])
def test_duo_streaming_heads_see_first_and_recent_and_retrieval_heads_everything(retrieval):
    """Its keys never move, so positions stay the text's: with every head streaming a 2-layer model decodes the
    full forward under the A-shaped mask (first x + the recent y of each query); with every head retrieving, the
    full forward."""
    m = small_model(n_layer=2, n_kv_head=2)
    idx = token_ids(B=1, T=20)
    first, recent = 2, 6
    cache = m.new_cache(policy=cp.build("duo", None, first=first, recent=recent, retrieval=retrieval))
    outs = torch.cat([m(idx[:, t:t + 1], cache=cache)[:, -1] for t in range(idx.shape[1])])
    ashape = (lambda b, h, q, kv: (kv < first) | (kv >= q - recent)) if retrieval == 0.0 else None
    torch.testing.assert_close(outs, m(idx, extra_mask=ashape)[0], atol=3e-5, rtol=1e-5)
    assert cache.choice == ({(layer, h) for layer in range(2) for h in range(2)} if retrieval else set())


def test_duo_picks_the_heads_that_look_past_the_window():
    """The on-the-fly score: the head whose queries put the most attention outside first + recent retrieves."""
    p = cp.build("duo", None, first=1, recent=2, retrieval=0.5)
    states = [{"lost": torch.tensor([0.1, 3.0])}, {"lost": torch.tensor([0.5, 0.2])}]
    assert p.choose(states) == {(0, 1), (1, 0)}


@pytest.mark.parametrize("name,budget,knobs,match", [
    ("nope", 8, {}, "cache policy 'nope' is unknown; allowed: dense, streaming"),
    ("h2o", 8, {"heavy": 1}, "cache policy h2o: unknown knob 'heavy'; allowed: recent, normalize"),
    ("h2o", None, {}, "cache policy h2o: needs a budget"),
    ("streaming", 4, {"first": 5}, r"first 5 must be in \[0, budget 4\]"),
    ("snapkv", 4, {"window": 5}, r"window 5 must be in \[1, budget 4\]"),
    ("snapkv", 8, {"kernel": 4}, "kernel 4 must be an odd number"),
    ("window", 0, {}, "budget 0 must be >= 1"),
    ("snapkv", 8, {"pooling": "mean"}, "cache policy snapkv: pooling 'mean'; allowed: reference, sinklab"),
    ("pyramidkv", 8, {"schedule": "snapkv"}, "cache policy pyramidkv: schedule 'snapkv'; allowed: pyramidkv, kvpress"),
    ("h2o", 8, {"normalize": 1}, "cache policy h2o: normalize 1; allowed: false, true"),
    ("tova", 8, {"keep_last": "yes"}, "cache policy tova: keep_last 'yes'; allowed: false, true"),
    ("h2o", 8, {"recent": "half"}, "cache policy h2o: recent 'half' must be a number"),
    ("duo", 9, {"first": 2, "recent": 6}, "budget 9 must equal first \\+ recent = 8"),
])
def test_bad_policy_settings_are_one_line(name, budget, knobs, match):
    with pytest.raises(UserError, match=match):
        cp.build(name, budget, **knobs)


def test_every_policy_names_its_reference_and_declares_what_it_needs():
    """Each registered policy says what it was checked against; its rules are knobs it has; it builds without a
    budget exactly where it says it needs none (the reference page, tests/docs/test_reference.py, lists them)."""
    for cls in cp.CACHE_POLICIES:
        assert cls.reference, cls.name
        budget = None if not cls.needs_budget else BUDGET
        assert set(cls.rules) <= set(cp.build(cls.name, budget, **KNOBS.get(cls.name, {})).knobs()), cls.name
        if cls.needs_budget:
            with pytest.raises(UserError, match=f"cache policy {cls.name}: needs a budget"):
                cp.build(cls.name, None, **KNOBS.get(cls.name, {}))


def test_a_budget_as_large_as_the_context_is_refused():
    with pytest.raises(UserError, match="budget 64 must be < the model context 64"):
        cp.build("window", 64).check(64)


def test_an_op_with_its_own_cached_tensors_refuses_an_evicting_policy():
    m = small_model(attn_op="nsa", nsa_slc_topn=3)  # the 3 selection blocks of the context of 24
    with pytest.raises(UserError, match="policy h2o"):
        m(token_ids(B=1, T=4), cache=m.new_cache(policy=cp.build("h2o", 2)))


HF_POLICIES = [n for n in MOVING if cp.CACHE_POLICIES.get(n).uniform()]
PER_LAYER_OR_HEAD = [n for n in cp.CACHE_POLICIES.names() if not cp.CACHE_POLICIES.get(n).uniform()]


@pytest.mark.parametrize("name", HF_POLICIES)
def test_a_transformers_model_decodes_what_the_kept_tokens_give(name):
    """The same exactness for a transformers model (LLaMA, one kv head, one layer): its post-RoPE keys are gathered
    and rotated back by how far each moved; the attention-based policies read the eager kernel's maps."""
    transformers = pytest.importorskip("transformers")
    from sinklab.targets.transformers_cache import HFDecoder

    torch.manual_seed(0)
    m = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=1, max_position_embeddings=64)).eval()
    m.set_attn_implementation("eager")
    idx = token_ids(B=1, T=20, vocab=64)
    dec = HFDecoder(m, policy(name))
    with torch.no_grad():
        for t in range(idx.shape[1]):
            held = dec.kept()[0][0, 0] if t else torch.zeros(0, dtype=torch.long)
            out = dec(idx[:, t:t + 1])[:, -1]
            kept = torch.cat([idx[0, held], idx[0, t:t + 1]])[None]
            torch.testing.assert_close(out, m(input_ids=kept).logits[:, -1], atol=3e-5, rtol=1e-5,
                                       msg=f"{name}, token {t}")


def test_the_policies_that_mask_per_layer_or_head_say_so():
    assert {"pyramidkv", "duo"} <= set(PER_LAYER_OR_HEAD) and "snapkv" not in PER_LAYER_OR_HEAD


@pytest.mark.parametrize("name", PER_LAYER_OR_HEAD)
def test_a_transformers_model_refuses_per_layer_or_per_head_masks(name):
    transformers = pytest.importorskip("transformers")
    from sinklab.targets.transformers_cache import HFDecoder

    m = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=1, max_position_embeddings=64))
    allowed = ", ".join(n for n in cp.CACHE_POLICIES.names() if n not in PER_LAYER_OR_HEAD)
    with pytest.raises(UserError, match=f"cache policy {name}: needs a mask per layer or head.*allowed here: "
                                        f"{allowed}$"):
        HFDecoder(m, policy(name))


@pytest.mark.parametrize("backend", ["sdpa", "flex", "explicit"])
def test_an_attention_policy_reads_maps_on_every_backend(backend):
    """A fused kernel gives no map: the layer computes the map the policy observes through its explicit path, so
    H2O keeps the same tokens and decodes the same logits on every backend."""
    idx = token_ids(B=1, T=16)
    runs = []
    for b in ("explicit", backend):
        m = small_model(n_layer=2, n_kv_head=2, attn_backend=b)
        cache = m.new_cache(policy=cp.build("h2o", 6))
        logits = torch.cat([m(idx[:, t:t + 1], cache=cache)[:, -1] for t in range(16)])
        runs.append((logits, [cache.origins(layer) for layer in range(2)]))
    torch.testing.assert_close(runs[0][0], runs[1][0], atol=2e-5, rtol=1e-5)
    assert all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1]))
