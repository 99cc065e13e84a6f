"""Issue 37's head switches: RoPE on some heads (`model.rope_heads`), a p-RoPE fraction per head
(`model.rope_head_fractions`), NAPE (`model.pos=nape`: ALiBi on some heads, NoPE on the others) and the per-head
output norm (`model.head_norm=rms`). The generic contract (tests/model/test_contracts.py) runs each of them through
every path; this file checks what each computes: which heads see positions, under GQA too, what the head-type
metrics are told (`head_types`, `pair_frequencies`), decoding with a dense cache (with an evicting one:
tests/model/test_cache.py), and the refusals."""
import dataclasses

import pytest
import torch
import torch.nn.functional as F

from sinklab.model import ConfigError, ModelConfig
from sinklab.model.positional import NAPE, Rotary, RotaryAt, alibi_slopes, rope_frequencies
from sinklab.model.registry import POSITIONS
from tests.helpers import SMALL, assert_one_line_error, small_model, token_ids


def x_of(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def moved(layout, pos, index):
    """The layout with its RoPE tables taken at other positions (`index` into the precomputed ones)."""
    return dataclasses.replace(layout, rope=RotaryAt(pos.cos[..., index, :], pos.sin[..., index, :]))


def layer_scores(m, layout, x, layer=0):
    """The attention map (B, H, T, T) of one layer on the hidden states x, through `layout`."""
    attn = m.blocks[layer].attn
    q, k, _ = attn.qkv(x, layout)
    return attn.probs(q, k, layout, torch.arange(x.shape[1]))


# ------------------------------------------------------------------ which heads rotate
@pytest.mark.parametrize("kw, nope", [(dict(rope_heads=[0, 2]), [1, 3]), (dict(rope_heads=1), [1, 2, 3]),
                                      (dict(rope_head_fractions=[1.0, 0.0, 0.5, 0.0]), [1, 3])])
def test_nope_heads_scores_ignore_positions_while_rope_heads_see_them(kw, nope):
    m = small_model(n_layer=1, **kw)
    T, shift = 8, 11
    layout = m.layout(T, torch.device("cpu"))
    shifted = moved(layout, m.pos, torch.arange(shift, shift + T))
    scrambled = moved(layout, m.pos, torch.randperm(T, generator=torch.Generator().manual_seed(0)))
    x = x_of(2, T, 32, seed=3)
    base = layer_scores(m, layout, x)
    rope = [h for h in range(4) if h not in nope]
    for other in (shifted, scrambled):
        assert torch.equal(layer_scores(m, other, x)[:, nope], base[:, nope])
    # the RoPE heads: relative positions only (a shift keeps their scores up to rounding), but a scramble moves each
    torch.testing.assert_close(layer_scores(m, shifted, x)[:, rope], base[:, rope], atol=1e-5, rtol=1e-5)
    for h in rope:
        assert (layer_scores(m, scrambled, x)[:, h] - base[:, h]).abs().max() > 1e-3, h


@pytest.mark.parametrize("rope_heads, rotating", [(1, [0, 1]), ([1], [2, 3])])
def test_query_heads_inherit_their_kv_heads_rotation(rope_heads, rotating):
    """4 query heads on 2 kv heads: query heads 0, 1 read kv head 0 and rotate with it, 2, 3 with kv head 1."""
    m = small_model(n_layer=1, n_kv_head=2, rope_heads=rope_heads)
    assert m.cfg.head_types()[0] == tuple("rope" if h in rotating else "nope" for h in range(4))
    x = x_of(2, 8, 32, seed=1)
    layout = m.layout(8, torch.device("cpu"))
    attn = m.blocks[0].attn
    q, k, _ = attn.qkv(x, layout)  # k repeated to the 4 query heads
    q0, k0, _ = attn.qkv(x, dataclasses.replace(layout, rope=None))  # nothing rotated
    for h in range(4):
        same = h not in rotating
        assert torch.equal(q[:, h], q0[:, h]) == same and torch.equal(k[:, h], k0[:, h]) == same, h
    # a rotating query head and its key head rotate alike: their scores depend on the distance only
    assert m.pos.cos.shape == (4, SMALL["block_size"], 8) and torch.equal(m.pos.cos[rotating[0]],
                                                                          m.pos.cos[rotating[1]])


def test_per_head_fractions_rotate_the_fastest_pairs_of_each_head():
    """Head size 8 (4 pairs): fractions 1, 0.5, 0.25, 0 rotate 4, 2, 1, 0 pairs, at full RoPE's frequencies; the
    unrotated channels (pair i is channels i and i + 4) pass as they are."""
    m = small_model(n_layer=1, rope_head_fractions=[1.0, 0.5, 0.25, 0.0])
    assert m.cfg.head_types() == [("rope", "partial", "partial", "nope")]
    full = rope_frequencies(8, 10000.0)
    for h, pairs in enumerate((4, 2, 1, 0)):
        assert torch.equal(m.pos.inv_freq[h, :pairs], full[:pairs]) and not m.pos.inv_freq[h, pairs:].any()
    x = x_of(2, 4, 10, 8, seed=2)
    rotated = m.pos(x)
    for h, pairs in enumerate((4, 2, 1, 0)):
        still = [c for i in range(pairs, 4) for c in (i, i + 4)]
        moving = [c for i in range(pairs) for c in (i, i + 4)]
        assert torch.equal(rotated[:, h, :, still], x[:, h, :, still])
        assert not moving or (rotated[:, h, 1:, moving] - x[:, h, 1:, moving]).abs().max() > 1e-3


def test_a_spec_whose_heads_are_alike_keeps_the_shared_tables():
    """rope_heads naming every head is full RoPE, equal fractions are rope_fraction: the (T, hd) tables, the same
    logits (and no per-head table built)."""
    idx = token_ids()
    for kw, plain in ((dict(rope_heads=4), dict()), (dict(rope_head_fractions=[0.5] * 4), dict(rope_fraction=0.5))):
        m = small_model(**kw)
        assert m.pos.cos.dim() == 2
        torch.testing.assert_close(m(idx), small_model(**plain)(idx), atol=0, rtol=0)


def test_per_head_tables_are_built_once_and_sliced_per_forward():
    m = small_model(rope_heads=[1], n_kv_head=2)
    cos = m.pos.cos  # (H, positions, hd), built when the model was
    layout = m.layout(10, torch.device("cpu"))
    assert layout.rope.cos.data_ptr() == cos.data_ptr() and layout.rope.cos.shape == (4, 10, 8)
    cache = m.new_cache()
    m(token_ids(T=6), cache=cache)
    step = m.layout(1, torch.device("cpu"), cache)  # a decoding step: a view of the same tables at position 6
    assert step.rope.cos.data_ptr() == cos[:, 6].data_ptr() and m.pos.cos is cos


# ------------------------------------------------------------------ what the head-type metrics are told
@pytest.mark.parametrize("kw, layer, want", [
    (dict(rope_heads=2), 0, ("rope", "rope", "rope", "rope", "nope", "nope", "nope", "nope")),
    (dict(rope_heads=[3], n_kv_head=4), 0, ("nope",) * 6 + ("rope",) * 2),
    (dict(rope_heads=[0, 1], rope_fraction=0.5, nope_every=2), 0, ("partial",) * 4 + ("nope",) * 4),
    (dict(rope_heads=[0, 1], nope_every=2), 1, ("nope",) * 8),
    (dict(rope_head_fractions=[1.0, 0.75, 0.0, 0.25]), 0, ("rope", "rope", "partial", "partial", "nope", "nope",
                                                             "partial", "partial")),
    (dict(pos="nape"), 0, ("alibi",) * 4 + ("nope",) * 4),
    (dict(pos="nape", nape_alibi_heads=[1, 3]), 0, ("nope", "nope", "alibi", "alibi") * 2),
])
def test_head_types_and_pair_frequencies_follow_the_per_head_spec(kw, layer, want):
    """8 query heads on 4 kv heads (unless set), head size 16 (8 pairs): each query head's type, and the frequency
    of each of its pairs is what the model rotates it by (0 on NoPE heads and layers and under ALiBi)."""
    cfg = ModelConfig(**{**SMALL, "n_head": 8, "n_kv_head": 4, "d_model": 128, "n_layer": 2, **kw})
    pos = POSITIONS.selected(cfg)
    assert cfg.head_types()[layer] == want == pos.head_types(cfg, layer)
    freqs = pos.pair_frequencies(cfg, layer)
    assert freqs.shape == (8, 8)
    for h, kind in enumerate(want):
        rotated = int((freqs[h] > 0).sum())
        assert rotated == {"rope": 8, "nope": 0, "alibi": 0}.get(kind, rotated) and (kind != "partial" or 0 < rotated < 8)
    m = cfg.build() if layer == 0 and cfg.pos == "rope" else None
    if m is not None and m.pos.inv_freq.dim() == 2:
        assert torch.equal(m.pos.inv_freq, freqs)  # what the metrics read is what the model rotates by


# ------------------------------------------------------------------ NAPE
def test_nape_gives_the_alibi_heads_geometric_slopes_and_the_others_none():
    m = small_model(pos="nape", n_head=8, d_model=64)  # the first half of 8 heads
    torch.testing.assert_close(m.pos.slopes, torch.cat([alibi_slopes(4), torch.zeros(4)]), atol=0, rtol=0)
    bias = m.pos.logit_bias(torch.arange(6), torch.arange(6))  # (H, R, N)
    assert not bias[4:].any() and (bias[:4].abs().sum((1, 2)) > 0).all()
    gqa = small_model(pos="nape", n_head=8, d_model=64, n_kv_head=4, nape_alibi_heads=[0, 3])  # query heads 0,1,6,7
    want = torch.zeros(8)
    want[[0, 1, 6, 7]] = alibi_slopes(4)
    torch.testing.assert_close(gqa.pos.slopes, want, atol=0, rtol=0)
    assert NAPE.alibi_kv_heads(gqa.cfg) == (0, 3)


def test_nape_nope_heads_scores_ignore_positions():
    """Without rotation a NAPE head's scores depend on positions through its slope only: none on the NoPE heads."""
    m = small_model(n_layer=1, pos="nape")
    x = x_of(2, 8, 32, seed=5)
    layout = m.layout(8, torch.device("cpu"))
    far = dataclasses.replace(layout, logit_bias=lambda q, k: m.pos.logit_bias(q * 3, k * 3))  # distances x 3
    base, spread = layer_scores(m, layout, x), layer_scores(m, far, x)
    assert torch.equal(spread[:, 2:], base[:, 2:]) and (spread[:, :2] - base[:, :2]).abs().max() > 1e-3


# ------------------------------------------------------------------ decoding with a cache
SPECS = [dict(rope_heads=[1], n_kv_head=2), dict(rope_head_fractions=[0.5, 0.0], n_kv_head=2),
         dict(pos="nape", n_kv_head=2), dict(rope_heads=[0, 3], nope_every=2),
         dict(rope_heads=2, layer_pattern="LG", window=5)]


@pytest.mark.parametrize("kw", SPECS, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
def test_dense_cache_decoding_gives_the_full_forward(kw):
    m = small_model(**kw)
    idx = token_ids()
    cache = m.new_cache()
    steps = [m(idx[:, a:b], cache=cache) for a, b in [(0, 6), (6, 9)] + [(t, t + 1) for t in range(9, 24)]]
    torch.testing.assert_close(torch.cat(steps, 1), m(idx), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("kw", SPECS[:3], ids=["rope_heads", "fractions", "nape"])
def test_the_fused_and_explicit_paths_agree_under_gqa(kw):
    idx = token_ids()
    torch.testing.assert_close(small_model(**kw)(idx), small_model(**kw, attn_backend="explicit")(idx),
                               atol=2e-5, rtol=1e-5)


# ------------------------------------------------------------------ refusals, export
@pytest.mark.parametrize("bad, match", [
    (dict(rope_heads=0), r"model.rope_heads=0 rotates no head; allowed: 1..4 of the 4 key/value heads .*model.pos=nope"),
    (dict(rope_heads=[]), r"model.rope_heads=\[\] rotates no head"),
    (dict(rope_heads=5), r"model.rope_heads=5 exceeds the 4 key/value heads"),
    (dict(rope_heads=3, n_kv_head=2), r"model.rope_heads=3 exceeds the 2 key/value heads .*allowed: 1..2"),
    (dict(rope_heads=[0, 4]), r"model.rope_heads=\[0, 4\] names head 4, which does not exist: .* are 0..3"),
    (dict(rope_heads=[1, 1]), r"names a head twice"),
    (dict(rope_heads="half"), r"model.rope_heads=half must be a count of key/value heads .*or a list"),
    (dict(rope_heads=True), r"model.rope_heads=true must be a count"),
    (dict(rope_head_fractions=[1.0, 0.5]), r"must list one fraction per key/value head, 4 of them"),
    (dict(rope_head_fractions=[1.0, 1.5, 0.0, 0.0]), r"1.5 must lie in \[0, 1\]"),
    (dict(rope_head_fractions=[1.0, -0.5, 0.0, 0.0]), r"-0.5 must lie in \[0, 1\]"),
    (dict(rope_head_fractions=[0.0] * 4), r"rotates no head; allowed: a fraction > 0 for some head, or model.pos=nope"),
    (dict(rope_head_fractions=[1.0, 0.1, 0.0, 0.0]), r"0.1 rotates none of the 4 pairs of head size 8; allowed: 0"),
    (dict(rope_head_fractions=[1.0, 0.0, 0.0, 0.0], rope_heads=1), r"two per-head specs"),
    (dict(rope_head_fractions=[1.0, 0.0, 0.0, 0.0], rope_fraction=0.5), r"set rope_fraction=1.0"),
    (dict(rope_heads=2, attn_op="nsa", block_size=32), r"model.rope_heads=2 with model.attn_op=nsa, which rotates keys"),
    (dict(rope_head_fractions=[1.0, 0.0, 1.0, 0.0], attn_op="dsa"), r"with model.attn_op=dsa"),
    (dict(rope_heads=2, layer_pattern="GD", pattern_ops="D:dsa"), r"with model.attn_op=dsa"),
    (dict(pos="alibi", rope_heads=2), r"model.rope_heads=2 applies to model.pos=rope only, got pos=alibi"),
    (dict(pos="nape", nape_alibi_heads=0), r"model.nape_alibi_heads=0 gives ALiBi to no head; .*model.pos=nope"),
    (dict(pos="nape", nape_alibi_heads=[4]), r"model.nape_alibi_heads=\[4\] names head 4, which does not exist"),
    (dict(pos="nape", n_kv_head=1), r"model.pos=nape gives ALiBi to half of the key/value heads, none of n_kv_head=1"),
    (dict(pos="nape", attn_op="kernel"), r"model.attn_op=kernel has no logits to add a model.pos=nape bias to"),
    (dict(nape_alibi_heads=2), r"model.nape_alibi_heads=2 applies to model.pos=nape only"),
    (dict(head_norm="layer"), r"model.head_norm='layer' is not supported; allowed: none, rms"),
])
def test_bad_per_head_settings_are_refused_in_one_line(bad, match):
    with pytest.raises(ConfigError, match=match) as err:
        ModelConfig(**{**SMALL, **bad})
    assert_one_line_error(err)


def test_llama_cannot_represent_a_per_head_spec_nape_or_a_head_norm():
    for kw, line in ((dict(rope_heads=[0, 2]), "model.rope_heads=[0, 2] (LLaMA needs null)"),
                     (dict(rope_head_fractions=[1.0, 0.5, 0.0, 1.0]),
                      "model.rope_head_fractions=[1.0, 0.5, 0.0, 1.0] (LLaMA needs null)"),
                     (dict(pos="nape"), "model.pos=nape (LLaMA needs rope)"),
                     (dict(head_norm="rms"), "model.head_norm=rms (LLaMA needs none)")):
        assert ModelConfig(**SMALL, **kw).llama_mismatches() == [line]


# ------------------------------------------------------------------ the per-head output norm
def o_proj_inputs(m, idx):
    """Each layer's input to o_proj (B, N, H * hd): the heads' outputs after the head norm."""
    seen = []
    hooks = [b.attn.o_proj.register_forward_pre_hook(lambda _m, args: seen.append(args[0])) for b in m.blocks]
    try:
        m(idx)
    finally:
        for h in hooks:
            h.remove()
    return seen


def test_head_norm_at_init_only_normalises_each_heads_output():
    """Same seed, same parameters (the norm's scale is ones and draws nothing); the first layer's o_proj input is
    the plain model's, RMS-normalised per head over its hd channels."""
    plain, normed = small_model(), small_model(head_norm="rms")
    extra = {k: v for k, v in normed.state_dict().items() if k not in plain.state_dict()}
    assert sorted(extra) == [f"blocks.{i}.attn.head_norm.weight" for i in range(2)]
    assert all(torch.equal(v, torch.ones(4, 8)) for v in extra.values())
    assert all(torch.equal(v, normed.state_dict()[k]) for k, v in plain.state_dict().items())
    idx = token_ids()
    o, o_normed = o_proj_inputs(plain, idx)[0], o_proj_inputs(normed, idx)[0]
    heads = o.unflatten(-1, (4, 8))  # (B, N, H * hd) -> (B, N, H, hd)
    torch.testing.assert_close(o_normed, F.rms_norm(heads, (8,), eps=1e-5).flatten(-2), atol=1e-6, rtol=1e-5)
    assert (o_normed - o).abs().max() > 1e-2
    with torch.no_grad():
        normed.blocks[0].attn.head_norm.weight[1].mul_(3.0)  # the scale is per head: head 1's output triples
    o3 = o_proj_inputs(normed, idx)[0].unflatten(-1, (4, 8))
    torch.testing.assert_close(o3[:, :, 1], 3 * o_normed.unflatten(-1, (4, 8))[:, :, 1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(o3[:, :, 0], o_normed.unflatten(-1, (4, 8))[:, :, 0], atol=0, rtol=0)


@pytest.mark.parametrize("kw", [dict(), dict(attn_op="sigmoid"), dict(attn_op="differential"),
                                dict(attn_op="kernel", kernel_map="elu"), dict(attn_op="nsa", block_size=32),
                                dict(attn_op="dsa"), dict(gate="headwise"), dict(attn_bias="v", n_kv_head=2)],
                         ids=["softmax", "sigmoid", "differential", "kernel", "nsa", "dsa", "gate", "v_bias_gqa"])
def test_head_norm_composes_with_every_op_trains_and_decodes(kw):
    m = small_model(head_norm="rms", **kw).train()
    idx = token_ids(B=2, T=17)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    losses = []
    for _ in range(3):
        loss = F.cross_entropy(m(idx[:, :-1]).flatten(0, 1), idx[:, 1:].flatten()) + sum(m.aux_losses.values())
        opt.zero_grad()
        loss.backward()
        for block in m.blocks:
            assert block.attn.head_norm.weight.grad.abs().max() > 0
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0], losses
    assert any(not torch.equal(b.attn.head_norm.weight, torch.ones(4, 8)) for b in m.blocks)
    m.eval()
    cache = m.new_cache()
    steps = [m(idx[:, a:b], cache=cache) for a, b in [(0, 6)] + [(t, t + 1) for t in range(6, 16)]]
    torch.testing.assert_close(torch.cat(steps, 1), m(idx[:, :16]), atol=2e-5, rtol=1e-5)
