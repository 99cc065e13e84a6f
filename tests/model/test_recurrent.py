"""Gated DeltaNet and gated linear attention (sinklab/model/ops/recurrent.py): the chunked form equals the recurrent
one, the effective attention reproduces both, transformers' own pure-PyTorch gated delta rule (Qwen3-Next's) gives the
same numbers on the same inputs, nothing flows from the future, and a hybrid decodes with a KV cache whose policies
evict the softmax layers' keys only. The contract tests (tests/model/test_contracts.py) cover the rest."""
from __future__ import annotations

import math

import pytest
import torch

from sinklab.errors import UserError
from sinklab.model import ConfigError, ModelConfig, Transformer
from sinklab.model.cache_policies import CACHE_POLICIES, build
from sinklab.model.cache_policies.snapkv import SnapKV
from sinklab.model.ops.recurrent import (chunked_gated_delta, effective_attention, l2_normalise,
                                         recurrent_gated_delta)

# chunked vs recurrent in float32, measured over 5 seeds x T in {1, 63, 64, 65, 200}: 2.8e-7 at most (outputs ~0.6);
# the bound leaves an order of magnitude for other kernel sets
FP32_TOL = 3e-6


def inputs(seed: int, T: int = 200, B: int = 2, H: int = 3, dk: int = 16, dv: int = 24, strong: bool = False,
           dtype=torch.float32):
    """Random q, k (L2-normalised, q scaled), v, log-decays and betas, (B, H, T, .)."""
    g = torch.Generator().manual_seed(seed)
    q = l2_normalise(torch.randn(B, H, T, dk, generator=g, dtype=dtype)) / math.sqrt(dk)
    k = l2_normalise(torch.randn(B, H, T, dk, generator=g, dtype=dtype))
    v = torch.randn(B, H, T, dv, generator=g, dtype=dtype)
    decay = -torch.rand(B, H, T, generator=g, dtype=dtype) * (20.0 if strong else 0.5)
    beta = torch.rand(B, H, T, generator=g, dtype=dtype)
    return q, k, v, decay, beta


@pytest.mark.parametrize("delta", [True, False], ids=["gated_deltanet", "gated_linear"])
@pytest.mark.parametrize("T", [1, 63, 64, 65, 200])
def test_chunked_equals_recurrent(delta, T):
    for seed in range(3):
        q, k, v, decay, beta = inputs(seed, T)
        beta = beta if delta else None
        state = torch.randn(2, 3, 16, 24, generator=torch.Generator().manual_seed(seed)) * 0.1
        o_c, S_c = chunked_gated_delta(q, k, v, decay, beta, chunk=64, state=state)
        o_r, S_r = recurrent_gated_delta(q, k, v, decay, beta, state=state)
        torch.testing.assert_close(o_c, o_r, atol=FP32_TOL, rtol=0)
        torch.testing.assert_close(S_c, S_r, atol=FP32_TOL, rtol=0)


def test_chunked_equals_recurrent_with_strong_decay_and_other_chunks():
    q, k, v, decay, beta = inputs(0, T=100, strong=True)  # log alpha down to -20: no overflow, no NaN
    want, _ = recurrent_gated_delta(q, k, v, decay, beta)
    for chunk in (1, 7, 16, 128):
        got, _ = chunked_gated_delta(q, k, v, decay, beta, chunk=chunk)
        torch.testing.assert_close(got, want, atol=FP32_TOL, rtol=0)


@pytest.mark.parametrize("delta", [True, False], ids=["gated_deltanet", "gated_linear"])
def test_effective_attention_reproduces_the_output(delta):
    """o_t = sum_s M[t, s] v_s exactly (float64), zero above the diagonal, for any subset of rows."""
    q, k, v, decay, beta = inputs(1, T=40, dtype=torch.float64)
    beta = beta if delta else None
    want, _ = recurrent_gated_delta(q, k, v, decay, beta)
    M = effective_attention(q, k, decay, beta, torch.arange(40))
    torch.testing.assert_close(M @ v, want, atol=1e-12, rtol=0)
    assert torch.all(M.triu(1) == 0)
    rows = torch.tensor([3, 17, 39])
    torch.testing.assert_close(effective_attention(q[:, :, rows], k, decay, beta, rows), M[:, :, rows])


def test_parity_with_transformers_qwen3_next():
    """transformers' pure-PyTorch gated delta rule (Qwen3-Next's fallback, written independently of sinklab), on the
    same raw q, k (it L2-normalises and scales them itself), v, log-decays and betas."""
    qwen = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    g = torch.Generator().manual_seed(3)
    B, T, H, dk, dv = 2, 150, 4, 16, 24
    q, k = torch.randn(B, T, H, dk, generator=g), torch.randn(B, T, H, dk, generator=g)
    v = torch.randn(B, T, H, dv, generator=g)
    decay, beta = -torch.rand(B, T, H, generator=g), torch.rand(B, T, H, generator=g)
    want_c, state_c = qwen.torch_chunk_gated_delta_rule(q, k, v, decay, beta, chunk_size=64, output_final_state=True,
                                                        use_qk_l2norm_in_kernel=True)
    want_r, state_r = qwen.torch_recurrent_gated_delta_rule(q, k, v, decay, beta, output_final_state=True,
                                                            use_qk_l2norm_in_kernel=True)
    t = lambda x: x.transpose(1, 2)  # noqa: E731  (B, T, H, .) <-> (B, H, T, .)
    mine_q, mine_k = l2_normalise(t(q)) / math.sqrt(dk), l2_normalise(t(k))
    got_c, S_c = chunked_gated_delta(mine_q, mine_k, t(v), t(decay), t(beta), chunk=64)
    got_r, S_r = recurrent_gated_delta(mine_q, mine_k, t(v), t(decay), t(beta))
    # measured: chunked 3.0e-8 from theirs, recurrent 0 (the same operations in the same order)
    torch.testing.assert_close(t(got_c), want_c, atol=3e-7, rtol=0)
    torch.testing.assert_close(t(got_r), want_r, atol=3e-7, rtol=0)
    torch.testing.assert_close(S_c, state_c, atol=3e-7, rtol=0)
    torch.testing.assert_close(S_r, state_r, atol=3e-7, rtol=0)


@pytest.mark.parametrize("delta", [True, False], ids=["gated_deltanet", "gated_linear"])
def test_no_future_leakage_and_gradients_agree(delta):
    """The output at t has no gradient from any input after t; the chunked form's gradients are the recurrent ones."""
    q, k, v, decay, beta = inputs(2, T=70, dtype=torch.float64)
    beta = beta if delta else None
    leaves = [x.requires_grad_() for x in (q, k, v, decay) + ((beta,) if delta else ())]
    t = 40
    o, _ = chunked_gated_delta(q, k, v, decay, beta, chunk=16)
    grads = torch.autograd.grad(o[:, :, t].sum(), leaves, retain_graph=True)
    for g in grads:
        assert torch.all(g[:, :, t + 1:] == 0), "an output reads a later position"
        assert g[:, :, :t + 1].abs().max() > 0
    weights = torch.randn_like(o)
    g_chunk = torch.autograd.grad((o * weights).sum(), leaves)
    o_r, _ = recurrent_gated_delta(q, k, v, decay, beta)
    g_rec = torch.autograd.grad((o_r * weights).sum(), leaves)
    for a, b in zip(g_chunk, g_rec):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-8)


def hybrid(**over) -> Transformer:
    torch.manual_seed(0)
    cfg = dict(vocab_size=97, n_layer=4, n_head=4, d_model=32, d_ff=64, block_size=64, layer_pattern="GD",
               pattern_ops="D:gated_deltanet")
    return Transformer(ModelConfig(**{**cfg, **over})).eval()


def test_hybrid_decodes_under_eviction_with_the_memory_kept():
    """StreamingLLM and SnapKV evict the softmax layers' keys; the Gated DeltaNet layers hold no keys, only their
    memory, whose size does not grow with the context; with a budget larger than the text nothing is evicted and
    decoding gives the full forward's logits."""
    m = hybrid()
    idx = torch.randint(0, 97, (1, 48), generator=torch.Generator().manual_seed(0))
    full = m(idx)
    for policy in (dict(keep_first=4, recent=12), dict(policy=SnapKV(16)), dict(keep_first=4, recent=60)):
        cache = m.new_cache(**policy)
        steps = [m(idx[:, :16], cache=cache)]
        sizes = []
        for i in range(16, 48):
            steps.append(m(idx[:, i:i + 1], cache=cache))
            sizes.append({name: tuple(t.shape) for name, t in cache.recurrent[1].items()})
        assert cache.k[1] is None and cache.k[3] is None and cache.k[0] is not None  # D layers hold no keys
        assert all(s == sizes[0] for s in sizes) and set(sizes[0]) == {"conv_q", "conv_k", "conv_v", "memory"}
        logits = torch.cat(steps, dim=1)
        assert torch.isfinite(logits).all()
        if policy.get("recent") == 60:
            torch.testing.assert_close(logits, full, atol=2e-5, rtol=1e-5)
        else:
            assert cache.length < 16 + 32 and (logits - full).abs().max() > 1e-4  # the softmax layers evicted


@pytest.mark.parametrize("name", CACHE_POLICIES.names())
def test_every_cache_policy_decodes_a_hybrid(name):
    """Each registered policy evicts or masks the softmax layers' keys of a hybrid (a layer pattern that puts the
    recurrent layer first and last) and leaves the recurrent layers' memory whole: finite logits, no keys held by a
    recurrent layer, its memory the same size at every step."""
    m = hybrid(layer_pattern="DGGD")
    policy = build(name, None if name in ("dense", "duo") else 12)
    cache = m.new_cache(policy=policy)
    idx = torch.randint(0, 97, (1, 40), generator=torch.Generator().manual_seed(3))
    steps = [m(idx[:, :16], cache=cache)]
    for i in range(16, 40):
        steps.append(m(idx[:, i:i + 1], cache=cache))
        assert cache.recurrent[0]["memory"].shape == cache.recurrent[3]["memory"].shape == (1, 4, 8, 8)
    assert cache.k[0] is None and cache.k[3] is None and cache.k[1] is not None
    assert torch.isfinite(torch.cat(steps, dim=1)).all()


def test_an_all_recurrent_model_decodes():
    m = hybrid(layer_pattern=None, pattern_ops=None, attn_op="gated_linear")
    idx = torch.randint(0, 97, (2, 30), generator=torch.Generator().manual_seed(1))
    cache = m.new_cache(keep_first=2, recent=8)  # nothing to evict: no layer holds keys
    steps = [m(idx[:, :10], cache=cache)] + [m(idx[:, i:i + 1], cache=cache) for i in range(10, 30)]
    torch.testing.assert_close(torch.cat(steps, dim=1), m(idx), atol=2e-5, rtol=1e-5)
    assert cache.length == 30


@pytest.mark.parametrize("key, value, allowed", [("window", 8, "null"), ("prefix_len", 4, "0"),
                                                 ("attn_bias", "kv", "none"), ("conv_size", 0, "positive"),
                                                 ("linear_chunk", -1, "positive")])
def test_bad_settings_are_one_line_errors(key, value, allowed):
    with pytest.raises(ConfigError) as err:
        ModelConfig(vocab_size=97, n_layer=2, n_head=4, d_model=32, d_ff=64, block_size=24, attn_op="gated_deltanet",
                    **{key: value})
    assert f"model.{key}=" in str(err.value) and allowed in str(err.value) and "\n" not in str(err.value)


def test_a_gate_gates_the_softmax_layers_of_a_pattern_only():
    m = hybrid(layer_pattern="DDDG", gate="elementwise", gate_act="scaled_sigmoid")
    assert [type(b.attn.gate_proj).__name__ for b in m.blocks] == ["NoGate", "NoGate", "NoGate", "ElementwiseGate"]
    with pytest.raises(ConfigError, match=r"^model.gate=headwise does not apply to model.attn_op=gated_deltanet; "
                                          r"allowed: none"):
        hybrid(layer_pattern=None, pattern_ops=None, attn_op="gated_deltanet", gate="headwise")


def test_an_intervention_mask_is_refused():
    m = hybrid(layer_pattern=None, pattern_ops=None, attn_op="gated_deltanet")
    with pytest.raises(UserError, match="gated_deltanet runs its recurrence"):
        m(torch.zeros(1, 8, dtype=torch.long), extra_mask=lambda b, h, q, kv: kv != 1)


def test_retrievals_kept_sets_are_the_softmax_layers():
    """`sinklab eval retrieval`'s kept sets: the layers that hold keys; a model of recurrent layers only has every
    token it read (its memory is never evicted)."""
    from sinklab.model.cache_policies import Streaming
    from sinklab.targets.native import SinklabDecoder

    idx = torch.randint(0, 97, (2, 40), generator=torch.Generator().manual_seed(2))
    dec = SinklabDecoder(hybrid(), Streaming(8, first=2), "decoding")
    dec(idx[:, :30])
    kept = dec.kept()
    assert len(kept) == 2 and all(k.shape == (2, 4, 8) for k in kept)  # layers 0 and 2, 2 first + 6 recent
    assert kept[0][0, 0].tolist() == [0, 1, 24, 25, 26, 27, 28, 29]
    linear = SinklabDecoder(hybrid(layer_pattern=None, pattern_ops=None, attn_op="gated_deltanet"),
                            Streaming(8, first=2), "decoding")
    linear(idx[:, :30])
    (every,) = linear.kept()
    assert every.shape == (2, 1, 30) and every[1, 0].tolist() == list(range(30))


def test_bfloat16_autocast_runs_the_recurrence_in_float32():
    """Under bf16 autocast the chunked form still runs in float32 (its triangular solve and the decays' products want
    it): finite logits near the float32 ones, a gradient for every parameter. The softmax layers on the explicit
    backend: torch's bf16 SDPA is not built for every CPU kernel set (ATEN_CPU_CAPABILITY=default on an AVX-512 CPU
    raises)."""
    m = hybrid(block_size=80, attn_backend="explicit").train()
    idx = torch.randint(0, 97, (2, 70), generator=torch.Generator().manual_seed(4))
    want = m(idx).detach()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = m(idx)
    got.float().sum().backward()
    assert got.dtype == torch.bfloat16 and torch.isfinite(got).all()
    assert (got.float() - want).abs().max() < 0.1 * want.abs().max()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in m.parameters())
