"""KV-cache policies (sinklab.model.cache_policies): each decodes what a recomputation with the keys it kept gives.

In a 1-layer model a cached key depends on its own token only (RoPE is applied where it sits in the cache), so a
step through an evicting cache equals a fresh forward over the kept tokens, in their order, plus the new one, wherever
every head keeps the same keys: MQA (one kv head) makes that so for the per-head policies. With several kv heads each
head's kept keys are checked against the keys of the tokens the cache says it kept (`origins`)."""
import pytest
import torch

from sinklab.errors import UserError
from sinklab.model import cache_policies as cp
from tests.helpers import small_model, token_ids

BUDGET = 8
KNOBS = {"snapkv": {"window": 3, "kernel": 3}, "pyramidkv": {"window": 3, "kernel": 3},
         "streaming": {"first": 2}, "duo": {"first": 2, "recent": 6}}
MOVING = [n for n in cp.CACHE_POLICIES.names() if n not in ("dense", "duo")]


def policy(name: str, **extra) -> cp.CachePolicy:
    return cp.build(name, BUDGET, **{**KNOBS.get(name, {}), **extra})


def protocol(name: str) -> str:
    return "prefill" if name == "pyramidkv" else "decoding"


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
    cache = m.new_cache(policy=policy(name), evict="decoding" if name != "pyramidkv" else "prefill")
    differ = False
    for t in range(idx.shape[1]):
        origin = cache.origins(0)[0] if cache.length else torch.zeros(2, 0, dtype=torch.long)  # (Hkv, L)
        m(idx[:, t:t + 1], cache=cache)
        if name == "pyramidkv" and t == 10:
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
    ("h2o", 8, {"heavy": 1}, "cache policy h2o: unknown knob 'heavy'; allowed: recent"),
    ("h2o", None, {}, "cache policy h2o: needs a budget"),
    ("streaming", 4, {"first": 5}, r"first 5 must be in \[0, budget 4\]"),
    ("snapkv", 4, {"window": 5}, r"window 5 must be in \[1, budget 4\]"),
    ("snapkv", 8, {"kernel": 4}, "kernel 4 must be an odd number"),
    ("window", 0, {}, "budget 0 must be >= 1"),
    ("duo", 9, {"first": 2, "recent": 6}, "budget 9 must equal first \\+ recent = 8"),
])
def test_bad_policy_settings_are_one_line(name, budget, knobs, match):
    with pytest.raises(UserError, match=match):
        cp.build(name, budget, **knobs)


def test_a_budget_as_large_as_the_context_is_refused():
    with pytest.raises(UserError, match="budget 64 must be < the model context 64"):
        cp.build("window", 64).check(64)


def test_an_op_with_its_own_cached_tensors_refuses_an_evicting_policy():
    m = small_model(attn_op="nsa")
    with pytest.raises(UserError, match="policy h2o"):
        m(token_ids(B=1, T=4), cache=m.new_cache(policy=cp.build("h2o", 2)))


HF_POLICIES = [n for n in MOVING if n != "pyramidkv"]


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


@pytest.mark.parametrize("name", ["pyramidkv", "duo"])
def test_a_transformers_model_refuses_per_layer_or_per_head_masks(name):
    transformers = pytest.importorskip("transformers")
    from sinklab.targets.transformers_cache import HFDecoder

    m = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=1, max_position_embeddings=64))
    with pytest.raises(UserError, match=f"cache policy {name}: needs a mask per layer or head.*allowed here: "
                                        "dense, streaming, window, h2o, tova, snapkv, keynorm"):
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
