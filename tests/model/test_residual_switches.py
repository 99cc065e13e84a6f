"""Issue 15's norm and position switches: PreAffine RMSNorm, Dynamic Tanh, GatedNorm around any norm, residual
clipping, partial RoPE (p-RoPE) and per-layer NoPE. The generic contract (tests/model/test_contracts.py) runs them too;
this file checks what each one computes."""
import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from sinklab.model import ConfigError, ModelConfig
from sinklab.model.norms import DynamicTanh, GatedNorm, PreAffineRMSNorm, RMSNorm
from sinklab.model.positional import Rotary, RotaryAt
from tests.helpers import SMALL, assert_one_line_error, component_cases, run_cli, small_model, token_ids


def x_of(*shape, seed=0, scale=1.0):
    return scale * torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------ norms
def test_preaffine_is_rmsnorm_of_the_prescaled_input():
    norm = PreAffineRMSNorm(8, eps=1e-5)
    x = x_of(3, 8)
    torch.testing.assert_close(norm(x), RMSNorm(8)(x), atol=0, rtol=0)  # lambda starts at ones: plain RMSNorm
    with torch.no_grad():
        norm.pre_scale.copy_(torch.linspace(0.5, 4.0, 8))
        norm.weight.copy_(torch.linspace(-1.0, 1.0, 8))
    lx = x * norm.pre_scale
    want = lx / torch.sqrt(lx.pow(2).mean(-1, keepdim=True) + 1e-5) * norm.weight
    torch.testing.assert_close(norm(x), want)
    assert not torch.allclose(norm(x), F.rms_norm(x, (8,), norm.weight, 1e-5))  # lambda is not a no-op


def test_dyt_is_a_scaled_tanh_with_its_alpha_from_the_knob():
    m = small_model(norm="dyt", dyt_alpha_init=0.8)
    for norm in (m.blocks[0].norm1, m.blocks[1].norm2, m.norm):
        assert isinstance(norm, DynamicTanh) and norm.alpha.shape == () and norm.alpha.item() == pytest.approx(0.8)
        assert torch.all(norm.weight == 1) and torch.all(norm.bias == 0)
    assert small_model(norm="dyt").norm.alpha.item() == 0.5  # the paper's default
    norm = m.norm
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 2.0, 32))
        norm.bias.copy_(torch.linspace(-1.0, 1.0, 32))
    x = x_of(2, 5, 32, scale=3.0)
    torch.testing.assert_close(norm(x), norm.weight * torch.tanh(0.8 * x) + norm.bias)


@pytest.mark.parametrize("norm", ["rms", "layer", "preaffine", "dyt"])
@pytest.mark.parametrize("position", ["pre", "post"])
def test_gated_norm_wraps_every_norm_site(norm, position):
    m = small_model(norm=norm, norm_position=position, gated_norm=True, gated_norm_rank=4)
    sites = [b.norm1 for b in m.blocks] + [b.norm2 for b in m.blocks] + ([m.norm] if position == "pre" else [])
    for site in sites:
        assert isinstance(site, GatedNorm) and site.down.weight.shape == (4, 32) and site.up.weight.shape == (32, 4)
        assert site.norm.name == norm
    assert isinstance(m.norm, torch.nn.Identity) == (position == "post")  # post-norm blocks have no final norm


def test_gated_norm_computes_the_papers_formula_and_starts_near_its_gate_init():
    m = small_model(norm="rms", gated_norm=True, gated_norm_gate_init=0.9)
    site = m.blocks[0].norm1
    assert torch.all(site.up.bias == math.log(0.9 / 0.1))
    assert site.down.weight.std().item() == pytest.approx(m.cfg.std, rel=0.3)  # drawn as every matrix
    x = x_of(2, 6, 32, scale=2.0)
    y = F.rms_norm(x, (32,), site.norm.weight, 1e-5)
    gate = torch.sigmoid(F.silu(y @ site.down.weight.T) @ site.up.weight.T + site.up.bias)
    torch.testing.assert_close(site(x), gate * y)
    assert (gate - 0.9).abs().max() < 0.05  # the gate starts near gated_norm_gate_init
    default = small_model(norm="rms", gated_norm=True).blocks[0].norm1
    assert torch.all(default.up.bias == 0)  # 0.5: logit 0


def test_gated_norm_changes_nothing_when_off():
    plain, off = small_model(), small_model(gated_norm=False)
    idx = token_ids()
    assert torch.equal(plain(idx), off(idx))
    assert not any(isinstance(mod, GatedNorm) for mod in off.modules())


def test_contract_cases_enumerate_the_gate_for_every_norm_and_the_rope_knobs():
    cases = component_cases()
    for norm in ("rms", "layer", "preaffine", "dyt"):
        for gated in (False, True):
            assert {"norm": norm, "gated_norm": gated} in cases
    ropes = [c for c in cases if c.get("pos") == "rope"]
    assert {(c["rope_fraction"], c["nope_every"]) for c in ropes} == {(1.0, None), (1.0, 2), (0.5, None), (0.5, 2)}


@pytest.mark.parametrize("cfg,mismatch", [
    (dict(), None),
    (dict(gated_norm=True), "model.gated_norm=true (LLaMA needs false)"),
    (dict(norm="preaffine"), "model.norm=preaffine (LLaMA needs rms)"),
    (dict(norm="dyt", gated_norm=True), "model.norm=dyt (LLaMA needs rms)"),
    (dict(norm="layer"), "model.norm=layer (LLaMA needs rms)"),
    (dict(rope_fraction=0.5), "model.rope_fraction=0.5 (LLaMA needs 1.0)"),
    (dict(nope_every=2), "model.nope_every=2 (LLaMA needs null)"),
    (dict(residual_clip=10.0), "model.residual_clip=10.0 (LLaMA needs null)"),
])
def test_only_plain_rms_full_rope_and_no_clip_are_llama(cfg, mismatch):
    found = ModelConfig(**{**SMALL, **cfg}).llama_mismatches()
    assert found == ([mismatch] if mismatch else [])


@pytest.mark.parametrize("bad,match", [
    (dict(gated_norm_rank=8), r"model.gated_norm_rank=8 applies to model.gated_norm=true only; set .*=16$"),
    (dict(gated_norm_gate_init=0.9), "model.gated_norm_gate_init=0.9 applies to model.gated_norm=true only"),
    (dict(gated_norm=True, gated_norm_rank=0), "model.gated_norm_rank=0 must be a positive integer"),
    (dict(gated_norm=True, gated_norm_gate_init=1.0), r"model.gated_norm_gate_init=1.0 must lie in \(0, 1\)"),
    (dict(dyt_alpha_init=1.0), "model.dyt_alpha_init=1.0 applies to model.norm=dyt only, got norm=rms"),
    (dict(norm="dyt", dyt_alpha_init=0.0), "model.dyt_alpha_init=0.0 must be > 0"),
    (dict(norm="dyt", norm_eps=1e-6), "model.norm_eps=1e-06 has no effect with model.norm=dyt"),
    (dict(norm="groupnorm"), "model.norm='groupnorm' is not supported; allowed: rms, layer, preaffine, dyt"),
    (dict(residual_clip=0.0), r"model.residual_clip=0.0 must be > 0 or null \(off\)"),
    (dict(residual_clip=-3.0), "model.residual_clip=-3.0 must be > 0"),
    (dict(rope_fraction=0.0), r"model.rope_fraction=0.0 must lie in \(0, 1\]"),
    (dict(rope_fraction=1.5), r"model.rope_fraction=1.5 must lie in \(0, 1\]"),
    (dict(rope_fraction=0.2), "model.rope_fraction=0.2 rotates none of the 4 pairs of head size 8; allowed: >= 0.25"),
    (dict(nope_every=1), "model.nope_every=1 must be an integer in 2..n_layer=2 or null"),
    (dict(nope_every=3), "model.nope_every=3 must be an integer in 2..n_layer=2"),
    (dict(pos="alibi", nope_every=2), "model.nope_every=2 applies to model.pos=rope only, got pos=alibi"),
    (dict(pos="nope", rope_fraction=0.5), "model.rope_fraction=0.5 applies to model.pos=rope only, got pos=nope"),
])
def test_bad_settings_are_refused_in_one_line(bad, match):
    with pytest.raises(ConfigError, match=match) as err:
        ModelConfig(**{**SMALL, **bad})
    assert_one_line_error(err)


# ------------------------------------------------------------------ residual clipping
def residual_streams(m) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The logits and every block's output (the residual stream after the clamp), recorded by forward hooks."""
    from sinklab.metrics import SinklabRecorder

    hs: dict[int, torch.Tensor] = {}
    with SinklabRecorder(m).hooks({"h"}, lambda i, rec: hs.__setitem__(i, rec["h"])):
        logits = m(token_ids())
    return logits, [hs[i] for i in sorted(hs)]


def test_residual_clip_clamps_a_huge_residual_stream_after_every_block():
    clipped, free = small_model(residual_clip=3.0), small_model()
    for m in (clipped, free):
        with torch.no_grad():
            m.tok_emb.weight.mul_(1e4)  # a huge input
    logits, records = residual_streams(clipped)
    _, free_records = residual_streams(free)
    assert torch.isfinite(logits).all()
    for h, free_h in zip(records, free_records):
        assert h.abs().max() == 3.0  # clamped, and the clamp is reached
        assert free_h.abs().max() > 1e3  # what it would have been
    assert small_model(residual_clip=1e30)(token_ids()).equal(small_model()(token_ids()))  # clamp only when beyond


def test_residual_clip_works_in_the_post_norm_layout():
    m = small_model(norm_position="post", residual_clip=0.5)
    _, records = residual_streams(m)
    assert all(h.abs().max() == 0.5 for h in records)  # a post-norm block's output has |h| ~ 1 and more


# ------------------------------------------------------------------ partial RoPE
def reference_rope_tables(head_dim: int, max_len: int, base: float):
    """Full RoPE's tables as sinklab computed them before p-RoPE (rotate-half, pairs (i, i + hd/2))."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    freqs = torch.outer(torch.arange(max_len, dtype=torch.float32), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def test_full_fraction_is_todays_rope_bit_for_bit():
    rope = Rotary(16, 40, 500.0, fraction=1.0)
    cos, sin = reference_rope_tables(16, 40, 500.0)
    assert torch.equal(rope.cos, cos) and torch.equal(rope.sin, sin)
    assert torch.equal(Rotary.from_config(ModelConfig(**SMALL)).cos, reference_rope_tables(8, 24, 10000.0)[0])


def test_partial_rope_leaves_the_slowest_pairs_unrotated():
    hd, n = 16, 30
    rope = Rotary(hd, n, fraction=0.75)  # 6 of 8 pairs rotate
    full = Rotary(hd, n)
    q, k = x_of(2, 3, n, hd, seed=1), x_of(2, 3, n, hd, seed=2)
    rq, rk = rope(q), rope(k)
    still = torch.tensor([6, 7, 6 + 8, 7 + 8])  # pairs 6 and 7: (x_6, x_14), (x_7, x_15)
    turned = torch.tensor([i for i in range(hd) if i not in still.tolist()])
    assert torch.equal(rq[..., still], q[..., still]) and torch.equal(rk[..., still], k[..., still])
    torch.testing.assert_close(rq[..., turned], full(q)[..., turned], atol=0, rtol=0)  # at full RoPE's frequencies
    assert (rq[..., 1:, turned] - q[..., 1:, turned]).abs().min(-1).values.max() > 0  # positions > 0 rotate
    # q.k over the unrotated pairs depends on the contents only: the same vectors at other positions give the same
    # scores, while the rotated pairs' scores change
    part = rq[..., still] @ rk[..., still].transpose(-1, -2)  # (B, H, n, n)
    moved = rope(q.flip(2))[..., still] @ rope(k.flip(2))[..., still].transpose(-1, -2)
    torch.testing.assert_close(moved, part.flip(2, 3), atol=0, rtol=0)
    turned_part = rq[..., turned] @ rk[..., turned].transpose(-1, -2)
    moved_turned = rope(q.flip(2))[..., turned] @ rope(k.flip(2))[..., turned].transpose(-1, -2)
    assert (moved_turned - turned_part.flip(2, 3)).abs().max() > 1e-2


@pytest.mark.parametrize("cfg", [dict(rope_fraction=0.5), dict(nope_every=2), dict(rope_fraction=0.75, n_head=2)])
def test_partial_rope_and_nope_layers_keep_the_fused_kernel(cfg):
    m = small_model(**cfg)
    assert m.cfg.can_fuse
    explicit = small_model(**cfg, attn_backend="explicit")
    torch.testing.assert_close(m(token_ids()), explicit(token_ids()), atol=2e-5, rtol=1e-5)


# ------------------------------------------------------------------ per-layer NoPE
def test_nope_every_k_drops_rope_in_layers_k_2k_counted_from_one():
    m = small_model(n_layer=8, nope_every=4)
    assert [b.attn.rotates for b in m.blocks] == [True, True, True, False, True, True, True, False]
    assert all(b.attn.rotates for b in small_model().blocks)


def test_a_nope_layers_scores_do_not_depend_on_positions():
    m = small_model(n_layer=2, nope_every=2)  # layer 2 has no RoPE, layer 1 has
    T, shift = 8, 11
    layout = m.layout(T, torch.device("cpu"))
    shifted = dataclasses.replace(layout, rope=RotaryAt(m.pos.cos[shift:shift + T], m.pos.sin[shift:shift + T]))
    perm = torch.randperm(T, generator=torch.Generator().manual_seed(0))
    scrambled = dataclasses.replace(layout, rope=RotaryAt(m.pos.cos[perm], m.pos.sin[perm]))
    x = x_of(2, T, 32, seed=3)
    rows = torch.arange(T)

    def scores(block, lay):
        q, k, _ = block.attn.qkv(x, lay)
        return block.attn.probs(q, k, lay, rows)

    rope_layer, nope_layer = m.blocks
    base = scores(nope_layer, layout)
    assert torch.equal(scores(nope_layer, shifted), base) and torch.equal(scores(nope_layer, scrambled), base)
    # the RoPE layer: relative positions only (a shift keeps its scores up to rounding), but other positions change
    # them
    torch.testing.assert_close(scores(rope_layer, shifted), scores(rope_layer, layout), atol=1e-5, rtol=1e-5)
    assert (scores(rope_layer, scrambled) - scores(rope_layer, layout)).abs().max() > 1e-3


def test_components_command_shows_the_new_switches(capsys):
    rc, table, err = run_cli("sinklab", "components", capsys=capsys)
    assert rc == 0, err
    for text in ("model.norm=preaffine", "model.norm=dyt", "dyt_alpha_init=0.5", "gated_norm=False",
                 "gated_norm_rank=16", "gated_norm_gate_init=0.5", "model/norm=gated_rms", "rope_fraction=1.0",
                 "nope_every=None", "model/pos=p_rope", "model/pos=rope_nope2"):
        assert text in table, text


@pytest.mark.parametrize("kw, want", [
    (dict(), [{"rope"}] * 4),
    (dict(rope_fraction=0.5), [{"partial"}] * 4),
    (dict(nope_every=2), [{"rope"}, {"nope"}, {"rope"}, {"nope"}]),
    (dict(nope_every=2, rope_fraction=0.75), [{"partial"}, {"nope"}, {"partial"}, {"nope"}]),
    (dict(pos="alibi"), [{"alibi"}] * 4),
    (dict(pos="nope"), [{"nope"}] * 4),
    (dict(pos="relative"), [{"relative"}] * 4),
    (dict(pos="sinusoidal"), [{"absolute"}] * 4),
])
def test_head_types_name_each_heads_position_type_per_layer(kw, want):
    from sinklab.model.positional import HEAD_TYPES

    cfg = ModelConfig(n_layer=4, n_head=4, **kw)
    types = cfg.head_types()
    assert [set(t) for t in types] == want
    assert all(len(t) == cfg.n_head and set(t) <= set(HEAD_TYPES) for t in types)


def test_pair_frequencies_mark_the_rotating_and_the_partial_cycle_pairs():
    """base 1e4, head size 32: 11 of the 16 rotary pairs never complete a cycle within T = 64 tokens (issue 37's
    count); p-RoPE 0.75 stops the 4 slowest; a NoPE layer and ALiBi rotate none."""
    from sinklab.model.registry import POSITIONS

    def freqs(layer=0, **kw):
        cfg = ModelConfig(n_layer=2, n_head=4, d_model=128, block_size=64, **kw)
        return POSITIONS.selected(cfg).pair_frequencies(cfg, layer)

    f = freqs()
    assert f.shape == (4, 16) and (f > 0).all() and torch.equal(f[0], f[3])
    assert int(((f[0] * 63) < 2 * math.pi).sum()) == 11
    assert int((freqs(rope_fraction=0.75)[0] == 0).sum()) == 4
    assert not freqs(layer=1, nope_every=2).any() and freqs(layer=0, nope_every=2).all()
    assert not freqs(pos="alibi").any()
    assert torch.equal(Rotary(32, 64, 10000.0, 0.75).inv_freq, freqs(rope_fraction=0.75)[0])  # what the model rotates by
