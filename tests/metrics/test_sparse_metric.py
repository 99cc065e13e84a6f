"""The `sparse` metric (sinklab/metrics/sparse.py): alpha_k on the keys each query can see, the visible share and the
selection of token 1, against a brute force over whole maps and masks, on hand-built maps and on real models; it
applies to sparse models only, and the training callback logs it."""
import math

import pandas as pd
import pytest
import torch

from sinklab.contracts.component_checks import small_model, token_ids
from sinklab.evals.interventions import drop_first_key
from sinklab.metrics import METRICS, Context, SinklabRecorder, attention_maps, measure_model
from sinklab.metrics.base import bounds
from sinklab.metrics.sparse import SparseSinkMetric
from tests.helpers import small, train

T = 24


def brute_force(model, tokens, k):
    """Every (sequence, layer, head) by the definitions, query by query, from whole maps and the layers' masks:
    alpha_vis, visible (N, L, H, k) and alpha_uniform, select, uniform (N, L, H)."""
    S, n_extra = model.cfg.n_sink_tokens, model.cfg.n_slots + model.cfg.n_sink_tokens
    layout = model.layout(tokens.shape[1], tokens.device)
    N, L, H = tokens.shape[0], model.cfg.n_layer, model.cfg.n_head
    out = {name: torch.zeros(N, L, H, *shape, dtype=torch.float64)
           for name, shape in (("alpha_vis", (k,)), ("visible", (k,)), ("alpha_uniform", ()), ("select", ()),
                               ("uniform", ()))}
    for layer, maps in enumerate(attention_maps(model, tokens)):
        seen = model.blocks[layer].attn.own(layout).mask(layout.rows())  # (S + T, n_keys) or (H, S + T, n_keys)
        seen = seen.expand(H, *seen.shape[-2:])[:, S:, n_extra:]  # (H, T, T): real queries, real keys
        a = maps[:, :, S:, n_extra:].double()  # (N, H, T, T)
        for n in range(N):
            for h in range(H):
                for j in range(k):
                    sees = [i for i in range(j, T) if seen[h, i, j]]
                    out["visible"][n, layer, h, j] = len(sees) / (T - j)
                    out["alpha_vis"][n, layer, h, j] = sum(a[n, h, i, j] for i in sees) / len(sees) if sees else 0.0
                queries = [i for i in range(T) if seen[h, i, 0]]
                out["alpha_uniform"][n, layer, h] = sum(1 / int(seen[h, i].sum()) for i in queries) / len(queries)
                kept = [[j for j in range(T) if seen[h, i, j] and a[n, h, i, j] != 0] for i in range(T)]
                out["select"][n, layer, h] = sum(0 in kept[i] for i in queries) / len(queries)
                out["uniform"][n, layer, h] = sum(len(kept[i]) / int(seen[h, i].sum()) for i in queries) / len(queries)
    return out


def measured(model, tokens, k=3, chunk=5, extra_mask=None):
    """The sparse metric (in row chunks of `chunk`, batches of 2), its result and the sink metric's scores."""
    sink, sparse = measure_model(model, tokens, ["sink", "sparse"], k=k, batch_size=2, chunk=chunk,
                                 extra_mask=extra_mask)
    return sparse, sparse.result(), sink.scores()


@pytest.mark.parametrize("case", [{"window": 5}, {"window": 4, "n_sink_tokens": 2}, {"window": 6, "attn_bias": "kv"}],
                         ids=["window", "sinks_window", "kv_bias_window"])
def test_the_chunked_metric_equals_the_brute_force(case):
    model, tokens = small_model(**case), token_ids(B=3, T=T, seed=4)
    metric, res, scores = measured(model, tokens)
    expected = brute_force(model, tokens, 3)
    for name, value in expected.items():
        torch.testing.assert_close(res[name], value, rtol=1e-9, atol=1e-12, msg=name)
    # alpha_k^vis = alpha_k / visible_k: the map is zero where a query cannot see the key
    torch.testing.assert_close((res["alpha_vis"] * res["visible"]).float(), scores.alpha, rtol=1e-5, atol=1e-7)
    assert (res["visible"][..., 0] < 1).all() and (res["alpha_vis"][..., 0] > scores.alpha[..., 0]).all()
    logged = metric.log(res)
    assert logged["sparse/alpha1_vis"] == pytest.approx(expected["alpha_vis"][..., 0].mean().item())
    assert logged["sparse/sink1_vis"] == pytest.approx(100 * (expected["alpha_vis"][..., 0] > 0.3).double().mean())
    assert logged["sparse/visible1"] == pytest.approx(case["window"] / T)  # queries 1..w see token 1
    for name, value in logged.items():
        low, high = bounds(name)
        assert math.isfinite(value) and low <= value <= high, name


def test_a_head_dependent_pattern_is_scored_per_head():
    """Strided heads (model.sparsity=strided, stride 4: heads 0-1 local, 2-3 every 4th key): the mask is
    (H, R, n_keys), and the chunked metric equals the brute force head by head (visible_1: 4/T for the local heads,
    the queries 0, 4, 8, ... for the strided ones)."""
    model, tokens = small_model(sparsity="strided", strided_stride=4), token_ids(B=2, T=T, seed=8)
    _, res, _ = measured(model, tokens)
    for name, value in brute_force(model, tokens, 3).items():
        torch.testing.assert_close(res[name], value, rtol=1e-9, atol=1e-12, msg=name)
    visible1 = res["visible"][0, 0, :, 0]
    assert visible1.tolist() == pytest.approx([4 / T, 4 / T, len(range(0, T, 4)) / T, len(range(0, T, 4)) / T])


@pytest.mark.parametrize("case", [dict(sparsity="topk", topk_k=5), dict(sparsity="moba", moba_block=4, moba_topk=2),
                                  dict(sparsity="ashape", ashape_window=3, ashape_first=1)],
                         ids=["topk", "moba", "ashape"])
def test_selections_and_patterns_equal_the_brute_force(case):
    """Keys selected from the scores (top-k, MoBA: every query can see token 1, its selection may drop it) and an
    A-shape pattern: the chunked metric equals the definitions query by query."""
    model, tokens = small_model(**case), token_ids(B=2, T=T, seed=3)
    _, res, _ = measured(model, tokens)
    for name, value in brute_force(model, tokens, 3).items():
        torch.testing.assert_close(res[name], value, rtol=1e-9, atol=1e-12, msg=name)
    if case["sparsity"] != "ashape":
        assert (res["visible"] == 1).all() and (res["select"] < 1).any()


def test_forcing_token_1_into_a_top_k_selects_it_for_every_query():
    """topk_force_first: token 1 is in every selection (select1 = 1), against k / i for a uniform choice among the
    i keys of query i (capped at 1): the ratio is above 1; without forcing, below the forced one."""
    tokens = token_ids(B=2, T=T, seed=5)
    forced = measured(small_model(sparsity="topk", topk_k=4, topk_force_first=True), tokens)[1]
    free = measured(small_model(sparsity="topk", topk_k=4), tokens)[1]
    assert (forced["select"] == 1).all()
    uniform = torch.tensor([min(1.0, 4 / (i + 1)) for i in range(T)], dtype=torch.float64).mean()
    torch.testing.assert_close(forced["uniform"], torch.full_like(forced["uniform"], uniform.item()))
    assert (free["select"] < forced["select"]).any() and (free["select"] <= 1).all()


def test_a_window_only_model_keeps_every_visible_key():
    """A window selects nothing: every key a query can see is in its map's support, so token 1's selection share is
    the uniform share exactly (both 1) and the ratio 1."""
    metric, res, _ = measured(small_model(window=5), token_ids(B=3, T=T, seed=1))
    assert torch.equal(res["select"], res["uniform"]) and (res["select"] == 1).all()
    logged = metric.log(res)
    assert logged["sparse/select1_ratio"] == 1.0 and logged["sparse/layer1/select1_ratio"] == 1.0


@pytest.mark.parametrize("w", [1, 4, 16, T])
def test_a_uniform_heads_alpha_1_on_a_window_is_the_harmonic_mean(w):
    """alpha_1^uniform of a window of w: queries 1..w see token 1 and i keys each, so (1 + 1/2 + ... + 1/w) / w
    (H_w / w; 1 at w = 1, H_T / T for a window as wide as the sequence), per layer and head, whatever the weights;
    logged, per layer and in measure --json."""
    metric, res, _ = measured(small_model(window=w), token_ids(B=2, T=T, seed=6))
    harmonic = sum(1 / i for i in range(1, w + 1)) / w
    torch.testing.assert_close(res["alpha_uniform"], torch.full_like(res["alpha_uniform"], harmonic))
    logged = metric.log(res)
    assert logged["sparse/alpha1_vis_uniform"] == pytest.approx(harmonic)
    assert logged["sparse/layer0/alpha1_vis_uniform"] == pytest.approx(harmonic)
    assert metric.json(res)["alpha1_vis_uniform"] == pytest.approx(harmonic)


def test_a_window_wider_than_the_sequence_gives_the_sink_metrics_alpha_exactly():
    """A dense causal map (window 24 at T = 24: every query i >= k sees key k): alpha^vis is alpha, bit for bit."""
    model = small_model(window=T)
    assert model.cfg.sparse_attention
    _, res, scores = measured(model, token_ids(B=3, T=T, seed=2), k=4)
    assert torch.equal(res["alpha_vis"].float(), scores.alpha) and (res["visible"] == 1).all()


def test_a_window_of_one_scores_each_key_by_its_own_query():
    """Window 1: only query k sees key k, alpha_k^vis = A[k, k] = 1 (softmax over one key), visible_k = 1/(T-k+1),
    while the sink metric's alpha_k is 1/(T-k+1)."""
    _, res, scores = measured(small_model(window=1), token_ids(B=2, T=T, seed=3), k=3)
    assert torch.allclose(res["alpha_vis"], torch.ones_like(res["alpha_vis"]))
    share = 1 / (T - torch.arange(3, dtype=torch.float64))
    assert torch.equal(res["visible"], share.expand_as(res["visible"]))
    assert torch.allclose(scores.alpha.double(), share.expand_as(res["visible"]))


def test_a_hand_built_map_gives_the_values_of_the_definitions():
    """Window 3 at T = 6 (queries 1..3 see token 1, 2..4 token 2): head 0's map is the given numbers, head 1 drops
    token 1 from query 2's selection and token 2 from query 3's (zeros where the query could see the key)."""
    Tn = 6
    ctx = Context(n_layer=1, n_head=4, eps=[0.3], k=2, model=small_model(window=3))
    metric = SparseSinkMetric(ctx)
    assert metric.applies(ctx)
    g = torch.Generator().manual_seed(0)
    window = torch.tensor([[0 <= i - j < 3 for j in range(Tn)] for i in range(Tn)])
    a = torch.rand(1, 4, Tn, Tn, generator=g) * window  # (B, H, T, T): zero outside the window
    a[0, 1, 1, 0] = 0.0  # query 2 does not select token 1
    a[0, 1, 2, 1] = 0.0  # query 3 does not select token 2
    for r0 in (0, 4):  # two chunks of rows
        metric.update_maps(0, torch.arange(r0, min(Tn, r0 + 4)), a[:, :, r0:r0 + 4])
    metric.end_batch()
    res = metric.result()
    A = a[0, 0].double()
    assert res["alpha_vis"][0, 0, 0, 0].item() == pytest.approx(((A[0, 0] + A[1, 0] + A[2, 0]) / 3).item())
    assert res["alpha_vis"][0, 0, 0, 1].item() == pytest.approx(((A[1, 1] + A[2, 1] + A[3, 1]) / 3).item())
    assert res["visible"][0, 0, 0].tolist() == pytest.approx([3 / 6, 3 / 5])
    # head 1: of queries 1..3 (those that see token 1), query 2 dropped it; keys kept / visible: 1/1, 1/2, 2/3
    assert res["select"][0, 0, 1].item() == pytest.approx(2 / 3)
    assert res["uniform"][0, 0, 1].item() == pytest.approx((1 + 1 / 2 + 2 / 3) / 3)
    assert res["select"][0, 0, 0].item() == res["uniform"][0, 0, 0].item() == 1.0
    assert metric.log(res)["sparse/select1_ratio"] == pytest.approx(
        ((1 + 1 + 2 / 3 + 1) / 4) / ((1 + 1 + (1 + 1 / 2 + 2 / 3) / 3 + 1) / 4))


def test_an_interventions_mask_is_part_of_what_a_query_can_see():
    """Under drop_first_key (queries after token 1 do not see it) only query 1 sees token 1: visible_1 = 1/T and
    alpha_1^vis = A[1, 1] = 1; token 2 is untouched."""
    model, tokens = small_model(window=5), token_ids(B=2, T=T, seed=5)
    metric, res, _ = measured(model, tokens, extra_mask=drop_first_key(0))
    assert torch.equal(res["visible"][..., 0], torch.full_like(res["visible"][..., 0], 1 / T))
    assert torch.allclose(res["alpha_vis"][..., 0], torch.ones_like(res["alpha_vis"][..., 0]))
    _, plain, _ = measured(model, tokens)
    assert torch.equal(res["visible"][..., 1], plain["visible"][..., 1])


def test_a_head_where_no_query_sees_the_key_scores_zero():
    """A mask that hides token 1 (position 2, after two learned sink tokens, which query 1 still sees) from every
    query: alpha_1^vis = visible_1 = 0, both selection shares 0 and no ratio (logged nothing, null in the JSON)."""
    metric, res, _ = measured(small_model(window=5, n_sink_tokens=2), token_ids(B=2, T=T, seed=6),
                              extra_mask=lambda b, h, q, kv: kv != 2)
    assert res["alpha_vis"].isfinite().all() and (res["visible"][..., 1] > 0).all()
    assert (res["alpha_vis"][..., 0] == 0).all() and (res["visible"][..., 0] == 0).all()
    assert (res["select"] == 0).all() and (res["uniform"] == 0).all()
    logged, part = metric.log(res), metric.json(res)
    assert logged["sparse/sink1_vis"] == 0.0 and "sparse/select1_ratio" not in logged
    assert part["select1_ratio"] is None and part["by_head"]["select1_ratio"][0][0] is None


@pytest.mark.parametrize("case", [{}, {"prefix_len": 4}, {"n_sink_tokens": 2}], ids=["causal", "prefix", "sinks"])
def test_a_dense_model_is_not_measured(case):
    model = small_model(**case)
    assert not model.cfg.sparse_attention
    assert "sparse" not in [m.name for m in METRICS.build(SinklabRecorder(model).context())]
    assert measure_model(model, token_ids(B=2, T=T), ["sparse"]) == []


def test_the_measure_text_shows_a_table_by_layer():
    metric, res, _ = measured(small_model(window=5), token_ids(B=2, T=T, seed=7))
    part = metric.json(res)
    lines = SparseSinkMetric.text(part, {})
    assert lines[0].startswith("sparse attention:")
    table = lines[lines.index(next(line for line in lines if line.startswith("layer"))):]
    assert [line.split()[0] for line in table] == ["layer", "0", "1", "all"]
    assert float(table[1].split()[2]) == pytest.approx(part["by_layer"]["alpha1_vis"][0], abs=5e-4)
    assert table[-1].split()[-1] == "1.00"  # the window keeps every visible key


def test_the_training_callback_logs_it_for_a_window_run(tmp_path, corpus):
    run = train(tmp_path / "run", *small(corpus, "model.window=4"), job=False)
    metrics = pd.read_csv(run.dir / "metrics.csv")
    for name in ("sparse/sink1_vis", "sparse/alpha1_vis", "sparse/visible1", "sparse/select1",
                 "sparse/select1_uniform", "sparse/select1_ratio", "sparse/layer0/alpha1_vis"):
        values = metrics[name].dropna()
        assert len(values) and values.between(*bounds(name)).all(), name
    # the probe set's sequences are 16 tokens long: queries 1..4 of 16 see token 1
    assert metrics["sparse/visible1"].dropna().eq(4 / 16).all()
    assert metrics["sparse/select1_ratio"].dropna().eq(1.0).all()
