"""Residual sinks, outliers, norm-weight minima and first-token attention (issue 15's metrics) against hand-computed
and brute-force values."""
import pytest
import torch

from sinklab.metrics.base import bounds
from sinklab.metrics import (Context, activation_stats, attention_maps, attention_scores, first_token_attention,
                             flatten_activation_stats, summarise)
from sinklab.metrics.activations import attention_output_stats
from sinklab.metrics.outliers import (Outliers, kurtosis, lower_median, norm_weight_minima, residual_sink_summary,
                                      weight_min)
from sinklab.metrics.residual_sinks import ResidualSinks
from tests.helpers import small_model, token_ids


# ------------------------------------------------------------------------------------------------ kurtosis
def test_kurtosis_by_hand_and_of_known_distributions():
    # [-1, 1, -1, 1]: mean 0, mu_4 = 1, unbiased variance 4/3 -> 1 / (16/9) = 0.5625 (Bondarenko's formula)
    x = torch.tensor([[-1.0, 1.0], [-1.0, 1.0]])[None]  # (B=1, T=2, d=2)
    assert kurtosis(x).item() == pytest.approx(1 / ((4 / 3) ** 2 + 1e-6), rel=1e-6)
    g = torch.Generator().manual_seed(0)
    normal = torch.randn(2, 500, 200, generator=g)
    torch.manual_seed(0)
    laplace = torch.distributions.Laplace(0.0, 1.0).sample((2, 500, 200))
    uniform = torch.linspace(-1, 1, 100_000).reshape(1, 500, 200).expand(2, -1, -1)  # a grid: 9/5 up to 1e-4
    for sample, expect, tol in ((normal, 3.0, 0.1), (laplace, 6.0, 0.3), (uniform, 1.8, 1e-3)):
        torch.testing.assert_close(kurtosis(sample), torch.full((2,), expect), atol=tol, rtol=0)
    normal[1, 7, 3] = 200.0  # one outlier in sequence 2 only: each sequence has its own kurtosis
    k = kurtosis(normal)
    assert k[0].item() == pytest.approx(3.0, abs=0.1) and k[1].item() > 100


def test_lower_median_gives_torch_medians_values():
    """numpy's partition on the CPU: the same value as torch.median for odd and even n (the lower middle), float32
    and float64, strided rows, ties, infinities and -0.0, and NaN for a row that holds a NaN (torch.median's)."""
    g = torch.Generator().manual_seed(0)
    cases = [torch.randn(50, 8192, generator=g).abs(), torch.randn(3, 7, generator=g),
             torch.randn(4, 6, generator=g).double(), torch.randn(2, 3, 5, generator=g),
             torch.randn(4, 10, generator=g)[:, ::2], torch.randn(5, 1, generator=g), torch.randn(9, generator=g),
             torch.tensor([[1.0, float("nan"), 0.0], [float("inf"), 2.0, -float("inf")], [0.0, -0.0, 0.0],
                           [3.0, 3.0, 1.0]])]
    for x in cases:
        got, want = lower_median(x), x.median(-1).values
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(7.0), want.nan_to_num(7.0)), x
    assert lower_median(torch.tensor([4.0, 1.0, 3.0, 2.0])).item() == 2.0  # even n: the lower of 2 and 3
    assert lower_median(torch.tensor([[1.0, float("nan"), 2.0]])).isnan().all()  # numpy alone would give 2.0


def test_outlier_stats_of_a_planted_attention_output():
    a = torch.full((2, 4, 3), 0.5)
    a[1, 2, 1] = -8.0
    out = attention_output_stats(a)
    assert out["attn_inf"].tolist() == [0.5, 8.0] and out["attn_median"].tolist() == [0.5, 0.5]
    metric = Outliers(Context(n_layer=1, n_head=1))
    metric.update(0, {"h": a, "attn": a})
    metric.end_batch()
    res = metric.result()
    assert res["attn_inf_norm"] == [pytest.approx(4.25)]  # Bondarenko's: per-sequence max, averaged
    assert res["attn_top_median"] == [pytest.approx(8.0 / 0.5)]  # as massive_ratio: the max over sequences
    assert res["resid_inf_norm"] == [pytest.approx(4.25)]


# ------------------------------------------------------------------------------------------------ residual sinks
def test_a_planted_channel_is_the_top_channel_with_its_ratio():
    g = torch.Generator().manual_seed(1)
    metric = ResidualSinks(Context(n_layer=3, n_head=1))
    for layer, channel in enumerate((5, 5, 3)):
        h = 0.1 * torch.randn(3, 16, 8, generator=g)
        h[..., channel] = 4.0 * (1 + torch.rand(3, 16, generator=g))  # mean |h_j| of 6
        metric.update(layer, {"h": h})
    metric.end_batch()
    res = metric.result()
    assert res["resid_sink_channel"] == [5, 5, 3] and res["resid_sink_channel_share"] == pytest.approx(2 / 3)
    h_avg = torch.tensor(res["h_avg"])
    assert h_avg.shape == (3, 8)
    for i, channel in enumerate((5, 5, 3)):
        assert res["resid_sink_top"][i] == pytest.approx(h_avg[i, channel].item())
        assert res["resid_sink_ratio"][i] == pytest.approx(h_avg[i, channel].item() / h_avg[i].median().item())
        assert res["resid_sink_ratio"][i] > 20  # 6 against ~0.08
    # by hand: H_avg of [[1, 2, 3, 10]] -> top 10 at channel 3, lower median 2
    hand = residual_sink_summary(torch.tensor([[1.0, 2.0, 3.0, 10.0], [4.0, 0.5, 0.5, 0.5]]))
    assert hand == {"resid_sink_top": [10.0, 4.0], "resid_sink_channel": [3, 0], "resid_sink_ratio": [5.0, 8.0],
                    "resid_sink_channel_share": 0.5}


def test_residual_sink_of_a_planted_embedding_channel():
    """Channel 7 of every embedding is 40: it rides the residual stream through every block."""
    m = small_model(n_layer=3)
    with torch.no_grad():
        m.tok_emb.weight[:, 7] = 40.0
    tokens = token_ids(3, 24)
    stats = activation_stats(m, tokens, batch_size=2)
    assert stats["resid_sink_channel"] == [7, 7, 7] and stats["resid_sink_channel_share"] == 1.0
    # brute force: the block outputs through forward hooks, mean |h_j| over every probe token
    hs = []
    hooks = [b.register_forward_hook(lambda mod, inp, out: hs.append(out)) for b in m.blocks]
    with torch.no_grad():
        m(tokens)
    for hook in hooks:
        hook.remove()
    for i, h in enumerate(hs):
        h_avg = h.abs().mean(dim=(0, 1))  # (d,)
        torch.testing.assert_close(torch.tensor(stats["h_avg"][i]), h_avg, atol=1e-5, rtol=1e-5)
        assert stats["resid_sink_ratio"][i] == pytest.approx((h_avg.max() / h_avg.median()).item(), rel=1e-5)
        assert stats["resid_sink_ratio"][i] > 10


# ------------------------------------------------------------------------------------------------ brute force
@pytest.mark.parametrize("sw", [{}, dict(attn_bias="kv", n_sink_tokens=1), dict(norm_position="post")],
                         ids=["default", "kv_sink_token", "post_norm"])
def test_outliers_equal_brute_force_over_hooks(sw):
    """Per layer, from forward hooks on the blocks and on o_proj (not the records): inf-norm and kurtosis per
    sequence, averaged; the attention output's max over sequences / mean median; real tokens only."""
    m = small_model(**sw)
    S = m.cfg.n_sink_tokens
    tokens = token_ids(5, 24, seed=2)
    stats = activation_stats(m, tokens, batch_size=2)
    seen: dict[str, list] = {"h": [], "a": []}
    hooks = [b.register_forward_hook(lambda mod, inp, out: seen["h"].append(out[:, S:])) for b in m.blocks]
    hooks += [b.attn.o_proj.register_forward_hook(lambda mod, inp, out: seen["a"].append(out[:, S:]))
              for b in m.blocks]
    with torch.no_grad():
        m(tokens)
    for hook in hooks:
        hook.remove()
    for i in range(m.cfg.n_layer):
        for stream, x in (("resid", seen["h"][i]), ("attn", seen["a"][i])):
            per_seq = [seq.flatten() for seq in x]  # (T * d,) per sequence
            inf = torch.stack([v.abs().max() for v in per_seq])
            kurt = torch.stack([((v - v.mean()) ** 4).mean() / (v.std() ** 4 + 1e-6) for v in per_seq])
            assert stats[f"{stream}_inf_norm"][i] == pytest.approx(inf.mean().item(), rel=1e-5)
            assert stats[f"{stream}_kurtosis"][i] == pytest.approx(kurt.mean().item(), rel=1e-4)
        a = seen["a"][i]
        medians = torch.stack([seq.abs().flatten().median() for seq in a])
        assert stats["attn_top_median"][i] == pytest.approx((a.abs().max() / medians.mean()).item(), rel=1e-5)


# ------------------------------------------------------------------------------------------------ norm weights
def test_norm_weight_minima_find_a_planted_small_weight():
    m = small_model(n_layer=3)
    with torch.no_grad():
        m.blocks[1].norm2.weight[3] = 0.02
        m.blocks[2].norm1.weight[5] = -0.01  # a sign flip is not a collapse: |w| counts
        m.norm.weight[0] = 0.5
    got = norm_weight_minima(m)
    assert got == {"attn_norm_min": [1.0, 1.0, pytest.approx(0.01)], "ffn_norm_min": [1.0, pytest.approx(0.02), 1.0],
                   "final_norm_min": 0.5}
    flat = flatten_activation_stats({**got})
    assert flat["norm_min"] == pytest.approx(0.01) and flat["layer1/ffn_norm_min"] == pytest.approx(0.02)
    # LayerNorm has a weight too; a post-norm model has no final norm (nn.Identity: no weight, nothing logged)
    post = small_model(norm_position="post", norm="layer")
    got = norm_weight_minima(post)
    assert got["final_norm_min"] is None and got["attn_norm_min"] == [1.0, 1.0]
    assert "final_norm_min" not in flatten_activation_stats(got) and weight_min(torch.nn.Identity()) is None
    # a wrapping norm: the wrapped norm's weight is found, the wrapper's 2-D matrices are not norm weights
    wrapper = torch.nn.Sequential(post.blocks[0].norm1, torch.nn.Linear(32, 4))
    with torch.no_grad():
        wrapper[0].weight[2] = 0.3
    assert weight_min(wrapper) == pytest.approx(0.3)


# ------------------------------------------------------------------------------------------------ first token
def test_first_token_attention_is_alpha1_and_the_brute_force_mean():
    m = small_model(attn_bias="kv")
    tokens = token_ids(3, 24, seed=4)
    summary = summarise(attention_scores(m, tokens), (0.3,))
    ftok = first_token_attention(summary)
    assert set(ftok) == {"first_token_attn", "layer0/first_token_attn", "layer1/first_token_attn"}
    assert ftok["first_token_attn"] == summary["alpha1"]
    for i, p in enumerate(attention_maps(m, tokens)):  # (B, H, T, n_slots + T): column 1 after the bias slot
        assert ftok[f"layer{i}/first_token_attn"] == pytest.approx(p[..., 1].mean().item(), abs=1e-6)


def test_every_new_logged_name_has_bounds():
    flat = flatten_activation_stats(activation_stats(small_model(), token_ids(2, 24)))
    for name in list(flat) + ["first_token_attn", "layer0/first_token_attn"]:
        limits = bounds("act/" + name)
        assert limits is not None, name
        if name in flat:
            assert limits[0] <= flat[name] <= limits[1], name
