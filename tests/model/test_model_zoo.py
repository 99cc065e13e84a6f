"""One behavioural test per architecture switch (issue: model zoo)."""
import math

import pytest
import torch
from omegaconf import OmegaConf

from sinklab.config import validate_config
from sinklab.metrics import attention_maps
from sinklab.model import FAMILIES, PRESETS, ModelConfig, Transformer
from sinklab.model.positional import Rotary, alibi_slopes
from tests.helpers import REPO, configs, explicit_logits, layer_records, small_model

V = 97


def ids(B=2, T=24, seed=0):
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


def maps(m, idx):
    return attention_maps(m, idx)


def test_window_hides_tokens_before_the_window():
    m = small_model(window=4, n_layer=1)
    idx = ids()
    ref = m(idx)
    changed = idx.clone()
    changed[:, 10] = (changed[:, 10] + 3) % V  # with one layer, outputs i >= 14 cannot see position 10
    out = m(changed)
    torch.testing.assert_close(out[:, 14:], ref[:, 14:])
    assert (out[:, 10:14] - ref[:, 10:14]).abs().max() > 1e-5
    a = maps(m, idx)[0]
    assert torch.all(a[..., 20, :17] == 0) and torch.all(a[..., 20, 17:21] > 0)


def test_prefix_tokens_see_each_other_and_nothing_after():
    m = small_model(prefix_len=5)
    a = maps(m, ids())[0]  # (B, H, T, T)
    assert torch.all(a[..., :5, :5] > 0)  # prefix rows see every prefix column, also later ones
    assert torch.all(a[..., :5, 5:] == 0)  # nothing after the prefix
    assert torch.all(a[..., 10, 11:] == 0)  # causal after the prefix


def test_prefix_loss_skips_first_targets():
    from sinklab.train.module import LitLM

    cfg = dict(vocab_size=V, n_layer=1, n_head=2, d_model=16, d_ff=32, block_size=16, prefix_len=4)
    lit = LitLM(model=cfg, optim=dict(lr=1e-3, weight_decay=0.0), max_steps=1)
    batch = torch.randint(0, V, (2, 17))
    changed = batch.clone()
    changed[:, 1:4] = (changed[:, 1:4] + 1) % V  # targets 0..2 (the first p-1) change; inputs 1..3 too
    logits = lit.model(batch[:, :-1])
    expect = torch.nn.functional.cross_entropy(logits[:, 3:].flatten(0, 1), batch[:, 4:].flatten())
    torch.testing.assert_close(lit.loss(batch), expect)


def test_k_bias_slot_is_seen_by_every_query_and_has_zero_value():
    m = small_model(attn_bias="k")
    a = maps(m, ids())[0]  # (B, H, T, 1 + T)
    assert a.shape[-1] == 25 and torch.all(a[..., :, 0] > 0)
    records = layer_records(m, ids())
    assert torch.all(records[0]["v"][:, :, 0] == 0)  # the K bias slot's value is zero
    assert not torch.all(records[0]["k"][:, :, 0] == 0)


def test_kv_bias_has_learned_value_and_is_not_rotated():
    m = small_model(attn_bias="kv", n_layer=1)
    records = layer_records(m, ids())
    slot_k = records[0]["k"][:, :, 0]
    torch.testing.assert_close(slot_k[0], m.blocks[0].attn.attn_bias.k_bias.detach())  # not rotated by RoPE
    torch.testing.assert_close(records[0]["v"][0, :, 0], m.blocks[0].attn.attn_bias.v_bias.detach())


def test_shared_bias_has_one_vector_for_all_heads():
    assert small_model(attn_bias="kv", attn_bias_shared=True).blocks[0].attn.attn_bias.k_bias.shape == (1, 8)
    assert small_model(attn_bias="kv").blocks[0].attn.attn_bias.k_bias.shape == (4, 8)


@pytest.mark.parametrize("shared", [True, False])
def test_v_bias_shared_adds_one_vector_to_every_head(shared):
    m = small_model(attn_bias="v", attn_bias_shared=shared, n_layer=1)
    attn = m.blocks[0].attn
    assert attn.attn_bias.v_out_bias.shape == ((1, 8) if shared else (4, 8))
    x = torch.randn(1, 6, 32, generator=torch.Generator().manual_seed(0))
    layout = m.layout(6, x.device)
    with torch.no_grad():
        bias = attn.attn_bias.v_out_bias
        bias.copy_(torch.randn(bias.shape, generator=torch.Generator().manual_seed(1)))
        out = attn(x, layout)
        per_head = attn.attn_bias.v_out_bias.expand(4, 8).clone()  # (H, hd): the bias each head's output receives
        attn.attn_bias.v_out_bias.zero_()
        no_bias = attn(x, layout)
    # the difference is o_proj of the heads' biases laid side by side, (H, hd) -> (H * hd,)
    expect = attn.o_proj.weight @ per_head.flatten()
    torch.testing.assert_close(out - no_bias, expect.expand_as(out), atol=1e-6, rtol=1e-5)
    assert shared == bool(torch.all(per_head == per_head[:1]))  # one vector for all heads only when shared


def test_fixed_value_bias_has_the_requested_norm():
    m = small_model(attn_bias="k", attn_bias_fixed_value_scale=5.0)
    records = layer_records(m, ids())
    torch.testing.assert_close(records[0]["v"][:, :, 0].norm(dim=-1), torch.full((2, 4), 5.0))
    assert "v_fixed" not in dict(m.named_parameters())


def test_v_bias_is_added_to_the_attention_output():
    m = small_model(attn_bias="v", n_layer=1)
    attn = m.blocks[0].attn
    x = torch.randn(1, 6, 32)
    layout = m.layout(6, x.device)
    with torch.no_grad():
        out = attn(x, layout)
        attn.attn_bias.v_out_bias.zero_()
        no_bias = attn(x, layout)
    # the bias adds a constant o_proj(v_bias) to every position
    diff = out - no_bias
    torch.testing.assert_close(diff, diff[:, :1].expand_as(diff))
    assert diff.abs().max() > 1e-6


def test_sink_tokens_are_prepended_and_never_predicted():
    m = small_model(n_sink_tokens=2)
    idx = ids()
    logits, probs = m(idx), attention_maps(m, idx)
    assert logits.shape == (2, 24, V)  # only the real tokens are predicted
    assert probs[0].shape[-1] == 26 and torch.all(probs[0][..., 2:, 0] > 0)
    assert m.sink_tokens.requires_grad and m.sink_tokens.shape == (2, 32)


def test_sink_tokens_stay_causal_under_a_prefix():
    m = small_model(n_sink_tokens=2, prefix_len=5)
    idx = ids()
    a = maps(m, idx)[0]  # (B, H, 2 + T, 2 + T): two sink rows, then the real tokens
    assert torch.all(a[..., :2, 2:] == 0)  # sink-token rows see no real token, not even prefix ones
    assert torch.all(a[..., 0, 1] == 0) and torch.all(a[..., 1, :2] > 0)  # causal among the sink tokens
    assert torch.all(a[..., 2:7, :7] > 0) and torch.all(a[..., 2:7, 7:] == 0)  # prefix rows: sinks + prefix
    # the sink tokens' states do not depend on the text, on the fused path and on the explicit one
    changed = idx.clone()
    changed[:, 3] = (changed[:, 3] + 1) % V  # a prefix token
    for explicit in (False, True):
        ref, out = layer_records(m, idx, explicit), layer_records(m, changed, explicit)
        for r, o in zip(ref, out):
            torch.testing.assert_close(o["h"][:, :2], r["h"][:, :2], atol=1e-6, rtol=0)
        assert (out[-1]["h"][:, 2:] - ref[-1]["h"][:, 2:]).abs().max() > 1e-4


def test_nope_has_no_position_parameter_and_is_permutation_equivariant():
    from sinklab.model.masks import prefix_block

    m = small_model(pos="nope")
    assert type(m.pos).__name__ == "NoPositions" and not list(m.pos.parameters())
    assert not any("pos" in n for n, _ in m.named_parameters())
    # without the causal mask, permuting the input permutes the output
    layout = m.layout(24, torch.device("cpu"))
    layout.mask_mod, layout.plain_causal = prefix_block(0, 24), False  # every token sees every token
    x = m.embed(ids(B=1))
    perm = torch.randperm(24)
    block = m.blocks[0]
    with torch.no_grad():
        out = block(x, layout)
        out_p = block(x[:, perm], layout)
    torch.testing.assert_close(out_p, out[:, perm], atol=1e-5, rtol=1e-5)


def test_alibi_slopes_match_the_geometric_sequence():
    torch.testing.assert_close(alibi_slopes(8), torch.tensor([2 ** -(i + 1) for i in range(8)]))
    torch.testing.assert_close(alibi_slopes(4), torch.tensor([2 ** (-2 * (i + 1)) for i in range(4)]))
    assert len(alibi_slopes(6)) == 6


def test_alibi_bias_decays_with_distance():
    m = small_model(pos="alibi")
    layout = m.layout(8, torch.device("cpu"))
    b = layout.bias(torch.arange(8))
    torch.testing.assert_close(b[0, 7, 7 - 3], -3 * alibi_slopes(4)[0])


def test_relative_bias_uses_t5_buckets():
    m = small_model(pos="relative")
    rel = torch.arange(-200, 1)
    buckets = m.pos.bucket(rel)
    assert buckets.max() == 31 and buckets[-1] == 0  # 32 buckets, distance 0 in bucket 0
    assert buckets[0] == buckets[-129]  # beyond max distance 128 all share the last bucket


def rope_reference(x: torch.Tensor, base: float) -> torch.Tensor:
    """x (T, hd) at positions 0..T-1: pair (x_i, x_{i + hd/2}) as a complex number, rotated by pos * base^(-2i/hd)."""
    T, hd = x.shape
    theta = base ** (-2 * torch.arange(hd // 2, dtype=torch.float64) / hd)
    z = torch.complex(x[:, : hd // 2].double(), x[:, hd // 2:].double())
    z = z * torch.exp(1j * torch.arange(T, dtype=torch.float64)[:, None] * theta)
    return torch.cat([z.real, z.imag], dim=-1).float()


def test_rope_scores_depend_only_on_the_offset():
    hd, T = 16, 12
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(hd, generator=g), torch.randn(hd, generator=g)
    rot = Rotary(hd, T)
    rq, rk = rot(q.expand(1, 1, T, hd))[0, 0], rot(k.expand(1, 1, T, hd))[0, 0]  # same vectors at every position
    s = rq @ rk.T  # s[m, n]: query at position m, key at position n
    for offset in range(-T + 1, T):
        d = torch.diagonal(s, offset)  # every (m, m + offset)
        torch.testing.assert_close(d, d[:1].expand_as(d), atol=1e-5, rtol=1e-5)
    assert (torch.diagonal(s, 0)[0] - torch.diagonal(s, -1)[0]).abs() > 1e-3  # and the offset matters


@pytest.mark.parametrize("base", [10000.0, 500.0])
def test_rope_matches_the_rotation_formula_with_base_10000_by_default(base):
    assert ModelConfig().rope_base == 10000.0
    m = small_model() if base == 10000.0 else small_model(rope_base=base)
    x = torch.randn(1, 1, 24, 8, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(m.pos(x)[0, 0], rope_reference(x[0, 0], base), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("pos", ["sinusoidal", "learnable"])
def test_absolute_positions_are_added_to_embeddings(pos):
    m = small_model(pos=pos)
    x = m.embed(torch.zeros(1, 5, dtype=torch.long))
    assert not torch.allclose(x[0, 0], x[0, 1])  # same token, different positions
    assert (pos == "learnable") == any(n.startswith("pos.") for n, _ in m.named_parameters())


def test_post_norm_puts_a_norm_after_each_residual_add():
    m = small_model(norm_position="post")
    assert isinstance(m.norm, torch.nn.Identity)  # no final norm, as in the reference
    calls = []
    for name, mod in m.named_modules():
        if name.endswith(("norm1", "norm2")):
            mod.register_forward_hook(lambda mod, inp, out, name=name: calls.append((name, out)))
    m(ids())
    assert [c[0] for c in calls[:2]] == ["blocks.0.norm1", "blocks.0.norm2"]
    # the block output is the output of its second norm: unit RMS
    records = layer_records(m, ids())
    rms = records[0]["h"].pow(2).mean(-1).sqrt()
    torch.testing.assert_close(rms, torch.ones_like(rms), atol=1e-3, rtol=1e-3)


def test_layernorm_switch():
    assert isinstance(small_model(norm="layer").blocks[0].norm1, torch.nn.LayerNorm)


def test_layernorm_centres_and_scales_each_token_and_rmsnorm_only_scales():
    x = 3 * torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(0)) + 2  # mean 2, std 3 per token
    ln = small_model(norm="layer", norm_eps=1e-6).blocks[0].norm1
    rms = small_model().blocks[0].norm1
    assert ln.eps == 1e-6 and torch.all(ln.weight == 1)  # the affine part is the identity at init
    with torch.no_grad():
        y, z = ln(x), rms(x)
    torch.testing.assert_close(y.mean(-1), torch.zeros(2, 5), atol=1e-5, rtol=0)
    torch.testing.assert_close(y.var(-1, unbiased=False), torch.ones(2, 5), atol=1e-4, rtol=0)
    assert z.mean(-1).abs().min() > 0.2  # RMSNorm keeps each token's mean ...
    torch.testing.assert_close(z.pow(2).mean(-1), torch.ones(2, 5), atol=1e-4, rtol=0)  # ... and fixes its RMS


@pytest.mark.parametrize("ffn,gated", [("relu", False), ("gelu", False), ("swish", False),
                                       ("reglu", True), ("geglu", True), ("swiglu", True)])
def test_ffn_types(ffn, gated):
    from sinklab.model import FFNS

    # the activations written out, independent of the module's own `act`
    relu = lambda h: h.clamp(min=0)  # noqa: E731
    gelu = lambda h: 0.5 * h * (1 + torch.erf(h / math.sqrt(2)))  # noqa: E731  (exact, erf form)
    swish = lambda h: h / (1 + torch.exp(-h))  # noqa: E731
    act = {"relu": relu, "gelu": gelu, "swish": swish, "reglu": relu, "geglu": gelu, "swiglu": swish}[ffn]
    torch.manual_seed(0)
    f = FFNS.get(ffn)(8, 16)
    assert f.gated == gated and (f.w3 is not None) == gated
    x = torch.randn(3, 8)
    h = act(x @ f.w1.weight.T)  # (3, 16)
    if gated:
        h = h * (x @ f.w3.weight.T)
    with torch.no_grad():
        torch.testing.assert_close(f(x), h @ f.w2.weight.T, atol=1e-6, rtol=1e-5)


def test_heads_independent_of_width_and_gqa():
    m = small_model(n_head=2, head_dim=24)
    assert m.blocks[0].attn.q_proj.weight.shape == (48, 32)
    g = small_model(n_head=4, n_kv_head=2)
    assert g.blocks[0].attn.k_proj.weight.shape == (16, 32)
    k = layer_records(g, ids())[0]["k"]
    torch.testing.assert_close(k[:, 0], k[:, 1])  # heads 0 and 1 share a kv head


def test_softmax_scale_sharpens():
    a1 = maps(small_model(softmax_scale=1.0), ids())[0]
    a4 = maps(small_model(softmax_scale=4.0), ids())[0]
    ent = lambda a: -(a.clamp_min(1e-12).log() * a).sum(-1).mean()  # noqa: E731
    assert ent(a4) < ent(a1)


def test_sigmoid_rows_do_not_sum_to_one_unless_normalised():
    a = maps(small_model(attn_op="sigmoid"), ids())[0]
    assert (a.sum(-1) - 1).abs().max() > 0.1
    assert torch.all(a.triu(1) == 0)  # still causal
    an = maps(small_model(attn_op="sigmoid", attn_normalize=True), ids())[0]
    torch.testing.assert_close(an.sum(-1), torch.ones_like(an.sum(-1)))


def test_sigmoid_bias_shifts_scores():
    a0 = maps(small_model(attn_op="sigmoid"), ids())[0]
    ab = maps(small_model(attn_op="sigmoid", sigmoid_bias=-3.0), ids())[0]
    assert ab.sum() < a0.sum()


def test_elu_plus_one_is_positive_and_unnormalised():
    a = maps(small_model(attn_op="elu"), ids())[0]
    causal = torch.ones(24, 24).tril().bool()
    assert torch.all(a[..., causal] > 0) and (a.sum(-1) - 1).abs().max() > 0.1


def test_elu_plus_one_normalised_rows_sum_to_one():
    a = maps(small_model(attn_op="elu", attn_normalize=True), ids())[0]
    torch.testing.assert_close(a.sum(-1), torch.ones_like(a.sum(-1)))
    assert torch.all(a.triu(1) == 0) and torch.all(a[..., torch.ones(24, 24).tril().bool()] > 0)


@pytest.mark.parametrize("kmap", ["identity", "elu", "mlp"])
def test_kernel_attention_normalisation(kmap):
    m = small_model(attn_op="kernel", kernel_map=kmap, attn_normalize=True)
    a = maps(m, ids())[0]
    s = a.sum(-1)
    if kmap == "elu":
        torch.testing.assert_close(s, torch.ones_like(s))
    else:  # divided by max(|row sum|, 1)
        assert s.abs().max() <= 1 + 1e-5
    assert (kmap == "mlp") == hasattr(m.blocks[0].attn.op, "phi")


def test_kernel_identity_can_be_negative():
    a = maps(small_model(attn_op="kernel", kernel_map="identity"), ids())[0]
    assert (a < 0).any()


def test_gated_attention():
    from sinklab.model import GATES

    for gate, out in (("headwise", 4), ("elementwise", 32)):
        m = small_model(gate=gate)
        attn = m.blocks[0].attn
        assert attn.gate_proj.out_features == out
        x = torch.randn(2, 6, 32)
        layout = m.layout(6, x.device)
        with torch.no_grad():
            attn.gate_proj.weight.zero_()  # gate = sigmoid(0) = 1/2 everywhere
            gated = attn(x, layout)
            attn.gate_proj = GATES.get("none")(m.cfg)
            plain = attn(x, layout)
        torch.testing.assert_close(gated, 0.5 * plain)


@pytest.mark.parametrize("kind", ["learned", "zero"])
def test_sink_logit_absorbs_mass(kind):
    m = small_model(sink_logit=kind)
    a = maps(m, ids())[0]
    assert torch.all(a.sum(-1) < 1) and torch.all(a.sum(-1) > 0)
    assert (kind == "learned") == hasattr(m.blocks[0].attn.op, "sink_logit")
    if kind == "zero":  # softmax-off-by-one: row sum = sum e^s / (1 + sum e^s)
        records = layer_records(m, ids())
        q, k = records[0]["q"], records[0]["k"]
        s = (q @ k.transpose(-1, -2)) / (8 ** 0.5)
        s = s.masked_fill(~torch.ones(24, 24).tril().bool(), float("-inf"))
        e = s.exp().sum(-1)
        torch.testing.assert_close(a.sum(-1), e / (1 + e), atol=1e-5, rtol=1e-5)


def test_softpick_rectifies_and_excludes_masked_positions():
    a = maps(small_model(attn_op="softpick"), ids())[0]
    assert (a == 0).float()[..., torch.ones(24, 24).tril().bool()].mean() > 0.05  # some visible keys get exactly 0
    assert torch.all(a.triu(1) == 0) and torch.all(a.sum(-1) <= 1 + 1e-5)


# every switch that keeps plain softmax (ModelConfig.can_fuse), alone and with the masks it composes with
POSITIONS = ("rope", "nope", "sinusoidal", "learnable", "alibi", "relative")
SWITCHES = [dict(pos=p) for p in POSITIONS[1:]] + [
    dict(window=5, pos=p) for p in POSITIONS] + [dict(prefix_len=4, pos=p) for p in POSITIONS] + [
    dict(prefix_len=4, window=3), dict(prefix_len=4, window=3, pos="alibi"),
    dict(prefix_len=4, window=3, pos="relative"),
    dict(attn_bias="k"), dict(attn_bias="kv"), dict(attn_bias="v"), dict(attn_bias="k", attn_bias_shared=True),
    dict(attn_bias="kv", attn_bias_shared=True), dict(attn_bias="v", attn_bias_shared=True),
    dict(attn_bias="k", attn_bias_fixed_value_scale=5.0), dict(attn_bias="k", window=5),
    dict(attn_bias="kv", prefix_len=4, pos="relative"), dict(prefix_len=3, attn_bias="kv", pos="alibi"),
    dict(n_sink_tokens=2), dict(n_sink_tokens=1, window=4), dict(n_sink_tokens=2, prefix_len=4),
    dict(n_sink_tokens=2, prefix_len=4, window=3, attn_bias="kv", pos="alibi"),
    dict(gate="headwise"), dict(gate="elementwise"), dict(n_kv_head=2), dict(n_kv_head=1, attn_bias="kv"),
    dict(head_dim=12), dict(n_head=2, head_dim=6, n_kv_head=1, window=5),
    dict(norm="layer"), dict(norm_position="post"), dict(norm_position="post", norm="layer"),
    dict(softmax_scale=2.0), dict(rope_base=500.0),
] + [dict(ffn=f) for f in ("relu", "gelu", "swish", "reglu", "geglu")]


@pytest.mark.parametrize("sw", SWITCHES, ids=lambda d: ",".join(f"{k}={v}" for k, v in d.items()))
def test_fused_and_explicit_agree_for_every_switch(sw):
    m = small_model(**sw)
    idx = ids()
    torch.testing.assert_close(m(idx), explicit_logits(m, idx), atol=2e-5, rtol=1e-5)


def test_fused_path_is_used_only_where_sdpa_applies():
    assert ModelConfig(attn_op="softmax").can_fuse
    assert not ModelConfig(attn_op="sigmoid").can_fuse
    assert not ModelConfig(sink_logit="zero").can_fuse
    assert not ModelConfig(attn_op="softpick").can_fuse


# ------------------------------------------------------------------ explicit path in query-row chunks
EXPLICIT = [dict(attn_op="sigmoid"), dict(attn_op="sigmoid", attn_normalize=True, sigmoid_bias=-2.0),
            dict(attn_op="elu"), dict(attn_op="softpick"), dict(sink_logit="learned"), dict(sink_logit="zero"),
            dict(attn_op="kernel", kernel_map="identity"),
            dict(attn_op="kernel", kernel_map="elu", attn_normalize=True),
            dict(attn_op="kernel", kernel_map="mlp", attn_normalize=True)]
MASKS = [dict(), dict(window=5), dict(prefix_len=4), dict(n_sink_tokens=2, prefix_len=4, window=5, attn_bias="kv")]


@pytest.mark.parametrize("mask", MASKS, ids=lambda d: ",".join(f"{k}={v}" for k, v in d.items()) or "causal")
@pytest.mark.parametrize("op", EXPLICIT, ids=lambda d: ",".join(f"{k}={v}" for k, v in d.items()))
def test_chunked_explicit_path_equals_the_full_map(op, mask):
    if op.get("attn_op") != "kernel" and mask.get("attn_bias"):
        mask = {**mask, "pos": "alibi"}  # logit ops also take an additive position bias per chunk
    m = small_model(**op, **mask)
    idx = ids()
    full = m(idx)  # row_chunk 256 > N: every query row's map at once
    for block in m.blocks:
        block.attn.row_chunk = 5  # chunks that do not divide N = 24 or 26
    chunked = m(idx)
    # the paths sum in other orders: up to 1.3e-6 apart with ATEN_CPU_CAPABILITY=default (softpick with a KV bias,
    # prefix and window), within 1e-6 with the AVX-512 kernels
    torch.testing.assert_close(chunked, full, atol=1e-5, rtol=0)


def test_chunked_explicit_path_never_holds_a_full_map():
    m = small_model(attn_op="sigmoid", n_sink_tokens=2, attn_bias="kv")  # keys: 1 slot + 2 sinks + 24 tokens
    for block in m.blocks:
        block.attn.row_chunk = 5
    shapes = []

    def pack(t):
        shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):  # every tensor kept for backward
        m(ids()).sum().backward()
    maps_ = [sh for sh in shapes if len(sh) == 4 and sh[-1] == 27]  # (B, H, rows, keys)
    assert maps_ and max(sh[-2] for sh in maps_) == 5


# ------------------------------------------------------------------ every preset in conf/model/
CONF = REPO / "conf" / "model"
SIZES = ["tiny", "14m", "60m", "1b"]
GROUP_FILES = sorted(p.relative_to(CONF).with_suffix("").as_posix() for p in CONF.glob("*/*.yaml"))


def test_switch_files_only_set_model_keys():
    for name in GROUP_FILES:
        assert (CONF / f"{name}.yaml").read_text().startswith("# @package model"), name


def choice(name: str) -> str:
    """`model=<size>` or `model/<group>=<option>` for a size or a switch file (`pos/rope`)."""
    return "model/{}={}".format(*name.split("/")) if "/" in name else f"model={name}"


def compose(name: str, **overrides) -> dict:
    """The model node as `sinklab-train model=<size>` or `model/<group>=<option>` composes it (Hydra; the choice is
    composed once per process, the vocabulary and `overrides` set by Hydra's value-override stage: tests/helpers)."""
    extra = [f"model.{k}={v}" for k, v in {"vocab_size": V, **overrides}.items()]
    return OmegaConf.to_container(configs.job_config((choice(name),), extra).model, resolve=True)


def forward_backward(cfg: ModelConfig, T: int) -> None:
    torch.manual_seed(0)
    m = Transformer(cfg)
    idx = ids(B=2, T=T + 1)
    logits = m(idx[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), idx[:, 1:].flatten())
    loss = loss + sum(m.aux_losses.values())  # as training adds them (an indexer learns from its KL alone)
    loss.backward()
    assert torch.isfinite(loss)
    for name, p in m.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        assert p.grad.abs().max() > 0, f"{name} gets no gradient"


@pytest.mark.parametrize("size", SIZES)
def test_every_size_preset_builds_and_trains_one_step(size):
    full = ModelConfig.from_dict(compose(size))  # the preset's own values validate
    assert {k: getattr(full, k) for k in PRESETS[size]} == PRESETS[size]  # and match sinklab.model.PRESETS
    # one layer at the preset's width and heads (1b: ~50M parameters, still a CPU step)
    forward_backward(ModelConfig.from_dict(compose(size, n_layer=1)), T=8)


@pytest.mark.parametrize("name", GROUP_FILES)
def test_every_switch_preset_builds_and_trains_one_step(name):
    """Each switch file composes into a config the training entry accepts, every key it writes reaches the composed
    model node, and the model it selects trains a step."""
    full = configs.composed(choice(name))
    node = OmegaConf.load(CONF / f"{name}.yaml")
    assert len(node), f"conf/model/{name}.yaml sets nothing"
    for key, value in node.items():
        assert full.model[key] == value, (name, key)
    depth = len(full.model.get("layer_pattern") or "")  # a pattern longer than the default depth: as deep as it
    validate_config(configs.job_config((choice(name),), [f"model.n_layer={depth}"]) if depth > full.model.n_layer
                    else full)
    model = compose(name)  # pos/rope_nope2: its NoPE layer is the 2nd; model/layers: the pattern's letters
    n_layer = max(2, model.get("nope_every") or 0, len(model.get("layer_pattern") or ""))
    cfg = ModelConfig.from_dict({**model, "n_layer": n_layer})  # no model yaml interpolates n_layer
    forward_backward(cfg, T=20)  # longer than mask/prefix's 8 tokens; mask/window's 16 hides the first tokens


@pytest.mark.parametrize("registry", FAMILIES, ids=lambda r: r.key)
def test_a_config_file_selects_every_component(registry):
    """Every registered component of a family (sinklab.model.FAMILIES) has a conf/model/<group>/ file that selects
    it in the composed model config."""
    files = sorted(p.stem for p in (CONF / registry.group).glob("*.yaml"))
    selected = {configs.composed(f"model/{registry.group}={f}").model[registry.key] for f in files}
    assert set(registry.names()) <= selected, f"no conf/model/{registry.group}/*.yaml selects " \
                                              f"{sorted(set(registry.names()) - selected)}"
