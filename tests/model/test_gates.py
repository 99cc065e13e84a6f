"""Gates at Qwen's positions G1 .. G5 (sinklab/model/gates.py) checked against the paper's formula computed by hand
from the module's weights, the gate statistics (sinklab/metrics/gates.py) and clipped softmax (ops/clipped_softmax)."""
import json

import pytest
import torch
import torch.nn.functional as F

from sinklab.metrics import attention_maps

from sinklab.metrics.gates import gate_stats, record_gates
from sinklab.model import ATTENTION_OPS, ConfigError, ModelConfig
from tests.helpers import SMALL, assert_one_line_error, run_cli, small_model, token_ids

H, HD, D = 4, 8, 32  # SMALL's heads, head width and model width
ACTS = {"sigmoid": torch.sigmoid, "silu": F.silu}


def block0_inputs(m, idx, records=None):
    """Run the model; return block 0's input h, its attention's input X and output, and the forward's result;
    `records` (a list) receives block 0's q, k, v as the operation sees them (its hook points)."""
    seen = {}
    hooks = [m.blocks[0].register_forward_pre_hook(lambda mod, args: seen.update(h=args[0])),
             m.blocks[0].attn.register_forward_hook(lambda mod, args, out: seen.update(x=args[0], out=out))]
    if records is not None:
        records.append({})
        attn = m.blocks[0].attn
        hooks += [point.register_forward_hook(lambda mod, args, out, name=name: records[0].update({name: out}))
                  for point, name in ((attn.hook_q, "q"), (attn.hook_k, "k"), (attn.hook_v, "v"))]
    with torch.no_grad():
        result = m(idx)
    for h in hooks:
        h.remove()
    return seen["h"], seen["x"], seen["out"], result


def rms_normed(m, h):
    """The block's RMSNorm by hand: h / sqrt(mean h^2 + eps) * weight."""
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + m.cfg.norm_eps) * m.blocks[0].norm1.weight


def per_head_scores(x, w, heads, act="sigmoid"):
    """act(x W_theta) by hand, head by head: W_theta's rows heads x width -> (B, heads, N, width)."""
    width = w.shape[0] // heads
    return torch.stack([ACTS[act](x @ w[j * width:(j + 1) * width].T) for j in range(heads)], dim=1)


@pytest.mark.parametrize("gate,shared,act", [("headwise", False, "sigmoid"), ("elementwise", False, "sigmoid"),
                                             ("headwise", True, "sigmoid"), ("elementwise", True, "sigmoid"),
                                             ("elementwise", False, "silu"), ("headwise", False, "silu")])
def test_g1_is_the_reference_formula_on_the_normed_block_input(gate, shared, act):
    """Y' = Y * act(X W_theta), X the block's input after its norm (the query projection's input), Y the heads'
    SDPA outputs concatenated, then the output projection; computed by hand from the weights."""
    m = small_model(gate=gate, gate_shared=shared, gate_act=act, pos="nope")
    with torch.no_grad():
        m.blocks[0].norm1.weight.uniform_(0.5, 1.5)  # a norm that is not the identity's scale
    h, x, out, _ = block0_inputs(m, token_ids())
    torch.testing.assert_close(x, rms_normed(m, h))  # the gate reads the normed input
    attn = m.blocks[0].attn
    B, N, _ = x.shape
    q, k, v = ((x @ p.weight.T).view(B, N, H, HD).transpose(1, 2) for p in (attn.q_proj, attn.k_proj, attn.v_proj))
    s = (q @ k.transpose(-1, -2)) / HD ** 0.5
    s = s.masked_fill(~torch.ones(N, N, dtype=torch.bool).tril(), float("-inf"))
    y = (torch.softmax(s, -1) @ v).transpose(1, 2).reshape(B, N, H * HD)  # heads concatenated
    g = ACTS[act](x @ attn.gate_proj.weight.T)  # (B, N, width): the paper's act(X W_theta)
    expected_width = {("headwise", False): H, ("elementwise", False): H * HD,
                      ("headwise", True): 1, ("elementwise", True): HD}[gate, shared]
    assert g.shape[-1] == expected_width
    if gate == "headwise":  # one score per head: the same for the head's hd channels
        g = g.repeat_interleave(HD, -1) if not shared else g.expand(B, N, H * HD)
    elif shared:  # one hd-vector for every head
        g = g.repeat(1, 1, H)
    torch.testing.assert_close(out, (y * g) @ attn.o_proj.weight.T, atol=1e-6, rtol=1e-5)
    assert isinstance(attn.gate_proj.gate_act, {"sigmoid": torch.nn.Sigmoid, "silu": torch.nn.SiLU}[act])


@pytest.mark.parametrize("gate", ["headwise", "elementwise"])
@pytest.mark.parametrize("shared", [False, True])
def test_g2_g3_g4_gate_the_projections_before_rope_and_the_kv_heads_under_gqa(gate, shared):
    """q, k, v as recorded (after RoPE, kv heads repeated) are the gated projections: G4 / G3 before RoPE, G2 / G3
    per kv head, repeated to their query heads after the gate."""
    kv = 2
    for position, name in (("G4", "q"), ("G3", "k"), ("G2", "v")):
        m = small_model(gate=gate, gate_shared=shared, gate_position=position, n_kv_head=kv)
        records = []
        _, x, _, _ = block0_inputs(m, token_ids(), records=records)
        attn = m.blocks[0].attn
        heads = H if name == "q" else kv
        proj = getattr(attn, f"{name}_proj")
        B, N, _ = x.shape
        plain = (x @ proj.weight.T).view(B, N, heads, HD).transpose(1, 2)
        g = per_head_scores(x, attn.gate_proj.weight, 1 if shared else heads)
        assert g.shape == (B, 1 if shared else heads, N, HD if gate == "elementwise" else 1)
        rope = m.layout(N, x.device).rope
        gated = rope(plain * g) if name in "qk" else plain * g
        if name in "kv":
            gated = gated.repeat_interleave(H // kv, dim=1)
        torch.testing.assert_close(records[0][name], gated, atol=1e-6, rtol=1e-5)
        if name in "qk" and gate == "elementwise":  # after RoPE would differ: the check can tell
            assert not torch.allclose(records[0][name], (rope(plain) * g).repeat_interleave(H // heads, dim=1))


def test_g5_gates_the_output_projection_channels():
    m = small_model(gate="elementwise", gate_position="G5")
    _, x, out, _ = block0_inputs(m, token_ids())
    attn = m.blocks[0].attn
    assert attn.gate_proj.weight.shape == (D, D)
    ungated = small_model()
    ungated.load_state_dict({k: v for k, v in m.state_dict().items() if "gate_proj" not in k})
    _, _, plain, _ = block0_inputs(ungated, token_ids())  # the same block input: layer 0 sees only embeddings
    torch.testing.assert_close(out, plain * torch.sigmoid(x @ attn.gate_proj.weight.T), atol=1e-6, rtol=1e-5)


POSITIONS = ["G1", "G2", "G3", "G4", "G5"]


@pytest.mark.parametrize("position,gate,shared", [
    (p, g, s) for p in POSITIONS for g, s in (("headwise", False), ("elementwise", False), ("elementwise", True))
    if p != "G5" or (g, s) == ("elementwise", False)])  # G5 has no heads: refused otherwise
def test_fused_and_explicit_paths_agree_under_gqa_and_rope(position, gate, shared):
    m = small_model(gate=gate, gate_shared=shared, gate_position=position, n_kv_head=2).train()
    idx = token_ids()
    fused = m(idx)
    explicit = small_model(gate=gate, gate_shared=shared, gate_position=position, n_kv_head=2,
                           attn_backend="explicit")(idx)
    torch.testing.assert_close(explicit, fused, atol=2e-5, rtol=1e-5)
    fused.sum().backward()
    assert m.blocks[0].attn.gate_proj.weight.grad.abs().max() > 0


@pytest.mark.parametrize("bad,match", [
    (dict(gate="headwise", gate_position="G5"), r"^model.gate=headwise has no heads .* allowed with G5: model.gate"),
    (dict(gate="elementwise", gate_position="G5", gate_shared=True), r"^model.gate_shared=true .*gate_shared=false$"),
    (dict(gate_position="G2"), r"^model.gate_position=G2 applies to model.gate=headwise, elementwise only"),
    (dict(gate="headwise", gate_position="G6"), r"^model.gate_position='G6' is not supported; allowed: G1, G2, G3"),
    (dict(gate="headwise", gate_act="relu"),
     r"^model.gate_act='relu' is not supported; allowed: sigmoid, silu, scaled_sigmoid$"),
    (dict(attn_op="clipped_softmax", clip_alpha=-1.0), r"^model.clip_alpha=-1.0 .* allowed: >= 0$"),
    (dict(attn_op="clipped_softmax", clip_zeta=0.5), r"^model.clip_zeta=0.5 .* allowed: >= 1$"),
    (dict(clip_alpha=2.0), r"^model.clip_alpha=2.0 applies to model.attn_op=clipped_softmax only"),
])
def test_impossible_gate_and_clipping_settings_are_refused_in_one_line(bad, match):
    with pytest.raises(ConfigError, match=match) as e:
        ModelConfig(**{**SMALL, **bad})
    assert_one_line_error(e)


def test_default_gate_is_g1_sigmoid_head_specific_with_the_0_1_parameter_name():
    m = small_model(gate="headwise")
    gate = m.blocks[0].attn.gate_proj
    assert m.cfg.gate_position == "G1" and not m.cfg.gate_shared and m.cfg.gate_act == "sigmoid"
    assert [n for n, _ in m.blocks[0].attn.named_parameters() if "gate" in n] == ["gate_proj.weight"]
    assert gate.weight.shape == (H, D)


# ------------------------------------------------------------------ gate statistics
def test_gate_stats_by_hand():
    layer0 = [torch.tensor([[[0.05, 0.5], [0.2, 0.9]]]), torch.tensor([[[1.0, 0.0]]])]  # (1, 2, 2) and (1, 1, 2)
    layer1 = [torch.tensor([[[0.3], [0.6], [0.08]]])]  # (1, 3, 1)
    s = gate_stats([layer0, layer1])
    assert s["layer0/gate_mean"] == pytest.approx((0.05 + 0.5 + 0.2 + 0.9 + 1.0 + 0.0) / 6)
    assert s["layer0/gate_low_share"] == pytest.approx(2 / 6)  # 0.05 and 0.0
    assert s["layer0/gate_first_token"] == pytest.approx((0.05 + 0.5 + 1.0 + 0.0) / 4)  # token 1 of both batches
    assert s["layer1/gate_low_share"] == pytest.approx(1 / 3) and s["layer1/gate_first_token"] == pytest.approx(0.3)
    assert s["gate_mean"] == pytest.approx((2.65 + 0.98) / 9)  # every score weighted alike
    assert s["gate_low_share"] == pytest.approx(3 / 9)
    assert s["gate_first_token"] == pytest.approx((1.55 + 0.3) / 5)
    assert gate_stats([]) == {}


def test_record_gates_hooks_the_activation_and_skips_sink_tokens():
    m = small_model(gate="elementwise", n_sink_tokens=2)
    idx = token_ids(B=3, T=10)
    with record_gates(m) as values:
        _, x, _, _ = block0_inputs(m, idx)
        m(idx[:, :5])  # a second forward of another length
    assert len(values) == m.cfg.n_layer and [g.shape for g in values[0]] == [(3, 10, H * HD), (3, 5, H * HD)]
    torch.testing.assert_close(values[0][0], torch.sigmoid(x @ m.blocks[0].attn.gate_proj.weight.T)[:, 2:])
    stats = gate_stats(values)
    every = torch.cat([g.flatten() for layer in values for g in layer])
    assert stats["gate_mean"] == pytest.approx(every.mean().item(), rel=1e-6)
    assert stats["gate_low_share"] == pytest.approx((every < 0.1).float().mean().item())
    with torch.no_grad():  # the hooks are removed on leaving the block
        m(idx)
    assert len(values[0]) == 2
    plain = small_model()
    with record_gates(plain) as none:
        plain(idx)
    assert none == [] and gate_stats(none) == {}


# ------------------------------------------------------------------ clipped softmax
def clipped(s, seen, **knobs):
    cfg = ModelConfig(**{**SMALL, "attn_op": "clipped_softmax", "block_size": s.shape[-1], **knobs})
    return ATTENTION_OPS.selected(cfg)(cfg).normalise(s, seen)


def test_clipped_softmax_by_hand():
    """softmax [1/4, 3/4, 0 (masked)]; T = 3 keys of a training sequence (model.block_size 3, the masked key counts):
    gamma = -alpha / 3."""
    s = torch.tensor([0.0, torch.log(torch.tensor(3.0)), 5.0]).view(1, 1, 1, 3)
    seen = torch.tensor([[True, True, False]])
    # alpha 1.5: gamma -1/2, (1 + 1/2) p - 1/2 = [-1/8, 5/8, -1/2] -> [0, 5/8, 0]
    torch.testing.assert_close(clipped(s, seen, clip_alpha=1.5).flatten(), torch.tensor([0.0, 0.625, 0.0]))
    # zeta 1.5: (1.5 + 1/2) p - 1/2 = [0, 1, -1/2] -> [0, 1, 0]
    torch.testing.assert_close(clipped(s, seen, clip_alpha=1.5, clip_zeta=1.5).flatten(), torch.tensor([0., 1., 0.]))
    # T taken as the 2 visible keys would give gamma -3/4 and [0, 9/16, 0]: not what the op does
    assert clipped(s, seen, clip_alpha=1.5)[..., 1].item() != pytest.approx(0.5625)
    # T is the training sequence's, not the input's: with model.block_size 6, gamma = -1/4 whatever the input
    torch.testing.assert_close(clipped(s, seen, clip_alpha=1.5, block_size=6).flatten(),
                               torch.tensor([1.25 * 0.25 - 0.25, 1.25 * 0.75 - 0.25, 0.0]))


def test_clipped_softmax_with_zeta_1_alpha_0_is_softmax():
    s, seen = torch.randn(2, 4, 6, 9), torch.ones(6, 9, dtype=torch.bool).tril(3)
    torch.testing.assert_close(clipped(s, seen, clip_alpha=0.0), torch.softmax(s.masked_fill(~seen, -torch.inf), -1),
                               atol=0, rtol=0)
    idx = token_ids()
    torch.testing.assert_close(small_model(attn_op="clipped_softmax", clip_alpha=0.0)(idx), small_model()(idx),
                               atol=2e-5, rtol=1e-5)


def test_clipped_softmax_gives_exact_zeros_and_is_scored_with_sink_star():
    m = small_model(attn_op="clipped_softmax", clip_alpha=8.0)
    assert not m.cfg.row_normalised and not m.cfg.can_fuse and not m.cfg.llama_compatible
    maps = attention_maps(m, token_ids())
    visible = torch.ones(24, 24, dtype=torch.bool).tril()
    assert (maps[0][..., visible] == 0).float().mean() > 0.05  # visible keys clipped to exactly 0


def test_components_lists_the_gate_knobs_and_clipped_softmax(capsys):
    rc, out, err = run_cli("sinklab", "components", "--json", capsys=capsys)
    assert rc == 0, err
    listed = {(e["key"], e["name"]): e for e in json.loads(out)}
    knobs = {"gate_position": "G1", "gate_shared": False, "gate_act": "sigmoid"}
    assert listed[("model.gate", "headwise")]["knobs"] == listed[("model.gate", "elementwise")]["knobs"] == knobs
    assert {"model/gate=g2_elementwise", "model/gate=g5_elementwise", "model/gate=elementwise_shared",
            "model/gate=elementwise_silu"} <= set(listed[("model.gate", "elementwise")]["files"])
    clip = listed[("model.attn_op", "clipped_softmax")]
    assert clip["knobs"] == {"clip_zeta": 1.0, "clip_alpha": 4.0} and clip["files"] == ["model/attn=clipped_softmax"]


@pytest.mark.parametrize("kv", [None, 2])
def test_vga_gates_the_sdpa_output_with_a_sigmoid_of_the_tokens_value_states(kv):
    """VGA (arXiv 2510.09017) by hand: Y' = Y * sigmoid(V W_g), V = X W_v the token's value states (its kv heads
    concatenated), Y the heads' SDPA outputs; gating with another token's values would differ; the gates metric's
    hook records the scores (B, T, n_head * hd)."""
    m = small_model(gate="vga", n_kv_head=kv, pos="nope")
    h, x, out, _ = block0_inputs(m, token_ids())
    attn = m.blocks[0].attn
    B, N, _ = x.shape
    heads_kv = kv or H
    q = (x @ attn.q_proj.weight.T).view(B, N, H, HD).transpose(1, 2)
    k, v = ((x @ p.weight.T).view(B, N, heads_kv, HD).transpose(1, 2) for p in (attn.k_proj, attn.v_proj))
    s = (q @ k.repeat_interleave(H // heads_kv, 1).transpose(-1, -2)) / HD ** 0.5
    s = s.masked_fill(~torch.ones(N, N, dtype=torch.bool).tril(), float("-inf"))
    y = (torch.softmax(s, -1) @ v.repeat_interleave(H // heads_kv, 1)).transpose(1, 2).reshape(B, N, H * HD)
    g = torch.sigmoid((x @ attn.v_proj.weight.T) @ attn.gate_proj.weight.T)  # (B, N, H * HD)
    assert attn.gate_proj.weight.shape == (H * HD, heads_kv * HD)
    torch.testing.assert_close(out, (y * g) @ attn.o_proj.weight.T, atol=1e-6, rtol=1e-5)
    assert not torch.allclose(out, (y * g[:, :1]) @ attn.o_proj.weight.T, atol=1e-4)  # not the first token's values
    with record_gates(m) as values, torch.no_grad():
        m(token_ids())
    assert values[0][0].shape == (B, N, H * HD) and 0 < gate_stats(values)["gate_mean"] < 1
    assert attn.gate_proj.values is None  # the value states are not kept past the forward
